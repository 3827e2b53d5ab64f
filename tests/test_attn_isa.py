"""The attention ISA probe: vLLM's AMX attention kernel run once in a throwaway process; its
verdict decides whether every vLLM process keeps AMX, asks for tile permission or avoids it.

The decision and the readers are pure (literal inputs); the probe runs as the runtime runs it,
with stand-in ops that die of SIGILL or return, and with vLLM's real kernel."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from vllm_guard.core import attn_isa
from vllm_guard.core.protocol import AttnIsaVerdict, AttnProbeRun

NO_AMX = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
AMX = NO_AMX | {"amx_bf16", "amx_tile", "amx_int8"}
PY = sys.executable


def run(outcome: str, **kw: object) -> AttnProbeRun:
    return AttnProbeRun(isa=str(kw.pop("isa", "amx")), outcome=outcome, **kw)  # type: ignore[arg-type]


# -- the decision ---------------------------------------------------------------------------------
def test_no_amx_tile_needs_no_probe_and_keeps_vllms_choice() -> None:
    assert not attn_isa.needs_probe(NO_AMX, pretend=False)
    assert attn_isa.needs_probe(AMX, pretend=False) and attn_isa.needs_probe(NO_AMX, pretend=True)
    action, why = attn_isa.decide(None, None, None)
    assert action == "keep" and "no amx_tile" in why


def test_amx_that_runs_is_kept() -> None:
    action, why = attn_isa.decide("amx", run("returned", seconds=0.2), None)
    assert action == "keep" and "AMX attention kernel runs" in why


def test_amx_that_dies_and_is_refused_permission_is_avoided() -> None:
    first = run("signal", signal="SIGILL", detail="vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache")
    second = run("refused", init_amx=True, exit_code=3, detail="the kernel did not grant AMX tile permission")
    action, why = attn_isa.decide("amx", first, second)
    assert action == "avoid-amx"
    assert "died of SIGILL in vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache" in why and "vec" in why


def test_amx_that_runs_once_permission_is_asked_asks_in_every_process() -> None:
    action, why = attn_isa.decide("amx", run("signal", signal="SIGILL"), run("returned", init_amx=True))
    assert action == "request-amx" and "_init_amx" in why


def test_a_crash_of_a_kernel_that_is_not_amx_is_not_routed_around() -> None:
    assert attn_isa.decide("vec", run("signal", isa="vec", signal="SIGSEGV"), None)[0] == "keep"
    action, why = attn_isa.decide(None, run("exit", isa="?", exit_code=1, detail="ImportError: x"), None)
    assert action == "keep" and "could not ask vLLM" in why


def test_a_probe_that_hangs_avoids_amx() -> None:
    first = run("timeout", detail="no answer in 300 s")
    assert attn_isa.decide("amx", first, run("timeout", init_amx=True))[0] == "avoid-amx"


# -- reading what the probe left ------------------------------------------------------------------
DUMP = """Fatal Python error: Illegal instruction

Thread 0x00007f52a2665b80 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/_ops.py", line 1279 in __call__
  File "/v/lib/python3.11/site-packages/vllm/_custom_ops.py", line 3927 in cpu_attention_with_kv_cache
  File "/v/lib/python3.11/site-packages/vllm_guard/patches/attn_probe.py", line 52 in vllm_kernels
"""


def test_a_signal_is_read_with_the_frame_below_torchs_dispatch() -> None:
    r = attn_isa.read_run("amx", False, -signal.SIGILL, '{"picked": "amx"}\n{"isa": "amx"}\n', DUMP, 3.14159)
    assert (r.outcome, r.signal, r.detail, r.seconds) == (
        "signal", "SIGILL", "vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache", 3.14)


def test_returned_refused_and_plain_exits_are_told_apart() -> None:
    ok = attn_isa.read_run("vec", False, 0, '{"picked": "vec"}\n{"isa": "vec"}\n{"returned": true}\n', "", 1)
    assert ok.outcome == "returned" and ok.isa == "vec"
    refused = attn_isa.read_run("amx", True, 3, '{"picked": "amx"}\n{"init_amx": false}\n{"refused": true}\n', "", 1)
    assert refused.outcome == "refused"
    bad = attn_isa.read_run("amx", False, 1, "noise\n", "Traceback...\nImportError: no module\n", 1)
    assert (bad.outcome, bad.exit_code, bad.detail) == ("exit", 1, "ImportError: no module")
    assert attn_isa.picked_of('junk\n{"picked": "amx"}\n') == "amx" and attn_isa.picked_of("") is None


def test_cpu_flags_come_from_the_first_flags_line(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu amx_tile amx_bf16\n\n"
                 "processor\t: 1\nflags\t\t: fpu\n")
    assert attn_isa.cpu_flags(f) == {"fpu", "amx_tile", "amx_bf16"}
    assert attn_isa.cpu_flags(tmp_path / "missing") == frozenset()


# -- the cache ------------------------------------------------------------------------------------
def test_the_verdict_is_cached_per_vllm_version_cpu_and_pretence(tmp_path: Path) -> None:
    k = attn_isa.cache_key("0.32.0", AMX, False)
    assert len({k, attn_isa.cache_key("0.33.0", AMX, False), attn_isa.cache_key("0.32.0", NO_AMX, False),
                attn_isa.cache_key("0.32.0", AMX, True)}) == 4
    v = AttnIsaVerdict(key=k, vllm_version="0.32.0", picked="amx", action="avoid-amx", reason="r",
                       runs=(run("signal", signal="SIGILL"),))
    attn_isa.store(tmp_path, v)
    assert attn_isa.load(tmp_path, k) == v
    assert attn_isa.load(tmp_path, attn_isa.cache_key("0.33.0", AMX, False)) is None
    (tmp_path / attn_isa.CACHE).write_text("{torn")
    assert attn_isa.load(tmp_path, k) is None


def test_a_cpu_without_amx_tile_is_decided_without_a_process(tmp_path: Path) -> None:
    v, cached = attn_isa.verdict(tmp_path, "/nonexistent/python", "0.32.0", {}, flags=NO_AMX)
    assert (v.action, v.runs, cached) == ("keep", (), False)
    assert attn_isa.verdict(tmp_path, "/nonexistent/python", "0.32.0", {}, flags=NO_AMX)[1] is True


def test_the_env_carries_the_verdict_and_nothing_else_is_one() -> None:
    v = AttnIsaVerdict(key="k", vllm_version="0.32.0", action="keep", reason="r")
    assert attn_isa.from_env({attn_isa.VAR: v.model_dump_json(by_alias=True)}) == v
    assert attn_isa.from_env({}) is None and attn_isa.from_env({attn_isa.VAR: '{"action": "x"}'}) is None


# -- the probe process, as the runtime runs it ----------------------------------------------------
needs_vllm = pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="needs vllm")

STANDINS = '''
import os, signal, faulthandler
faulthandler.enable()
def sigill(isa):
    os.kill(os.getpid(), signal.SIGILL)
def returns(isa):
    assert isa == "amx"
'''


@pytest.fixture
def standin_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "attn_standins.py").write_text(STANDINS)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@needs_vllm
def test_a_kernel_that_dies_of_sigill_makes_every_process_avoid_amx(tmp_path: Path, standin_env: dict[str, str]) -> None:
    v, cached = attn_isa.verdict(tmp_path, PY, "0.32.0", standin_env, pretend=True, op="attn_standins:sigill",
                                 flags=NO_AMX)
    assert not cached and v.picked == "amx" and v.action == "avoid-amx"
    assert [(r.init_amx, r.outcome) for r in v.runs][0] == (False, "signal") and v.runs[0].signal == "SIGILL"
    assert "SIGILL" in v.reason
    # the second look, after asking for tile permission: refused where the kernel has no AMX to
    # grant, else the stand-in dies again; either way AMX is avoided
    assert v.runs[1].init_amx and v.runs[1].outcome in ("refused", "signal")


@needs_vllm
def test_a_kernel_that_returns_keeps_amx(tmp_path: Path, standin_env: dict[str, str]) -> None:
    v, _ = attn_isa.verdict(tmp_path, PY, "0.32.0", standin_env, pretend=True, op="attn_standins:returns",
                            flags=NO_AMX)
    assert (v.picked, v.action, [r.outcome for r in v.runs]) == ("amx", "keep", ["returned"])
    assert "runs on this CPU" in v.reason


def test_pretend_amx_is_refused_where_vllm_loads_a_build_without_amx_kernels() -> None:
    """An AVX2-only CPU (AMD EPYC, seen) makes vLLM load `_C_AVX2`: a pretended AMX there dies in
    the linear layers (no `convert_weight_packed`), which no real AMX CPU does."""
    assert attn_isa.pretend_refused(NO_AMX) is None and attn_isa.pretend_refused(AMX) is None
    why = attn_isa.pretend_refused(frozenset({"fpu", "avx2", "avx512f"}))
    assert why is not None and why.startswith("[inject] pretend_amx needs a CPU with avx512_bf16")


def test_serve_refuses_pretend_amx_on_such_a_cpu_with_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_guard.core.config import from_data
    from vllm_guard.core.errors import ConfigError, EXIT_USAGE
    from vllm_guard.runtime.cli import attention_isa

    monkeypatch.delenv("VLLM_GUARD_INJECT", raising=False)
    cfg = from_data({"inject": {"pretend_amx": True}})
    with pytest.raises(ConfigError, match="pretend_amx needs a CPU with avx512_bf16") as e:
        attention_isa(cfg, PY, "0.32.0", flags=frozenset({"fpu", "avx2"}))
    assert e.value.exit_code == EXIT_USAGE


EMULABLE = attn_isa.pretend_refused(attn_isa.cpu_flags())


@needs_vllm
@pytest.mark.skipif(EMULABLE is not None, reason=f"this CPU cannot stand for an AMX one: {EMULABLE}")
def test_vllms_real_amx_kernel_gets_the_verdict_its_behaviour_earns(tmp_path: Path) -> None:
    """With AMX pretended, vLLM's own AMX kernel runs: where this CPU cannot execute AMX tiles
    (no AMX at all, or AMX the kernel will not grant) it dies of SIGILL at vLLM's op and AMX is
    avoided; where it can, it returns and is kept. Both are right; a third answer is not."""
    v, _ = attn_isa.verdict(tmp_path, PY, "0.32.0", dict(os.environ), pretend=True, flags=NO_AMX)
    assert v.picked == "amx"
    if v.action == "avoid-amx":
        assert v.runs[0].signal == "SIGILL" and "cpu_attention_with_kv_cache" in v.runs[0].detail
    else:
        assert v.action in ("keep", "request-amx") and v.runs[-1].outcome == "returned"


@needs_vllm
def test_the_wrapper_answers_vllms_own_choice_without_amx() -> None:
    import torch
    from vllm.v1.attention.backends import cpu_attn

    from vllm_guard.patches.attn_isa import without_amx

    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: True  # as `[inject] pretend_amx` does
    try:
        pick = cpu_attn._get_attn_isa
        assert pick(torch.bfloat16, 32, 64, "auto") == "amx"
        chosen = without_amx(pick)
        assert chosen(torch.bfloat16, 32, 64, "auto") == "vec"
        assert chosen(torch.bfloat16, 16, 64, "auto") == "vec16"
        assert chosen(torch.float32, 32, 64, "auto") == pick(torch.float32, 32, 64, "auto")
        assert torch.cpu._is_amx_tile_supported() is True  # put back after each answer
    finally:
        torch.cpu._is_amx_tile_supported = real
