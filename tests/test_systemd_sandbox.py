"""install's guard.toml (complete, commented, a GPU box's recycle defaults, flags for them) and its
preflight under the unit's own sandbox: an interpreter the service cannot run (a venv under /tmp,
hidden by PrivateTmp; a base Python under /root, mode 0700) or a model it cannot read is refused
with one line and exit 2 before anything is written.

Without systemd as PID 1 (this container) the check runs the interpreter for real through
`setpriv` as the service user (nobody standing in for a user install will create), after the
sandbox's path rules; with systemd it goes through `systemd-run` with the unit's properties (the
VM test, tests/vm/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from vllm_guard.core import config as C
from vllm_guard.systemd import guardtoml
from vllm_guard.systemd import sandbox as S

VG = str(Path(sys.prefix) / "bin" / "vllm-guard")
ROOT_DIR = Path(__file__).resolve().parent.parent
SITE = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
PROPS = {"PrivateTmp": "yes", "ProtectHome": "read-only", "InaccessiblePaths": "-/srv/secret"}
root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                               reason="running as the service user needs root and setpriv")


def install(*args: str, root: Path | None = None) -> subprocess.CompletedProcess[str]:
    where = ["--root", str(root)] if root is not None else ["--dry-run"]
    return subprocess.run([VG, "install", *where, *args], capture_output=True, text=True, timeout=300)


# -- guard.toml -------------------------------------------------------------------------------
def test_every_key_of_every_section_has_its_comment() -> None:
    for name, cls in C.SECTIONS.items():
        assert guardtoml.SECTION_HELP.get(name), name
        keys = set(cls.__struct_fields__)
        assert keys == set(guardtoml.HELP[name]), (name, keys ^ set(guardtoml.HELP[name]))


def test_a_new_guard_toml_is_complete_commented_and_recycles_on_memory_growth(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    root = tmp_path / "root"
    r = install("--model", str(model), "--port", "23981", root=root)
    assert r.returncode == 0, r.stderr
    text = (root / "etc/vllm-guard/guard.toml").read_text()
    for name, cls in C.SECTIONS.items():
        assert f"\n[{name}]\n" in text, name
        for key in cls.__struct_fields__:  # each key is there, set or commented with its default
            assert f"\n{key} = " in text or f"\n# {key} = " in text, (name, key)
    recycle = text.split("\n[recycle]\n", 1)[1].split("\n[", 1)[0]
    assert "\nmax_host_rss_growth_mb = 4096.0" in recycle and "\nmax_gpu_memory_growth_mb = 1024.0" in recycle
    assert "\nmax_requests = 0" in recycle and '\nmax_uptime = "0s"' in recycle  # off, and says so
    cfg = C.load(root / "etc/vllm-guard/guard.toml")
    assert cfg.recycle.max_requests == 0 and cfg.recycle.max_host_rss_growth_mb == 4096
    assert cfg.watchdog.forecast_horizon == C.WatchdogConfig().forecast_horizon > 0  # the forecast is on
    assert "# recycle a generation after this many requests" in recycle


def test_recycle_flags_are_written_and_bad_values_name_the_flag(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    root = tmp_path / "root"
    r = install("--model", str(model), "--port", "23982", "--max-requests", "5000", "--max-requests-jitter", "500",
                "--max-uptime", "24h", "--max-host-rss-growth-mb", "0", "--forecast-horizon", "30m", root=root)
    assert r.returncode == 0, r.stderr
    cfg = C.load(root / "etc/vllm-guard/guard.toml")
    assert (cfg.recycle.max_requests, cfg.recycle.max_requests_jitter, cfg.recycle.max_uptime) == (5000, 500, 86400)
    assert cfg.recycle.max_host_rss_growth_mb == 0 and cfg.recycle.max_gpu_memory_growth_mb == 1024
    assert cfg.watchdog.forecast_horizon == 1800
    for flag, value in (("--max-requests", "-5"), ("--max-uptime", "soon"), ("--forecast-horizon", "nan")):
        bad = install("--model", str(model), "--port", "23983", flag, value, root=tmp_path / "bad")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.count("\n") == 1 and flag in bad.stderr, bad.stderr
        assert not (tmp_path / "bad").exists()


# -- the sandbox's path rules (pure) ----------------------------------------------------------
@pytest.mark.parametrize(("path", "needle"), [
    ("/tmp/venv/bin/python", "PrivateTmp=yes"),
    ("/var/tmp/x", "PrivateTmp=yes"),
    ("/tmp", "PrivateTmp=yes"),
    ("/srv/secret/model", "InaccessiblePaths=/srv/secret"),
    ("/opt/venv/bin/python", None),
    ("/tmpfoo/python", None),
    ("/root/.pyenv/bin/python", None),  # read-only: visible, mode bits decide
])
def test_hidden_by(path: str, needle: str | None) -> None:
    why = S.hidden_by(path, PROPS)
    assert (why is None) if needle is None else (why is not None and needle in why), why


def test_protect_home_yes_hides_homes_and_root() -> None:
    assert "ProtectHome=yes" in str(S.hidden_by("/root/venv/bin/python", {"ProtectHome": "yes"}))
    assert "ProtectHome=tmpfs" in str(S.hidden_by("/home/a/m", {"ProtectHome": "tmpfs"}))


def test_unit_service_properties_reads_only_the_service_section() -> None:
    text = "[Unit]\nAfter=x\n[Service]\n# c\nUser=vg\nPrivateTmp=yes\nEnvironment=A=1\n[Install]\nWantedBy=m\n"
    assert S.unit_service_properties(text) == [("User", "vg"), ("PrivateTmp", "yes"), ("Environment", "A=1")]


@pytest.mark.parametrize(("found", "rc", "stderr", "needle"), [
    (None, 203, "Failed to execute /tmp/v/bin/python: No such file or directory", "could not execute it"),
    (None, 1, "", "exit 1: no output"),
    ({"base_prefix": "/usr", "vllm_guard": True, "vllm": True, "model_error": ""}, 0, "", ""),
    ({"base_prefix": "/elsewhere", "vllm_guard": True, "vllm": True, "model_error": ""}, 0, "", "cannot reach its base"),
    ({"base_prefix": "/usr", "vllm_guard": False, "vllm": True, "model_error": ""}, 0, "", "cannot import vllm_guard"),
    ({"base_prefix": "/usr", "vllm_guard": True, "vllm": False, "model_error": ""}, 0, "", "cannot find vLLM"),
    ({"base_prefix": "/usr", "vllm_guard": True, "vllm": True, "model_error": "PermissionError: x"}, 0, "",
     "cannot read the model /m"),
])
def test_judge(found: dict[str, object] | None, rc: int, stderr: str, needle: str) -> None:
    problem = S.judge(found, rc, stderr, "user vg", "/opt/v/bin/python", need_guard=True, need_vllm=True,
                      model="/m", base_prefix="/usr")
    assert (problem == "") if not needle else (needle in problem and "\n" not in problem), problem


# -- the check, run for real as the service user ----------------------------------------------
@pytest.fixture(scope="module")
def unit_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("unit") / "root"
    assert install("--port", "23984", root=root).returncode == 0
    return (root / "etc/systemd/system/vllm-guard.service").read_text()


@pytest.fixture
def opt_dir() -> Iterator[Path]:
    """A directory outside /tmp and homes, searchable by others (where a proper install lives)."""
    d = Path(tempfile.mkdtemp(prefix="vllm-guard-test-", dir="/opt" if os.access("/opt", os.W_OK) else None))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _venv(where: Path, share_ours: bool) -> Path:
    """A venv on the system's Python; `share_ours`: it sees this venv's packages (vllm_guard,
    vLLM) through a .pth, like a venv where the operator installed them."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None:
        pytest.skip("no system python3 to build a venv that a system user can run")
    subprocess.run([system_python, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    if share_ours:
        site = next((where / "lib").glob("python3*/site-packages"))
        (site / "ours.pth").write_text(f"import site; site.addsitedir({SITE!r})\n")
    return where / "bin" / "python"


def _console_script(where: Path, python: Path) -> str:
    """A `vllm-guard` executable whose #! names `python` (what pip writes)."""
    bin_path = where / "vllm-guard"
    bin_path.write_text(f"#!{python}\nfrom vllm_guard.cli import main\nmain()\n")
    bin_path.chmod(0o755)
    return str(bin_path)


def _check(unit_text: str, bin_path: str, model: str = "") -> S.Verdict:
    return S.check(unit_text, "vllm-guard.service", "vllm-guard-test-nouser", bin_path, "", model,
                   systemd_pid1=False, is_root=os.geteuid() == 0)


def test_a_venv_under_tmp_is_refused(unit_text: str) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        python = _venv(Path(d) / "venv", share_ours=False)
        v = _check(unit_text, _console_script(Path(d), python))
    assert "PrivateTmp=yes gives the service its own empty /tmp" in v.problem, v
    assert "\n" not in v.problem


@root_only
def test_a_base_python_under_root_is_refused(unit_text: str, opt_dir: Path) -> None:
    """This test venv's own layout when its base Python is under /root (pyenv as root)."""
    hidden = Path(tempfile.mkdtemp(dir="/root" if os.access("/root", os.W_OK) else None))
    try:
        hidden.chmod(0o700)
        python = _venv(opt_dir / "venv", share_ours=False)
        real = hidden / "python3"  # the base interpreter behind the venv's link, in a 0700 dir
        shutil.copy(os.path.realpath(python), real)
        python.unlink()
        python.symlink_to(real)
        v = _check(unit_text, _console_script(opt_dir, python))
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    assert f"cannot enter {hidden}" in v.problem or f"cannot enter {hidden.parent}" in v.problem, v
    assert "(mode 07" in v.problem


@root_only
def test_a_proper_venv_passes_and_a_missing_package_is_found_by_running_it(unit_text: str, opt_dir: Path,
                                                                            tmp_path: Path) -> None:
    bare = _venv(opt_dir / "bare", share_ours=False)
    (opt_dir / "b").mkdir()
    v = _check(unit_text, _console_script(opt_dir / "b", bare))
    assert "cannot import vllm_guard" in v.problem, v

    good = _venv(opt_dir / "good", share_ours=True)
    # the good venv reaches this checkout's packages; a checkout under a directory other users
    # cannot enter (mktemp -d makes 0700 ones) hides them from nobody, and the check says so
    probe = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", str(good), "-c",
                            "import vllm_guard"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"this checkout ({ROOT_DIR}) is not readable by other users, so no venv here can serve "
                    f"a system user: {probe.stderr.strip().splitlines()[-1:]}")
    model = opt_dir / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.bin").write_bytes(b"x")
    for p in (model, model / "config.json", model / "w.bin"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    v = _check(unit_text, _console_script(opt_dir, good), str(model))
    assert v.problem == "" and v.how.startswith("setpriv as nobody"), v

    (model / "w.bin").chmod(0o600)  # root reads it; the service user cannot (found by the run)
    v = _check(unit_text, _console_script(opt_dir, good), str(model))
    assert "cannot read the model" in v.problem and "PermissionError" in v.problem, v


def test_install_refuses_this_venv_when_the_service_cannot_run_it(tmp_path: Path) -> None:
    """The install command itself: one line, exit 2, naming the path and what hides it."""
    model = Path(tempfile.mkdtemp(prefix="vg-model-", dir="/tmp"))
    try:
        (model / "config.json").write_text("{}")
        r = install("--model", str(model), "--port", "23985")
    finally:
        shutil.rmtree(model, ignore_errors=True)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-guard: error: "), r.stderr
    assert "cannot see" in lines[0] or "cannot enter" in lines[0], lines[0]
    assert "(checked with " in lines[0]
