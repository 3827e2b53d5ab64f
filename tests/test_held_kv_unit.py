"""The held KV cache: the holder's KV buffers, the engine's allocation wrap, and the rules that keep
two computing generations off one KV cache.

- A real `python -m vllm_guard.patches.holder` (shared host memory here, CUDA IPC on a GPU box):
  the first ask allocates zeroed buffers, a second engine maps the same bytes, another key or
  other sizes are refused, and RETIRE waits for an engine that maps the KV cache.
- The patch on the real vLLM in this venv: its KV cache allocation maps the holder's buffer (the
  views vLLM builds alias it), and a mode the runtime wrote at the gate wins over the spawn's.
- The pure rules (`decide`, `strategy`): a late gate opens once nothing else maps the held KV cache,
  without waiting for GPU room; an overlap successor takes its own KV cache while the serving one
  maps the held one; a late standby never opens beside the serving generation.
"""

from __future__ import annotations

import asyncio
import os
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from test_holder_unit import client, engine_that_maps, holder  # noqa: F401 - `holder`: the real holder process, per device
from replica_world import tweak
from test_replica_machine import NOW, facts, gen, kinds, view_of
from vllm_guard.core import config_schema
from vllm_guard.core import holder as contract
from vllm_guard.core import plugin as plugin_contract
from vllm_guard.patches import held_kv
from vllm_guard.runtime.child.holder import HolderProcess
from vllm_guard.runtime.replica.decide import decide
from vllm_guard.runtime.replica.machine import State
from vllm_guard.runtime.replica.steps import prior_rate
from vllm_guard.runtime.replica.strategy import MemoryFit, late_gate_fits, overlap_fits
from vllm_guard.runtime.replica.view import Abandon, GenPhase, LearnStandby, Log, OpenGate, RecycleCmd, Spawn, Tick

torch = pytest.importorskip("torch")
S = State
GIB = 1024.0


def ask_kv(h: HolderProcess, key: str, sizes: tuple[int, ...], pid: int | None = None) -> tuple[Any, Any]:
    c = client(h)
    try:
        return c.ask(contract.HolderRequest(op=contract.Op.KV, key=key, sizes=sizes, generation=1, pid=pid))
    finally:
        c.close()


# -- the holder ----------------------------------------------------------------------------------
def test_the_first_ask_allocates_zeroed_buffers_and_the_next_maps_the_same_bytes(holder: HolderProcess) -> None:
    reply, payload = ask_kv(holder, "kv1", (4096, 1024))
    assert reply.ok and payload is not None, reply
    first = payload["kv"]
    assert [int(b.numel()) for b in first] == [4096, 1024] and all(b.dtype is torch.int8 for b in first)
    assert all(int(b.abs().sum()) == 0 for b in first), "a fresh KV cache is zeroed"
    first[0][:8] = torch.arange(1, 9, dtype=torch.int8, device=first[0].device)  # the engine writes its blocks
    if holder.device == "cuda":
        torch.cuda.synchronize()
    reply, payload = ask_kv(holder, "kv1", (4096, 1024))
    assert reply.ok and payload is not None, reply
    assert payload["kv"][0][:8].cpu().tolist() == list(range(1, 9)), "the second engine maps the same bytes"
    assert reply.state.kv_key == "kv1" and reply.state.kv_bytes == 5120, reply.state

    reply, payload = ask_kv(holder, "kv2", (4096, 1024))  # the cache's shape changed
    assert not reply.ok and payload is None and "another KV cache is held" in reply.error, reply
    reply, payload = ask_kv(holder, "kv1", (4096,))
    assert not reply.ok and "sizes differ" in reply.error, reply
    reply, _ = ask_kv(holder, "kv1", ())
    assert not reply.ok  # still held as it was
    assert asyncio.run(holder.stat()).kv_bytes == 5120


def test_a_fresh_holder_refuses_bad_sizes(holder: HolderProcess) -> None:
    reply, payload = ask_kv(holder, "kv1", (0,))
    assert not reply.ok and payload is None and "bad KV cache sizes" in reply.error
    assert reply.state.kv_bytes == 0


def test_retire_waits_for_an_engine_that_maps_the_kv_cache(holder: HolderProcess) -> None:
    engine = engine_that_maps(holder, "c.HolderRequest(op=c.Op.KV,key='kv',sizes=(2048,),pid=os.getpid())")
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == b"mapped"
        st = asyncio.run(holder.stat())
        assert st is not None and st.kv_mappers == [engine.pid] and st.mappers == [], st
        assert holder.status().kv_mappers == [engine.pid]
        assert not asyncio.run(holder.retire()), "retired while an engine maps the KV cache"
    finally:
        engine.kill()
        engine.wait()
    assert asyncio.run(holder.retire())


# -- the engine's side -------------------------------------------------------------------------------
def test_only_the_expected_int8_zeros_of_this_thread_are_substituted() -> None:
    bufs = [torch.full((16,), 7, dtype=torch.int8), torch.full((8,), 9, dtype=torch.int8)]
    real = torch.zeros
    with held_kv._Substitute(torch, bufs) as sub:
        assert torch.zeros(16, dtype=torch.float32).sum() == 0  # another dtype: a real allocation
        a = torch.zeros(16, dtype=torch.int8)
        assert a is bufs[0]
        assert torch.zeros(16, dtype=torch.int8) is not bufs[1]  # not the next expected size
        b = torch.zeros(8, dtype=torch.int8, device="cpu")
        assert b is bufs[1] and sub.used == 2
        assert int(torch.zeros(8, dtype=torch.int8).sum()) == 0  # all handed out: real ones again
    assert torch.zeros is real


def test_the_allocation_sizes_of_each_vllm_shape() -> None:
    t = types.SimpleNamespace
    cfg = t(kv_cache_tensors=[t(size=100, block_stride=10), t(size=100, block_stride=10), t(size=50, block_stride=0)])
    assert held_kv.sizes_025(cfg) == [100, 50]  # packed tensors share one backing
    assert held_kv.sizes_032(t(kv_cache_tensors=[t(size=64), t(size=64)])) == [64]
    assert held_kv.sizes_032(t(kv_cache_tensors=[t(size=64), t(size=32)])) == []
    assert held_kv.sizes_032(t(kv_cache_tensors=[])) == []


def test_the_runtimes_word_at_the_gate_wins_over_the_spawns(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    env = {plugin_contract.KV_VAR: "held", contract.HOLDER_VAR: "/x.sock", contract.HOLDER_KEY_VAR: "00"}
    assert held_kv.asked(env) and held_kv.mode(env) == "held"
    assert held_kv.mode({plugin_contract.KV_VAR: "held"}) == "own", "no holder: nothing to map"
    env[plugin_contract.GATE_VAR] = str(gate)
    assert held_kv.mode(env) == "held"  # not opened yet: the spawn's word
    plugin_contract.open_gate(gate, "own")
    assert plugin_contract.gate_is_open(gate) and held_kv.mode(env) == "own"
    plugin_contract.open_gate(gate)  # an opening that says nothing leaves the spawn's word
    assert held_kv.mode(env) == "held"
    assert not held_kv.late(env)
    assert held_kv.late({**env, plugin_contract.GATE_AT_VAR: "ready"})
    assert not held_kv.late({plugin_contract.GATE_AT_VAR: "ready"}), "not gated: nothing to park at"


def test_vllms_own_kv_allocation_maps_the_holders_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `allocate_kv_cache` of the vLLM in this venv, wrapped: the per-layer views vLLM
    builds alias the holder's buffer (a second mapping sees what the first engine wrote)."""
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    if not callable(getattr(gmr, "allocate_kv_cache", None)):
        pytest.skip("this vLLM allocates in GPUModelRunner._allocate_kv_cache_tensors (0.25's shape, GPU tests)")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout

    h = HolderProcess(0, tmp_path, sys.executable, dict(os.environ), "cpu")
    assert asyncio.run(h.ensure()), h.error
    reports: list[Any] = []
    monkeypatch.setitem(os.environ, plugin_contract.KV_VAR, "held")
    monkeypatch.setitem(os.environ, contract.HOLDER_VAR, str(h.path))
    monkeypatch.setitem(os.environ, contract.HOLDER_KEY_VAR, h.key)
    orig = gmr.allocate_kv_cache
    try:
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
        blocks, layers = 4, ["model.layers.0.attn", "model.layers.1.attn"]
        page = spec.page_size_bytes
        size = page * blocks * len(layers)
        cfg = KVCacheConfig(num_blocks=blocks, kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
                            kv_cache_tensors=[KVCacheTensor(size=size, layers=layers, layer_stride=page * blocks,
                                                            block_stride=page)])
        patch = held_kv.HeldKv(str(h.path), bytes.fromhex(h.key), reports.append, lambda where: None)
        assert patch.install() == "gpu_model_runner.allocate_kv_cache"
        views = gmr.allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBHNC)
        assert reports and reports[-1].source == "held" and reports[-1].bytes == size, reports
        views[layers[1]].view(-1)[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
        reply, payload = ask_kv(h, reply_key(h), (size,))
        assert reply.ok and payload is not None, reply
        again = payload["kv"][0].view(torch.bfloat16)
        assert 1.0 in again.tolist() and 4.0 in again.tolist(), "vLLM's views do not alias the held buffer"
        # the runtime says "own" at the gate: vLLM allocates its own as always
        gate = tmp_path / "gate"
        plugin_contract.open_gate(gate, "own")
        monkeypatch.setitem(os.environ, plugin_contract.GATE_VAR, str(gate))
        mine = gmr.allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBHNC)
        assert reports[-1].source == "own" and "own" in reports[-1].reason, reports[-1]
        assert float(mine[layers[1]].view(-1)[:4].float().abs().sum()) == 0.0
    finally:
        gmr.allocate_kv_cache = orig
        asyncio.run(h.stop())


def reply_key(h: HolderProcess) -> str:
    st = asyncio.run(h.stat())
    assert st is not None and st.kv_key
    return st.kv_key


# -- the rules -----------------------------------------------------------------------------------
FIT = MemoryFit(host_available_mb=20 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB,
                gpu_free_mb=3.5 * GIB, gpu_total_mb=24 * GIB, gpu_footprint_mb=1.3 * GIB,
                vllm_free_mb=60 * GIB, vllm_needs_mb=12 * GIB)


def test_a_held_kv_cache_is_counted_for_an_overlap_and_lets_a_late_gate_fit() -> None:
    assert overlap_fits(FIT)[0], "without a held KV cache the engine's own memory is all a successor needs"
    held = replace(FIT, kv_held_mb=6 * GIB)
    ok, why = overlap_fits(held)
    assert not ok and "KV cache of its own" in why
    ok, why = late_gate_fits(held)
    assert ok and "own 1.3 GiB" in why, why
    assert not late_gate_fits(FIT)[0], "no held KV cache: nothing to park ready on"
    assert not late_gate_fits(replace(held, gpu_free_mb=1.5 * GIB))[0]
    # vLLM's start check counts what the engine maps from the holder as its own (`held-kv`)
    assert late_gate_fits(replace(held, vllm_free_mb=10 * GIB))[0]
    assert "start check" in late_gate_fits(replace(held, vllm_free_mb=5 * GIB))[1]
    assert late_gate_fits(replace(held, vllm_free_mb=5 * GIB, weights_held_mb=12 * GIB))[0]


def test_the_late_gate_has_a_margin_of_its_own() -> None:
    """Measured on the H100 with the 7B shape on a 24 GiB budget: 2 535 MiB free beside a serving
    engine that held 1 938 MiB of its own; a late start peaked at 1 978 MiB. The overlap's 1 GiB
    margin said no; the late gate's default says yes, and its own figure is what decides."""
    shape = replace(FIT, gpu_free_mb=2535.0, gpu_footprint_mb=1938.0, kv_held_mb=6 * GIB)
    assert not overlap_fits(shape)[0]
    ok, why = late_gate_fits(shape)
    assert ok and "256 MiB margin" in why, why
    assert not late_gate_fits(replace(shape, late_margin_mb=1024.0))[0]
    assert MemoryFit(host_available_mb=0, host_footprint_mb=None).late_margin_mb == \
        config_schema.ServerConfig().late_gate_margin_mb == 256.0


def serving_with_held_kv(**kw: Any) -> Any:
    v = view_of(S.SERVING)
    cur = replace(v.current, **{"kv": "held", "kv_mb": 6 * GIB, "fit": FIT, **kw})
    return replace(v, current=cur, facts=facts(nvml=True))


def test_a_gated_successor_parks_ready_where_the_serving_one_maps_the_held_kv_cache() -> None:
    d = decide(serving_with_held_kv(), RecycleCmd(reason="t"), NOW)
    spawn = kinds(d, Spawn)
    assert spawn and spawn[0].gated and spawn[0].late and spawn[0].kv == "held", d.effects
    assert d.machine.recycle is not None and d.machine.recycle.strategy == "gated"

    v = serving_with_held_kv()
    v = replace(v, current=replace(v.current, kv="own", kv_mb=0.0))
    spawn = kinds(decide(v, RecycleCmd(reason="t"), NOW), Spawn)
    assert spawn and spawn[0].kv == "held", spawn  # an overlap (two fit), and the held KV cache is free
    assert not spawn[0].gated

    v = serving_with_held_kv()
    v = replace(v, facts=facts(nvml=False))
    spawn = kinds(decide(v, RecycleCmd(reason="t"), NOW), Spawn)
    assert spawn and not spawn[0].late, "no GPU readings: it parks before CUDA as ever"

    v = replace(serving_with_held_kv(), facts=facts(nvml=True, standby_failures=1))
    d = decide(v, RecycleCmd(reason="t"), NOW)
    spawn = kinds(d, Spawn)
    assert spawn and spawn[0].gated and not spawn[0].late, "a late start was lost: the next one parks before CUDA"


def test_an_overlap_successor_takes_its_own_kv_cache_while_the_serving_one_maps_the_held_one() -> None:
    v = serving_with_held_kv(fit=replace(FIT, gpu_free_mb=40 * GIB))
    d = decide(v, RecycleCmd(reason="t"), NOW)
    spawn = kinds(d, Spawn)
    assert spawn and not spawn[0].gated and spawn[0].kv == "own", d.effects


def test_where_two_generations_fit_the_standby_parks_ready_on_a_kv_cache_of_its_own() -> None:
    """On a large budget a standby parked ready on the held KV cache could take over only after the
    old generation is gone (1.6 s on the 7B shape); one parked ready on its own opens beside it."""
    roomy = serving_with_held_kv(fit=replace(FIT, gpu_free_mb=40 * GIB))
    d = decide(roomy, Tick(), NOW)
    spawn = kinds(d, Spawn)
    assert spawn and spawn[0].standby and spawn[0].gated and spawn[0].late and spawn[0].kv == "own", d.effects
    assert d.machine.state is S.STANDBY
    on_own = replace(roomy, current=replace(roomy.current, kv="own", kv_mb=0.0))
    spawn = kinds(decide(on_own, Tick(), NOW), Spawn)
    assert spawn and spawn[0].late and spawn[0].kv == "held", "the held KV cache is free: it takes that one"
    spawn = kinds(decide(serving_with_held_kv(), Tick(), NOW), Spawn)  # the 24 GiB shape: two do not fit
    assert spawn and spawn[0].standby and spawn[0].late and spawn[0].kv == "held", spawn
    spawn = kinds(decide(replace(roomy, facts=facts(nvml=True, standby_failures=1)), Tick(), NOW), Spawn)
    assert spawn and not spawn[0].late, "a standby was lost: the next one parks before CUDA"

    d = decide(roomy, RecycleCmd(reason="t", strategy="gated"), NOW)  # gated asked for: on the held one
    spawn = kinds(d, Spawn)
    assert spawn and spawn[0].gated and spawn[0].late and spawn[0].kv == "held", d.effects
    gated = tweak(facts().cfg, "server", recycle_strategy="gated")
    spawn = kinds(decide(replace(roomy, facts=facts(nvml=True, cfg=gated)), Tick(), NOW), Spawn)
    assert spawn and spawn[0].standby and spawn[0].late and spawn[0].kv == "held", "no overlap to open"


def test_a_standby_parked_ready_on_its_own_kv_cache_opens_beside_the_serving_one() -> None:
    own = gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True, standby=True, kv="own", late=True)
    for free in (40 * GIB, 3.5 * GIB):  # it holds its memory already: the readings' room does not matter
        v = serving_with_held_kv(fit=replace(FIT, gpu_free_mb=free))
        v = replace(v, machine=replace(v.machine, state=S.STANDBY), successor=own)
        d = decide(v, RecycleCmd(reason="t"), NOW)
        assert kinds(d, OpenGate) == [OpenGate(2, kv="own")], (free, d.effects)
        assert d.machine.state is S.OVERLAP_STARTING and d.machine.recycle.strategy == "overlap", d.machine
    d = decide(v, RecycleCmd(reason="t", strategy="gated"), NOW)
    assert not kinds(d, OpenGate) and d.machine.recycle.strategy == "gated", "gated asked for: after the old one"

    crashed = gen(1, GenPhase.DRAINING, kv="held")  # still maps the held KV cache: not the standby's
    d = decide(opening(own, retiring=(crashed,)), Tick(), NOW)
    assert kinds(d, OpenGate) and d.machine.state is S.PAST_GATE, "a crash waited on a KV cache it does not map"


def test_a_late_standby_is_never_opened_beside_the_serving_generation() -> None:
    v = serving_with_held_kv(fit=replace(FIT, gpu_free_mb=40 * GIB))  # overlap would fit
    late = gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True, standby=True, kv="held", late=True,
               kv_mb=6 * GIB)
    v = replace(v, machine=replace(v.machine, state=S.STANDBY), successor=late)
    d = decide(v, RecycleCmd(reason="t"), NOW)
    assert not kinds(d, OpenGate), "opened beside the generation that computes on the same KV cache"
    assert d.machine.recycle is not None and d.machine.recycle.strategy == "gated"
    assert "held KV cache" in d.machine.recycle.why

    early = replace(late, late=False, kv="held", kv_mb=0.0)
    d = decide(replace(v, successor=early), RecycleCmd(reason="t"), NOW)
    assert kinds(d, OpenGate) == [OpenGate(2, kv="own")], d.effects  # beside it: its own KV cache


def opening(successor: Any, **kw: Any) -> Any:
    v = view_of(S.OPENING_GATE)
    return replace(v, **{"successor": successor, "facts": facts(nvml=True, gpu_room=False), **kw})


def test_a_late_gate_opens_without_waiting_for_gpu_room_once_nothing_else_maps_the_kv_cache() -> None:
    late = gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True, kv="held", late=True)
    d = decide(opening(late), Tick(), NOW)
    assert kinds(d, OpenGate) == [OpenGate(2, kv="held")] and d.machine.state is S.PAST_GATE, d.effects
    early = replace(late, late=False)
    assert not kinds(decide(opening(early), Tick(), NOW), OpenGate), "an early gate still waits for room"

    other = gen(1, GenPhase.DRAINING, kv="held")  # a retiring generation still maps it
    d = decide(opening(late, retiring=(other,)), Tick(), NOW)
    assert not kinds(d, OpenGate), "opened while another generation maps the held KV cache"
    v = opening(late, retiring=(other,))
    v = replace(v, machine=replace(v.machine, since=NOW - 120))  # past memory_release_timeout
    d = decide(v, Tick(), NOW)
    assert not kinds(d, OpenGate) and kinds(d, Abandon), d.effects  # it mapped it: set aside, a cold start
    assert [e for e in kinds(d, Spawn) if not e.gated], d.effects
    v = opening(replace(early, kv="held"), retiring=(other,), facts=facts(nvml=True, gpu_room=True))
    v = replace(v, machine=replace(v.machine, since=NOW - 120))
    assert kinds(decide(v, Tick(), NOW), OpenGate) == [OpenGate(2, kv="own")]
    gone = replace(other, phase=GenPhase.DONE)
    assert kinds(decide(opening(late, retiring=(gone,)), Tick(), NOW), OpenGate) == [OpenGate(2, kv="held")]


# -- a late standby and a leak: its memory is the room the serving generation grows into ---------
def standby_beside(to_limit_s: float | None, gate: str | None) -> Any:
    v = serving_with_held_kv(to_limit_s=to_limit_s)
    late = gen(2, GenPhase.BOOTING, gated=True, gate=gate, beside=True, standby=True, kv="held", late=True,
               kv_mb=6 * GIB)
    return replace(v, machine=replace(v.machine, state=S.STANDBY), successor=late)


def test_a_growing_generation_gets_no_late_standby_and_one_starting_is_set_aside() -> None:
    v = serving_with_held_kv(to_limit_s=120.0)  # a leak: its memory runs out in two minutes
    spawn = kinds(decide(v, RecycleCmd(reason="t"), NOW), Spawn)
    assert spawn and spawn[0].gated and not spawn[0].late, "a successor beside it would take its room"
    assert kinds(decide(serving_with_held_kv(to_limit_s=3600.0), RecycleCmd(reason="t"), NOW), Spawn)[0].late

    d = decide(standby_beside(120.0, None), Tick(), NOW)
    gone = kinds(d, Abandon)
    assert gone and "runs out in 120 s" in gone[0].why, d.effects
    assert [e.failed for e in kinds(d, LearnStandby)] == [True], "the next standby parks before CUDA"
    assert d.machine.state is S.SERVING

    d = decide(standby_beside(3600.0, None), Tick(), NOW)  # slow growth: it goes on starting
    assert not kinds(d, Abandon) and d.machine.state is S.STANDBY


def test_before_its_own_forecast_a_generation_is_judged_at_the_rate_its_predecessor_leaked() -> None:
    """A leak outlives the generation it showed in: until the new one's forecast has its readings,
    its standby is judged at the predecessor's GPU growth rate, so it parks before CUDA instead of
    starting whole beside it only to be set aside once the forecast shows the leak."""
    fresh = serving_with_held_kv()  # no forecast of its own yet (3.5 GiB free)
    leaked = replace(fresh, facts=facts(nvml=True, gpu_mb_s=20.0))  # 3 584 MB at 20 MB/s: 179 s
    d = decide(leaked, Tick(), NOW)
    spawn, (line,) = kinds(d, Spawn), [e for e in kinds(d, Log) if e.event == "standby_starting"]
    assert spawn and spawn[0].standby and not spawn[0].late, d.effects
    assert "runs out in 179 s at the 20.0 MB/s its predecessors' grew" in str(dict(line.fields)["why"]), line
    assert not kinds(decide(leaked, RecycleCmd(reason="t"), NOW), Spawn)[0].late, "a gated successor likewise"

    for calm in (facts(nvml=True), facts(nvml=True, gpu_mb_s=0.5), facts(nvml=True, gpu_mb_s=-1.0)):
        spawn = kinds(decide(replace(fresh, facts=calm), Tick(), NOW), Spawn)  # none, slow (2 h), shrinking
        assert spawn and spawn[0].late, (calm.gpu_mb_s, spawn)
    own = replace(leaked, current=replace(leaked.current, gpu_mb_s=0.0))  # its own readings: no growth
    assert kinds(decide(own, Tick(), NOW), Spawn)[0].late, "its own forecast wins over the prior"
    parked = replace(standby_beside(None, "parked"), facts=facts(nvml=True, gpu_mb_s=20.0))
    assert decide(parked, Tick(), NOW).machine.recycle is None, "a prior alone never recycles"


def test_the_prior_is_the_median_rate_of_the_last_three_generations() -> None:
    """One generation's rate comes from a few readings of an allocator that grows in steps: a leak
    of 20 MB/s once read 7.0 MB/s (on the H200). The median of the last three keeps the prior at
    the leak's rate through one low reading, and lets it go once two generations show none."""
    assert prior_rate([]) is None
    assert prior_rate([19.9]) == 19.9
    assert prior_rate([19.9, 7.0, 20.1]) == 19.9
    assert prior_rate([30.0, 19.9, 7.0, 20.1]) == 19.9, "only the last three count"
    assert prior_rate([20.0, 20.0, 0.0, 0.0]) == 0.0, "two generations without growth end the prior"


def test_a_parked_late_standby_takes_over_before_the_growing_generation_runs_out() -> None:
    d = decide(standby_beside(30.0, "parked"), Tick(), NOW)
    rec = d.machine.recycle
    assert rec is not None and rec.reason == "gpu_memory_forecast" and rec.strategy == "gated", d.effects
    assert not kinds(d, Abandon), "the standby it recycles onto is kept"
    for slow in (None, 120.0):  # no growth, or room for more than a minute: it waits for its trigger
        d = decide(standby_beside(slow, "parked"), Tick(), NOW)
        assert d.machine.recycle is None and d.machine.state is S.STANDBY, (slow, d.effects)
