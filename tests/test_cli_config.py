"""Bad config, bad CLI, runtime-owned args after `--`: exit 2, one clear line, nothing started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import GUARD_CMD
from vllm_guard.core.config import ConfigError, load, parse_duration, validate, with_value, with_values


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GUARD_CMD, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize(
    "toml, needle",
    [
        ("[recycle]\nmax_requests = 'ten'\n", "[recycle] max_requests has value 'ten'"),
        ("[recycle]\nmax_requets = 10\n", "[recycle] max_requets is not a known key"),
        ("[recyle]\nmax_requests = 10\n", "[recyle] is not a known section"),
        ("[recycle]\nmax_uptime = '3 weeks'\n", "[recycle] max_uptime has value '3 weeks'"),
        ("[recycle]\nmax_requests_jitter = 5\n", "max_requests_jitter has value 5: needs max_requests"),
        ("[server]\nport = 70000\n", "[server] port has value 70000"),
        ("[server]\nport = true\n", "[server] port has value True"),
        ("[probe]\nfailures = 0\n", "[probe] failures has value 0"),
        ("[server\n", "is not valid TOML"),
        ("[server]\nprestage_weights = 'yes'\n", "[server] prestage_weights has value 'yes': one of off, on"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_key_and_value(tmp_path: Path, toml: str, needle: str) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text(toml)
    state = tmp_path / "state"
    r = run("serve", "--config", str(cfg), "--state-dir", str(state), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert not state.exists(), "nothing may be started or created on a config error"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["serve", "--max-requests", "many"], "'many' is not an integer"),
        (["serve", "--port", "x"], "'x' is not an integer"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--", "--port", "9000"], "'--port' after -- is owned by the runtime"),
        (["serve", "--", "--host=0.0.0.0"], "'--host=0.0.0.0' after -- is owned by the runtime"),
        (["serve", "--", "--model", "x"], "'--model' after -- is owned by the runtime"),
        (["serve", "--", "--ho", "0.0.0.0"], "'--ho' after -- is owned by the runtime"),  # vLLM expands it
        (["serve", "--", "--enforce-eager\n--host"], "control characters"),
        (["serve", "--max-uptime", "soon"], "max_uptime has value 'soon'"),
        (["serve", "--prestage-weights", "maybe"], "prestage_weights has value 'maybe': one of off, on"),
        (["status", "--", "x"], "arguments after -- are only for serve"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["serve", "--config", "/nonexistent/guard.toml"], "does not exist"),
    ],
)
def test_bad_cli_exits_2_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    r = run(*args, "--state-dir", str(tmp_path / "s")) if args[0] == "serve" and "--" not in args else run(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "s").exists()


def test_port_in_use_is_a_usage_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", "--port", str(port), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    assert f"cannot bind 127.0.0.1:{port}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_admin_commands_without_a_runtime_fail_cleanly(tmp_path: Path) -> None:
    r = run("status", "--state-dir", str(tmp_path))
    assert r.returncode == 1
    assert "no runtime at" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("24h", 86400), ("1d", 86400),
                                           ("250ms", 0.25), (45, 45), ("1.5h", 5400)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_unusable_state_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    from conftest import free_port

    r = run("serve", "--state-dir", str(blocker / "state"), "--port", str(free_port()))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "[server] state_dir has value" in lines[0], lines


def test_cli_flags_override_the_file(tmp_path: Path) -> None:
    from vllm_guard.cli import build_parser
    from vllm_guard.runtime.cli import serve_config

    cfg = tmp_path / "guard.toml"
    cfg.write_text("[recycle]\nmax_requests = 100\nmax_uptime = '1d'\n[server]\nvllm_args = ['--enforce-eager']\n")
    args = build_parser()[0].parse_args(["serve", "--config", str(cfg), "--max-requests", "7"])
    c = serve_config(args, ["--max-model-len", "512"])
    assert c.recycle.max_requests == 7 and c.recycle.max_uptime == 86400
    assert c.server.vllm_args == ("--enforce-eager", "--max-model-len", "512")


def test_defaults_validate() -> None:
    validate(load(None))
    with pytest.raises(ConfigError):
        parse_duration("-5s")


def test_a_ledger_that_cannot_be_read_is_one_line_and_nothing_starts(tmp_path: Path) -> None:
    from conftest import free_port

    state = tmp_path / "state"
    state.mkdir()
    (state / "ledger.sqlite").write_bytes(b"this is not an SQLite file" * 100)
    model = tmp_path / "model"  # exists (a missing model path is refused before the ledger is read)
    model.mkdir()
    r = run("serve", "--state-dir", str(state), "--port", str(free_port()), "--model", str(model))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "ledger" in lines[0], lines
    assert not (state / "logs").exists() and not (state / "admin.sock").exists()


def test_vllm_cpu_servers_that_may_overlap_are_not_bound_to_the_same_cores() -> None:
    from vllm_guard.core.config import GuardConfig
    from vllm_guard.runtime.cli import cpu_omp_bind

    c = GuardConfig()
    assert cpu_omp_bind(c, {}) == "nobind"  # auto strategy, a standby: two servers at once
    c = with_values(c, "server", {"recycle_strategy": "cold", "standby": "off"})
    assert cpu_omp_bind(c, {}) is None  # one server at a time: vLLM's own binding
    c = with_value(c, "server", "replicas", 2)
    assert cpu_omp_bind(c, {}) == "nobind"
    assert cpu_omp_bind(c, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) is None  # the operator's wins


def test_a_gpu_vllm_loads_its_compiled_graph_as_one_artifact_unless_the_operator_says_otherwise() -> None:
    from vllm_guard.runtime.cli import MEGA_AOT_VAR, gpu_mega_aot

    assert gpu_mega_aot({}, [], "0.25.1") == "1"
    assert gpu_mega_aot({}, ["--max-num-seqs", "8"], "0.32.0") == "1"
    assert gpu_mega_aot({MEGA_AOT_VAR: "0"}, [], "0.25.1") is None  # the operator's wins, off included
    assert gpu_mega_aot({}, ["--enforce-eager"], "0.25.1") is None  # nothing compiled
    assert gpu_mega_aot({}, [], "0.11.2") is None  # older than any vLLM measured with it
    assert gpu_mega_aot({}, [], "") is None  # version unknown


def test_a_gpu_vllm_forks_its_engine_core_unless_the_operator_says_otherwise() -> None:
    from vllm_guard.runtime.cli import ENGINE_START_VAR, gpu_engine_fork

    assert gpu_engine_fork({}, "0.25.1") == "fork"
    assert gpu_engine_fork({}, "0.32.0") == "fork"
    assert gpu_engine_fork({ENGINE_START_VAR: "spawn"}, "0.25.1") is None  # the operator's wins
    assert gpu_engine_fork({ENGINE_START_VAR: "fork"}, "0.25.1") is None  # already theirs: nothing to say
    assert gpu_engine_fork({}, "0.11.2") is None  # older than any vLLM measured with it
    assert gpu_engine_fork({}, "") is None  # version unknown
