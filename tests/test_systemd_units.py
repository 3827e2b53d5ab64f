"""`vllm-guard install --root`: rendered units pass `systemd-analyze verify`, config round-trips,
uninstall keeps the ledger. (The real-systemd VM test is tests/vm/test_systemd_vm.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guard import cli
from vllm_guard.core import config as C
from vllm_guard.core.errors import ConfigError
from vllm_guard.systemd import config_file as F

VG = str(Path(sys.prefix) / "bin" / "vllm-guard")
UNITS = ("vllm-guard.service", "vllm-guard@.service", "vllm-guard-watchdog.service",
         "vllm-guard-watchdog@.service", "vllm-guard-soak@.service", "vllm-guard-revive.service",
         "vllm-guard-revive.timer", "vllm-guard.socket")


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
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and u["RestartPreventExitStatus"] == ["2 4 5"]
    for key, value in (("Type", "notify"), ("NotifyAccess", "main"), ("KillMode", "process"),
                       ("OOMPolicy", "continue"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("PrivateTmp", "yes"), ("Restart", "on-failure")):
        assert u[key] == [value], key
    assert "PrivateDevices" not in u and "MemoryDenyWriteExecute" not in u
    assert u["Wants"][-1] == "%N.socket" and "%N.socket" in u["After"][0]  # the port outlives the runtime
    sock = unit_lines(root / "etc/systemd/system/vllm-guard.socket")
    assert sock["ListenStream"][0].endswith(":23997") and sock["Service"] == ["vllm-guard.service"]
    env = dict(e.split("=", 1) for e in u["Environment"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"].startswith("/var/cache/vllm-guard")
    home_hidden = any(str(Path(p).resolve()).startswith(("/root", "/home")) for p in (VG, sys.base_prefix))
    assert u["ProtectHome"] == ["read-only" if home_hidden else "yes"]
    w = unit_lines(root / "etc/systemd/system/vllm-guard-watchdog.service")
    assert w["User"] == ["vllm-guard-watchdog"] and w["SupplementaryGroups"] == ["llm systemd-journal"]
    cfg = C.load(root / "etc/vllm-guard/guard.toml")
    assert cfg.server.admin_group == "llm" and cfg.server.state_dir == "/var/lib/vllm-guard"
    assert cfg.server.drain_timeout == 300 and cfg.server.model == str(model_dir)
    assert cfg.install.start_limit_burst == 7 and cfg.install.watchdog_sec == 90
    assert "u llm - " in (root / "etc/sysusers.d/vllm-guard.conf").read_text()


def test_instance_per_gpu_set(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "root"
    r = install(root, "--model", str(model_dir), "--port", "23996", "--instance", "tp01",
                "--gpus", "GPU-0a1b2c3d-0000-1111-2222-333344445555,GPU-0a1b2c3d-0000-1111-2222-333344446666")
    assert r.returncode == 0, r.stderr
    env = (root / "etc/vllm-guard/tp01.env").read_text()
    assert "CUDA_VISIBLE_DEVICES=" not in env  # the runtime gives each replica its GPUs ([server] gpus)
    cfg = C.load(root / "etc/vllm-guard/tp01.toml")
    assert cfg.server.gpus == ("GPU-0a1b2c3d-0000-1111-2222-333344445555", "GPU-0a1b2c3d-0000-1111-2222-333344446666")
    assert cfg.server.state_dir == "/var/lib/vllm-guard/tp01"
    assert (root / "etc/systemd/system/multi-user.target.wants/vllm-guard@tp01.service").is_symlink()
    u = unit_lines(root / "etc/systemd/system/vllm-guard@.service")
    assert u["StateDirectory"] == ["vllm-guard/%i"] and u["EnvironmentFile"] == ["-/etc/vllm-guard/%i.env"]


def test_reinstall_keeps_edited_config_and_uninstall_keeps_the_ledger(tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "root"
    assert install(root, "--model", str(model_dir), "--port", "23995").returncode == 0
    conf = root / "etc/vllm-guard/guard.toml"
    conf.write_text(conf.read_text().replace("port = 23995", "port = 23994"))
    assert install(root).returncode == 0
    assert C.load(conf).server.port == 23994  # an operator's edit survives a re-install (upgrade)
    conf.write_text(conf.read_text().replace("\nmax_requests = 0\n", "\nmax_requests = 77\n"))
    assert install(root, "--port", "23993").returncode == 0  # a flag rewrites it, other keys kept
    assert C.load(conf).server.port == 23993 and C.load(conf).recycle.max_requests == 77
    ledger = root / "var/lib/vllm-guard/ledger.sqlite"
    ledger.parent.mkdir(parents=True)
    ledger.write_bytes(b"ledger")
    r = subprocess.run([VG, "uninstall", "--root", str(root)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not list((root / "etc/systemd/system").rglob("vllm-guard*"))
    assert conf.exists() and ledger.read_bytes() == b"ledger"
    r = subprocess.run([VG, "uninstall", "--root", str(root), "--purge"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and not conf.exists() and ledger.exists()


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model"], "--model has value '/nonexistent/model'"),
    (["--model", "relative/dir"], "not an absolute path"),
    (["--gpus", "0,first"], "--gpus has value 'first': not a GPU index (0, 1, ...) or UUID"),
    (["--user", "root"], "--user has value 'root'"),
    (["--port", "70000"], "--port has value 70000: must be <= 65535"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--host", "a\nb"], "--host has value 'a\\nb': control characters"),
    (["--watchdog-user", "vllm-guard"], "[install] watchdog_user has value 'vllm-guard': must differ from user"),
    (["--env", "NOT AN ASSIGNMENT"], "--env has value"),
    (["--instance", "../x"], "--instance has value '../x'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, model_dir: Path, args: list[str], needle: str) -> None:
    full = ["--model", str(model_dir), *args] if "--model" not in args else args
    r = install(tmp_path / "root", *full)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()  # nothing written


@pytest.mark.parametrize("toml, needle", [
    ('[watchdog]\nintervall = "1s"\n', "[watchdog] intervall is not a known key"),
    ('[watchdog]\ninterval = "soon"\n', "[watchdog] interval has value 'soon': not a duration"),
    ("[server]\nport = 0\n", "[server] port has value 0: must be >= 1"),
    ("[recycle]\nmax_requests_jitter = 5\n", "[recycle] max_requests_jitter has value 5: needs max_requests > 0"),
    ("[probe]\nfailures = true\n", "[probe] failures has value True: not an integer"),
    ("[soak]\nrate = -1.0\n", "[soak] rate has value -1.0: must be > 0"),
    ('[patches]\ndisable = ["kv-audit"]\n', "[patches] disable has value 'kv-audit'"),
    ("[inject]\nblock_leak_every = 1.5\n", "[inject] block_leak_every has value 1.5: not an integer"),
    ("[watchdg]\ninterval = 1\n", "[watchdg] is not a known section"),
    ("[server\n", "is not valid TOML"),
])
def test_install_validates_the_whole_config_like_every_command(tmp_path: Path, model_dir: Path, toml: str,
                                                               needle: str) -> None:
    """`install --config` rejects exactly what `serve` and `watchdog --config` reject (all of them
    load through core.config): one line, exit 2, nothing written."""
    base = tmp_path / "base.toml"
    base.write_text(toml)
    with pytest.raises(ConfigError) as every_command:
        C.load(base)
    r = install(tmp_path / "root", "--model", str(model_dir), "--config", str(base))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"vllm-guard: error: {every_command.value}"]
    assert needle in r.stderr
    assert not (tmp_path / "root").exists()


def test_a_bad_installed_config_stops_a_reinstall(tmp_path: Path, model_dir: Path) -> None:
    """A re-install reads the installed guard.toml; one a later `serve` would refuse is refused now."""
    root = tmp_path / "root"
    assert install(root, "--model", str(model_dir), "--port", "23992").returncode == 0
    conf = root / "etc/vllm-guard/guard.toml"
    conf.write_text(conf.read_text().replace("[watchdog]\n", '[watchdog]\nintervall = "1s"\n'))
    before = conf.read_text()
    r = install(root, "--port", "23991")
    assert r.returncode == 2 and "[watchdog] intervall is not a known key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and conf.read_text() == before


def test_written_config_keeps_every_section_and_long_durations(tmp_path: Path, model_dir: Path) -> None:
    """Keys the base set survive in every section (durations of days included); the file install
    writes loads back to the same settings, so `serve` and `watchdog` see what was validated."""
    base = tmp_path / "base.toml"
    base.write_text('[recycle]\nmax_uptime = "14d"\nmax_requests = 500\n[watchdog]\ninterval = "250ms"\n'
                    'gpu_budget_mb = 20000.5\n[patches]\ndisable = ["idle-release"]\n'
                    '[inject]\nhost_leak_mb_per_request = 0.15\n[soak]\nscenario = "S4"\n'
                    '[server]\nvllm_args = ["--max-model-len", "4096"]\n')
    root = tmp_path / "root"
    r = install(root, "--model", str(model_dir), "--port", "23990", "--config", str(base))
    assert r.returncode == 0, r.stderr
    written = root / "etc/vllm-guard/guard.toml"
    cfg, src = C.load(written), C.load(base)
    for section in ("watchdog", "patches", "inject", "soak"):
        assert getattr(cfg, section) == getattr(src, section), section
        assert cfg.explicit[section] == src.explicit[section], section
    # [recycle]: the base's keys, and a GPU box's memory-growth triggers for the keys it left out
    assert (cfg.recycle.max_requests, cfg.recycle.max_uptime) == (500, 14 * 86400)
    assert cfg.recycle.max_host_rss_growth_mb == 4096 and cfg.recycle.max_gpu_memory_growth_mb == 1024
    assert cfg.explicit["recycle"] == src.explicit["recycle"] | set(F.GPU_BOX_RECYCLE)
    assert cfg.recycle.max_uptime == 14 * 86400 and 'max_uptime = "14d"' in written.read_text()
    assert cfg.server.vllm_args == ("--max-model-len", "4096") and cfg.server.port == 23990
    assert "probe" not in cfg.explicit  # sections the base did not set are not written


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


def test_install_settings_validation_names_key_and_value() -> None:
    """[install] is core.config's InstallConfig: the one coercion, errors naming key and value."""
    with pytest.raises(ConfigError, match=r"\[install\] restart_sec has value 'soon'"):
        C.from_data({"install": {"restart_sec": "soon"}})
    with pytest.raises(ConfigError, match=r"memory_high has value '12 GB'"):
        C.from_data({"install": {"memory_high": "12 GB"}})
    with pytest.raises(ConfigError, match="watchdog_user has value 'x'"):
        C.from_data({"install": {"user": "x", "watchdog_user": "x"}})
    s = C.from_data({"install": {"watchdog_sec": "2m", "memory_max": "90%", "env": {"A": "1"}}}).install
    assert s.watchdog_sec == 120 and s.environment() == {"A": "1"}
    assert C.from_data({"install": C.section_table(s)}).install == s


def test_cli_registers_install_uninstall_revive() -> None:
    parser, handlers = cli.build_parser()
    assert {"install", "uninstall", "revive"} <= set(handlers)
    assert parser.parse_args(["install", "--dry-run", "--gpus", "GPU-1"]).gpus == "GPU-1"


def test_watchdog_doc_states_the_rendered_ordering(tmp_path: Path, model_dir: Path) -> None:
    """docs/WATCHDOG.md names exactly the ordering/binding directives the rendered watchdog unit has."""
    root = tmp_path / "root"
    assert install(root, "--model", str(model_dir), "--port", "23989").returncode == 0
    unit = unit_lines(root / "etc/systemd/system/vllm-guard-watchdog.service")
    doc = (Path(__file__).resolve().parent.parent / "docs/WATCHDOG.md").read_text()
    section = doc.split("## Under systemd", 1)[1].split("\n## ", 1)[0]
    for key in ("After", "PartOf", "BindsTo", "Requires", "Wants"):
        values = [v for v in unit.get(key, []) if v.startswith("vllm-guard")]
        for v in values:
            assert f"`{key}={v}`" in section, (key, v)
        if not values:
            assert f"`{key}=vllm-guard" not in section, key
    assert "no `After=`" not in doc
