"""Recycle strategies, the router and the replica rules as pure functions: readings in, decision
out. No server: the real-vLLM behaviour is in tests/test_strategies.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_guard.core.config import ConfigError, GuardConfig, validate, with_value, with_values
from vllm_guard.core.gpu import select_gpus
from vllm_guard.core.protocol import MemoryReading, ProcessMemory, Role
from vllm_guard.runtime.replica import plan as replicas
from vllm_guard.runtime.frontdoor.target import Target
from vllm_guard.runtime.frontdoor.router import AVOID_AFTER_FAILURE_S, Route, Router, choose
from vllm_guard.runtime.replica.strategy import MemoryFit, Strategy
from vllm_guard.runtime.replica.strategy import choose as choose_strategy

GIB = 1024.0


# -- the strategy ---------------------------------------------------------------------------------
def fit(**kw: float | str | None) -> MemoryFit:
    base: dict[str, object] = {"host_available_mb": 20 * GIB, "host_footprint_mb": 3 * GIB, "parked_mb": 1.5 * GIB}
    base.update(kw)
    return MemoryFit(**base)  # type: ignore[arg-type]


def test_cpu_two_generations_fit_in_ram_overlap() -> None:
    c = choose_strategy("auto", fit())
    assert c.strategy is Strategy.OVERLAP
    assert "RAM available 20.0 GiB vs 3.0 GiB" in c.reason


def test_cpu_too_little_ram_for_two_but_enough_to_park_gated() -> None:
    c = choose_strategy("auto", fit(host_available_mb=3.5 * GIB))
    assert c.strategy is Strategy.GATED
    assert "do not fit" in c.reason and "parked" in c.reason


def test_not_even_a_parked_one_fits_cold() -> None:
    assert choose_strategy("auto", fit(host_available_mb=2 * GIB)).strategy is Strategy.COLD


def test_no_reading_of_the_serving_generation_never_overlaps() -> None:
    c = choose_strategy("auto", fit(host_footprint_mb=None, parked_mb=None))
    assert c.strategy is Strategy.COLD and "no memory reading" in c.reason


# A 7B (~21 GiB on the GPU) on a 24 GiB card vs an 80 GiB card, as NVML reads them.
def gpu_fit(total: float, used: float, util: float = 0.9, gate: str | None = None) -> MemoryFit:
    return fit(gpu_free_mb=total - used, gpu_total_mb=total, gpu_footprint_mb=21 * GIB,
               vllm_free_mb=total - used, vllm_needs_mb=util * total, gate_unavailable=gate)


def test_24_gib_card_gated() -> None:
    c = choose_strategy("auto", gpu_fit(24 * GIB, 21.5 * GIB))
    assert c.strategy is Strategy.GATED
    assert "GPU free 2.5 GiB vs 21.0 GiB" in c.reason


def test_80_gib_card_overlap_only_when_vllms_own_start_check_passes() -> None:
    assert choose_strategy("auto", gpu_fit(80 * GIB, 21.5 * GIB, util=0.3)).strategy is Strategy.OVERLAP
    c = choose_strategy("auto", gpu_fit(80 * GIB, 21.5 * GIB, util=0.9))  # needs 72 GiB free
    assert c.strategy is Strategy.GATED
    assert "vLLM's start check needs 72.0 GiB free" in c.reason


def test_a_vllm_that_cannot_park_is_remembered_cold() -> None:
    c = choose_strategy("auto", gpu_fit(24 * GIB, 21.5 * GIB, gate="vLLM 0.41 is outside >=0.20,<0.40"))
    assert c.strategy is Strategy.COLD and "cannot park" in c.reason


def test_an_explicit_strategy_is_obeyed_and_says_when_readings_disagree() -> None:
    c = choose_strategy("overlap", gpu_fit(24 * GIB, 21.5 * GIB))
    assert c.strategy is Strategy.OVERLAP
    assert "recycle_strategy = overlap" in c.reason and "may not fit" in c.reason
    assert choose_strategy("cold", fit()).reason == "[server] recycle_strategy = cold"


def test_memory_fit_from_a_generation_reading() -> None:
    cfg = with_value(GuardConfig(), "server", "vllm_args", ["--gpu-memory-utilization", "0.25"])
    reading = MemoryReading(at="t", requests=5, rss_mb=3000.0, uss_mb=2500.0, gpu_mb=21 * GIB, per_process=[
        ProcessMemory(pid=1, role=Role.API_SERVER, rss_mb=800.0),
        ProcessMemory(pid=2, role=Role.ENGINE_CORE, rss_mb=2200.0, gpu_mb=21 * GIB)])
    m = replicas.memory_fit(cfg, reading, {"GPU-a": (21.6 * GIB, 80 * GIB), "GPU-b": (0.5 * GIB, 80 * GIB)},
                            ["GPU-a"], None, host_available_mb=10 * GIB)
    assert m.host_footprint_mb == 2500.0  # USS first
    assert m.parked_mb == 1600.0  # an API server and an imported EngineCore
    assert m.gpu_free_mb == pytest.approx(80 * GIB - 21.6 * GIB)  # only this replica's GPU
    assert m.vllm_needs_mb == pytest.approx(0.25 * 80 * GIB)
    assert choose_strategy("auto", m).strategy is Strategy.OVERLAP


def test_a_parked_generation_that_prestages_holds_the_models_weights_too(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 2**20)
    cfg = GuardConfig()
    reading = MemoryReading(at="t", requests=5, rss_mb=3000.0, uss_mb=None, gpu_mb=None, per_process=[
        ProcessMemory(pid=1, role=Role.API_SERVER, rss_mb=800.0)])
    assert replicas.prestage_mb(cfg, str(tmp_path)) == 0.0  # off by default
    cfg = with_value(cfg, "server", "prestage_weights", "on")
    staged = replicas.prestage_mb(cfg, str(tmp_path))
    assert staged == 4.0
    m = replicas.memory_fit(cfg, reading, {}, [], None, host_available_mb=2 * GIB, prestaged_mb=staged)
    assert m.parked_mb == 1604.0  # an API server, an imported EngineCore, the staged weights
    assert "a parked generation's 1.6 GiB" in choose_strategy("gated", m).reason
    cfg = with_value(cfg, "server", "vllm_args", ["--tensor-parallel-size", "2"])  # the workers load: nothing staged
    assert replicas.prestage_mb(cfg, str(tmp_path)) == 0.0


# -- the router -----------------------------------------------------------------------------------
def tgt(n: int, in_flight: int = 0, limit: int | None = None) -> Target:
    t = Target(generation=n, url=f"http://127.0.0.1:{9000 + n}", limit=limit)
    t.in_flight, t.ready_at = in_flight, 0.0
    return t


def test_least_outstanding_wins() -> None:
    a, b = Route(tgt(1, 3), 0), Route(tgt(2, 1), 1)
    assert choose([a, b], 0.0) is b


def test_ties_go_to_the_least_recently_picked_so_sequential_requests_alternate() -> None:
    r = Router(on_limit=lambda t: None)
    a, b = tgt(1), tgt(2)
    r.add(a, 0)
    r.add(b, 1)
    picks = []
    for _ in range(6):
        got = r.pick(True, 1.0)
        assert got is not None
        picks.append(got[0].generation)
        r.release(got[0])
    assert picks == [1, 2, 1, 2, 1, 2]


def test_a_target_that_just_failed_is_passed_over_for_a_moment() -> None:
    r = Router(on_limit=lambda t: None)
    a, b = tgt(1), tgt(2, in_flight=5)
    r.add(a, 0)
    r.add(b, 1)
    r.failed(a, now=100.0)
    routes = r.routes
    assert choose(routes, 100.0 + AVOID_AFTER_FAILURE_S / 2).target is b
    assert choose(routes, 100.0 + AVOID_AFTER_FAILURE_S + 0.1).target is a
    b.dead = True  # every open one failed: still served rather than queued
    assert choose(routes, 100.0).target is a


def test_a_leaving_target_takes_requests_only_when_no_other_is_open() -> None:
    a, b = Route(tgt(1, 0), 0), Route(tgt(2, 7), 1)
    a.target.leaving = True  # its recycle leaves a gap soon: the other replica takes the load
    assert choose([a, b], 0.0) is b
    b.target.accepting = False
    assert choose([a, b], 0.0) is a  # the only one open still serves: nothing queues early


def test_a_retry_avoids_its_failed_target_even_when_it_is_the_only_one() -> None:
    r = Router(on_limit=lambda t: None)
    a = tgt(1)
    r.add(a)
    assert r.pick(True, 0.0, avoid=a, avoid_until=1e18) is None
    assert r.pick(True, 0.0, avoid=a, avoid_until=0.0) is not None


def test_stopped_and_dead_targets_take_nothing() -> None:
    r = Router(on_limit=lambda t: None)
    a, b = tgt(1), tgt(2)
    r.add(a)
    r.add(b, 1)
    r.stop(a)
    assert not a.accepting and r.accepting() == [b]
    r.stop(b, dead=True)
    assert r.pick(True, 0.0) is None


def test_the_limit_closes_a_target_unless_it_may_go_past_it() -> None:
    hit: list[int] = []
    r = Router(on_limit=lambda t: hit.append(t.generation))
    a = tgt(1, limit=2)
    r.add(a)
    for _ in range(2):
        assert r.pick(True, 1.0) is not None
    assert not a.accepting and a.limit_closed and hit == [1]
    r.allow_past_limit(a)  # its successor starts beside it: nothing queues meanwhile
    assert a.accepting and not a.limit_closed
    assert r.pick(True, 1.0) is not None and a.accepting


def test_the_last_request_of_a_closed_target_ends_its_drain_at_once() -> None:
    """The supervisor is woken when a draining generation's last request ends (a gated recycle's
    drain is time without service; waiting for the next loop turn added up to 0.25 s)."""
    drained: list[int] = []
    r = Router(on_limit=lambda t: None, on_drained=lambda t: drained.append(t.generation))
    a = tgt(1)
    r.add(a)
    picks = [r.pick(True, 1.0) for _ in range(2)]
    assert all(p is not None for p in picks)
    r.release(a)
    assert drained == []  # still accepting: nothing drains
    r.stop(a, dead=False)
    assert drained == []  # one request still runs
    r.release(a)
    assert drained == [1] and a.in_flight == 0


def test_backlog_requests_do_not_count_toward_the_new_generations_limit() -> None:
    r = Router(on_limit=lambda t: None)
    a = tgt(1, limit=1)
    a.ready_at = 10.0
    r.add(a)
    got = r.pick(True, 5.0)  # arrived before it was ready: inherited
    assert got is not None and got[1] is True
    assert a.toward_limit == 0 and a.accepting


def test_held_never_closes_at_the_limit() -> None:
    r = Router(on_limit=lambda t: None)
    r.enforce_limit = False
    a = tgt(1, limit=1)
    r.add(a)
    r.pick(True, 1.0)
    r.pick(True, 1.0)
    assert a.accepting


# -- replicas: the rolling rule and the runtime's one state are tests/test_replica_machine.py ----

STATIC = [
    {"index": 0, "uuid": "GPU-aaaa1111", "name": "NVIDIA H200", "pci_bus_id": "00000000:01:00.0"},
    {"index": 1, "uuid": "GPU-bbbb2222", "name": "NVIDIA H200", "pci_bus_id": "00000000:41:00.0"},
    {"index": 2, "uuid": "GPU-cccc3333", "name": "NVIDIA H200", "pci_bus_id": "00000000:81:00.0"},
    {"index": 3, "uuid": "GPU-dddd4444", "name": "NVIDIA H200", "pci_bus_id": "00000000:c1:00.0"},
]


def cfg_with(**server: object) -> GuardConfig:
    return validate(with_values(GuardConfig(), "server", server))


def test_one_replica_per_gpu_each_with_its_own_cuda_visible_devices() -> None:
    plans = replicas.plan(cfg_with(gpus=["0", "GPU-cccc"]), STATIC, {})
    assert [p.gpus for p in plans] == [["GPU-aaaa1111"], ["GPU-cccc3333"]]
    assert plans[1].env() == {"CUDA_VISIBLE_DEVICES": "GPU-cccc3333"}


def test_one_replica_per_tensor_parallel_group() -> None:
    cfg = cfg_with(gpus=["0", "1", "2", "3"], vllm_args=["--tensor-parallel-size", "2"])
    assert [p.gpus for p in replicas.plan(cfg, STATIC, {})] == [["GPU-aaaa1111", "GPU-bbbb2222"],
                                                                 ["GPU-cccc3333", "GPU-dddd4444"]]
    with pytest.raises(ConfigError, match="do not split into groups of --tensor-parallel-size 2"):
        replicas.plan(cfg_with(gpus=["0", "1", "2"], vllm_args=["--tensor-parallel-size", "2"]), STATIC, {})


def test_gpu_indexes_count_among_the_gpus_this_process_sees() -> None:
    assert select_gpus(STATIC, ["1"], {"CUDA_VISIBLE_DEVICES": "GPU-cccc3333,GPU-dddd4444"}) == ["GPU-dddd4444"]
    with pytest.raises(ValueError, match="sees 2 GPU"):
        select_gpus(STATIC, ["2"], {"CUDA_VISIBLE_DEVICES": "GPU-cccc3333,GPU-dddd4444"})


def test_replicas_without_gpus_share_the_runtimes_environment() -> None:
    plans = replicas.plan(cfg_with(replicas=2), [], {})
    assert [p.index for p in plans] == [0, 1] and all(p.env() == {} for p in plans)


def test_bad_gpu_lists_are_one_config_error() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        cfg_with(gpus=["0", "0"])
    with pytest.raises(ConfigError, match="not a GPU index"):
        cfg_with(gpus=["zero"])
    with pytest.raises(ConfigError, match="NVML sees no GPU"):
        replicas.plan(cfg_with(gpus=["0"]), [], {})


def test_metrics_per_replica(tmp_path: object) -> None:
    from vllm_guard.core.protocol import ReplicaStatus, RuntimeState, StatusSnapshot
    from vllm_guard.runtime.servers.metrics import LedgerView, RuntimeCollector

    st = StatusSnapshot(state=RuntimeState.SERVING, state_for_s=1.0, generation=7, pid=1, port=8000, model="m",
                        replicas=[ReplicaStatus(index=0, state=RuntimeState.SERVING, generation=7, in_flight=3),
                                  ReplicaStatus(index=1, state=RuntimeState.STARTING, generation=6,
                                                next_generation=8, recycle_strategy="overlap")])
    c = RuntimeCollector(lambda: st, LedgerView(f"{tmp_path}/none"))
    got = {(s.name, tuple(sorted(s.labels.items())), s.value) for fam in c.collect() for s in fam.samples}
    assert ("vllm_guard_runtime_replica_in_flight", (("replica", "0"),), 3.0) in got
    assert ("vllm_guard_runtime_replica_serving", (("replica", "1"),), 0.0) in got
    assert ("vllm_guard_runtime_replica_successor", (("replica", "1"), ("strategy", "overlap")), 1.0) in got
