"""`vllm-guard install --root`: rendered units pass `systemd-analyze verify`, config round-trips,
uninstall keeps the ledger. (The real-systemd VM test is tests/vm/test_systemd_vm.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guard.runtime import cli
from vllm_guard.runtime import config as rc
from vllm_guard.systemd import settings as S

VG = str(Path(sys.prefix) / "bin" / "vllm-guard")
UNITS = ("vllm-guard.service", "vllm-guard@.service", "vllm-guard-watchdog.service",
         "vllm-guard-watchdog@.service", "vllm-guard-soak@.service", "vllm-guard-revive.service",
         "vllm-guard-revive.timer")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that looks like a local model to the installer (it is never served here)."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text("{}")
    return d


def install(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VG, "install", "--root", str(root), *extra], capture_output=True, text=True,
                          timeout=120)


def unit_lines(path: Path) -> dict[str, list[str]]:
    """KEY -> values of a unit file (keys repeat, so not configparser)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: apt-get install systemd"
    return subprocess.run([tool, "verify", *map(str, paths)], capture_output=True, text=True, timeout=120)


def instances(unit_dir: Path, dest: Path) -> list[Path]:
    """Templates cannot be verified bare: copy each as a named instance (foo@.service -> foo@t0.service)."""
    out = []
    for name in UNITS:
        src = unit_dir / name
        target = dest / name.replace("@.", "@t0.") if "@." in name else src
        if target != src:
            shutil.copy(src, target)
        out.append(target)
    return out


def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "root"
    r = install(root, "--model", str(model_dir), "--port", "23999", "--env", "VLLM_CPU_KVCACHE_SPACE=1")
    assert r.returncode == 0, r.stderr
    unit_dir = root / "etc/systemd/system"
    assert sorted(p.name for p in unit_dir.glob("vllm-guard*")) == sorted(UNITS)
    for name in UNITS:
        assert not re.search(r"@[a-z_]+@", (unit_dir / name).read_text()), name  # no placeholder left
    checked = tmp_path / "verify"
    checked.mkdir()
    out = verify(instances(unit_dir, checked))
    assert out.returncode == 0, out.stdout + out.stderr
    noise = [line for line in (out.stdout + out.stderr).splitlines() if "vllm-guard" in line]
    assert noise == [], noise  # unknown keys are only warnings to systemd: we allow none
    assert (root / "etc/systemd/system/multi-user.target.wants/vllm-guard.service").is_symlink()
    assert (root / "etc/systemd/system/timers.target.wants/vllm-guard-revive.timer").is_symlink()


def test_verify_fails_when_execstart_binary_is_missing(tmp_path: Path, model_dir: Path) -> None:
    """The check above can fail: a unit whose ExecStart binary is gone does not verify."""
    root = tmp_path / "root"
    assert install(root, "--model", str(model_dir), "--port", "23998").returncode == 0
    unit = root / "etc/systemd/system/vllm-guard.service"
    unit.write_text(unit.read_text().replace(f"ExecStart={VG} ", "ExecStart=/nonexistent/vllm-guard "))
    out = verify([unit])
    assert out.returncode != 0 and "/nonexistent/vllm-guard" in out.stdout + out.stderr


def test_service_values_follow_the_config(tmp_path: Path, model_dir: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text('[server]\ndrain_timeout = "300s"\nstop_timeout = "20s"\nmemory_release_timeout = "10s"\n'
                    '[install]\nwatchdog_sec = "90s"\nmemory_max = "48G"\nstart_limit_burst = 7\n')
    root = tmp_path / "root"
    r = install(root, "--model", str(model_dir), "--port", "23997", "--config", str(base), "--user", "llm")
    assert r.returncode == 0, r.stderr
    u = unit_lines(root / "etc/systemd/system/vllm-guard.service")
    assert u["TimeoutStopSec"] == ["360s"]  # 300 drain + 20 stop + 10 memory release + 30 margin
    assert u["WatchdogSec"] == ["90s"] and u["MemoryMax"] == ["48G"] and u["StartLimitBurst"] == ["7"]
    assert u["User"] == ["llm"] and u["Group"] == ["llm"]
    assert u["ExecStart"] == [f"{VG} serve --config /etc/vllm-guard/guard.toml --state-dir /var/lib/vllm-guard"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and u["RestartPreventExitStatus"] == ["2 4"]
    for key, value in (("Type", "notify"), ("NotifyAccess", "main"), ("KillMode", "mixed"),
                       ("OOMPolicy", "continue"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("PrivateTmp", "yes"), ("Restart", "on-failure")):
        assert u[key] == [value], key
    assert "PrivateDevices" not in u and "MemoryDenyWriteExecute" not in u
    env = dict(e.split("=", 1) for e in u["Environment"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"].startswith("/var/cache/vllm-guard")
    home_hidden = any(str(Path(p).resolve()).startswith(("/root", "/home")) for p in (VG, sys.base_prefix))
    assert u["ProtectHome"] == ["read-only" if home_hidden else "yes"]
    w = unit_lines(root / "etc/systemd/system/vllm-guard-watchdog.service")
    assert w["User"] == ["vllm-guard-watchdog"] and w["SupplementaryGroups"] == ["llm systemd-journal"]
    cfg = rc.load(root / "etc/vllm-guard/guard.toml")
    assert cfg.server.admin_group == "llm" and cfg.server.state_dir == "/var/lib/vllm-guard"
    assert cfg.server.drain_timeout == 300 and cfg.server.model == str(model_dir)
    assert S.parse(cfg.install).start_limit_burst == 7
    assert "u llm - " in (root / "etc/sysusers.d/vllm-guard.conf").read_text()


def test_instance_per_gpu_set(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "root"
    r = install(root, "--model", str(model_dir), "--port", "23996", "--instance", "tp01",
                "--gpus", "GPU-0a1b2c3d-0000-1111-2222-333344445555,GPU-0a1b2c3d-0000-1111-2222-333344446666")
    assert r.returncode == 0, r.stderr
    env = (root / "etc/vllm-guard/tp01.env").read_text()
    assert ('CUDA_VISIBLE_DEVICES="GPU-0a1b2c3d-0000-1111-2222-333344445555,'
            'GPU-0a1b2c3d-0000-1111-2222-333344446666"') in env
    assert rc.load(root / "etc/vllm-guard/tp01.toml").server.state_dir == "/var/lib/vllm-guard/tp01"
    assert (root / "etc/systemd/system/multi-user.target.wants/vllm-guard@tp01.service").is_symlink()
    u = unit_lines(root / "etc/systemd/system/vllm-guard@.service")
    assert u["StateDirectory"] == ["vllm-guard/%i"] and u["EnvironmentFile"] == ["-/etc/vllm-guard/%i.env"]


def test_reinstall_keeps_edited_config_and_uninstall_keeps_the_ledger(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "root"
    assert install(root, "--model", str(model_dir), "--port", "23995").returncode == 0
    conf = root / "etc/vllm-guard/guard.toml"
    conf.write_text(conf.read_text().replace("port = 23995", "port = 23994"))
    assert install(root).returncode == 0
    assert rc.load(conf).server.port == 23994  # an operator's edit survives a re-install (upgrade)
    conf.write_text(conf.read_text() + "\n[recycle]\nmax_requests = 77\n")
    assert install(root, "--port", "23993").returncode == 0  # a flag rewrites it, other keys kept
    assert rc.load(conf).server.port == 23993 and rc.load(conf).recycle.max_requests == 77
    ledger = root / "var/lib/vllm-guard/ledger.sqlite"
    ledger.parent.mkdir(parents=True)
    ledger.write_bytes(b"ledger")
    r = subprocess.run([VG, "uninstall", "--root", str(root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not list((root / "etc/systemd/system").rglob("vllm-guard*"))
    assert conf.exists() and ledger.read_bytes() == b"ledger"
    r = subprocess.run([VG, "uninstall", "--root", str(root), "--purge"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not conf.exists() and ledger.exists()


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model"], "--model has value '/nonexistent/model'"),
    (["--model", "relative/dir"], "not an absolute path"),
    (["--gpus", "0,1"], "[install] gpus has value ['0', '1']"),
    (["--user", "root"], "--user has value 'root'"),
    (["--port", "70000"], "--port has value 70000"),
    (["--env", "NOT AN ASSIGNMENT"], "--env has value"),
    (["--instance", "../x"], "--instance has value '../x'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, model_dir: Path, args: list[str], needle: str) -> None:
    full = ["--model", str(model_dir), *args] if "--model" not in args else args
    r = install(tmp_path / "root", *full)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()  # nothing written


def test_model_unreadable_by_the_service_user(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    (model / "model.safetensors").chmod(0o600)
    r = install(tmp_path / "root", "--model", str(model))
    assert r.returncode == 2 and "model.safetensors' is mode 0600" in r.stderr and "chmod -R a+rX" in r.stderr


def test_unknown_install_key_names_key(tmp_path: Path, model_dir: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text('[install]\nmemory_maxx = "8G"\n')
    r = install(tmp_path / "root", "--model", str(model_dir), "--config", str(base))
    assert r.returncode == 2 and "[install] memory_maxx is not a known key" in r.stderr


def test_settings_validation_names_key_and_value() -> None:
    with pytest.raises(rc.ConfigError, match=r"\[install\] restart_sec has value 'soon'"):
        S.parse({"restart_sec": "soon"})
    with pytest.raises(rc.ConfigError, match=r"memory_high has value '12 GB'"):
        S.parse({"memory_high": "12 GB"})
    with pytest.raises(rc.ConfigError, match="watchdog_user has value 'x'"):
        S.parse({"user": "x", "watchdog_user": "x"})
    s = S.parse({"watchdog_sec": "2m", "memory_max": "90%", "gpus": ["MIG-1234-ab"]})
    assert s.watchdog_sec == 120 and s.environment() == {"CUDA_VISIBLE_DEVICES": "MIG-1234-ab"}
    assert S.parse(S.to_table(s)) == s


def test_cli_registers_install_uninstall_revive() -> None:
    parser = cli.build_parser()
    assert {"install", "uninstall", "revive"} <= set(cli.EXTRA_HANDLERS)
    assert parser.parse_args(["install", "--dry-run", "--gpus", "GPU-1"]).gpus == "GPU-1"
