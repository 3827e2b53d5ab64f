"""The supervisor's pure parts without vLLM, in milliseconds: the recycle triggers (pure
functions of readings and `now`), the hang verdict over a window of /metrics scrapes, the
bounded records, and the owned-argument check. The replica's machine: test_replica_machine.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vllm_guard.core.config import RecycleConfig
from vllm_guard.core.ledger import EndClass
from vllm_guard.runtime.cli import find_owned_arg
from vllm_guard.core.hang import HANG, ProgressWindow, Verdict
from vllm_guard.runtime.records.recent import FailureRecord, Recent
from vllm_guard.runtime.status.snapshot import visible_gpu_name
from vllm_guard.runtime.supervisor import SLOW_TURN_S, slow_turn
from vllm_guard.runtime.frontdoor.target import counts_toward_limit
from vllm_guard.runtime.replica.triggers import GPU_MEMORY_GROWTH, HOST_RSS_GROWTH, IDLE_OPPORTUNISTIC, MAX_REQUESTS, MAX_UPTIME, Growth, Readings, generation_limit, limit_fraction, recycle_trigger



# -- recycle triggers -------------------------------------------------------------------------
def cfg(**kw: object) -> RecycleConfig:
    return RecycleConfig(**kw)  # type: ignore[arg-type]


def readings(**kw: object) -> Readings:
    base: dict[str, object] = {"ready_at": 1000.0, "requests": 0, "limit": None}
    base.update(kw)
    return Readings(**base)  # type: ignore[arg-type]


def test_nothing_configured_never_triggers() -> None:
    r = readings(requests=10**6, idle_for=10**6, growth=Growth(rss_mb=1e6, gpu_mb=1e6))
    assert recycle_trigger(cfg(), r, now=1e9) is None


@pytest.mark.parametrize("requests, fires", [(0, False), (99, False), (100, True), (250, True)])
def test_max_requests(requests: int, fires: bool) -> None:
    t = recycle_trigger(cfg(max_requests=100), readings(requests=requests, limit=100), now=1001.0)
    assert (t is not None) is fires
    if fires:
        assert t is not None and (t.reason, t.cls) == (MAX_REQUESTS, EndClass.SCHEDULED)


def test_jitter_stays_within_max_requests_plus_jitter_and_varies() -> None:
    rng = random.Random(7)
    limits = {generation_limit(cfg(max_requests=50, max_requests_jitter=10), rng) for _ in range(500)}
    assert limits <= set(range(50, 61)) and len(limits) > 5
    assert generation_limit(cfg(max_requests=50), rng) == 50
    assert generation_limit(cfg(), rng) is None


@pytest.mark.parametrize("up, fires", [(0.0, False), (3599.9, False), (3600.0, True), (7200.0, True)])
def test_max_uptime_counts_from_ready(up: float, fires: bool) -> None:
    t = recycle_trigger(cfg(max_uptime=3600.0), readings(ready_at=500.0), now=500.0 + up)
    assert (t is not None) is fires
    if t is not None:
        assert (t.reason, t.cls) == (MAX_UPTIME, EndClass.SCHEDULED)


@pytest.mark.parametrize("growth, expected", [
    (None, None),  # before the warm-up baseline there is no growth to judge
    (Growth(rss_mb=10.0, gpu_mb=10.0), None),
    (Growth(rss_mb=10.0, gpu_mb=64.0), GPU_MEMORY_GROWTH),
    (Growth(rss_mb=30.0, gpu_mb=None), HOST_RSS_GROWTH),  # no NVML: the host trigger still works
    (Growth(rss_mb=30.0, gpu_mb=64.0), GPU_MEMORY_GROWTH),  # GPU first
])
def test_memory_growth_is_preventive(growth: Growth | None, expected: str | None) -> None:
    c = cfg(max_gpu_memory_growth_mb=64.0, max_host_rss_growth_mb=30.0)
    t = recycle_trigger(c, readings(growth=growth), now=1001.0)
    assert (t.reason if t else None) == expected
    if t is not None:
        assert t.cls is EndClass.PREVENTIVE


def test_a_leak_caught_with_the_count_limit_reached_is_reported_as_the_leak() -> None:
    c = cfg(max_requests=100, max_host_rss_growth_mb=30.0)
    t = recycle_trigger(c, readings(requests=100, limit=100, growth=Growth(rss_mb=31.0)), now=1001.0)
    assert t is not None and (t.reason, t.cls) == (HOST_RSS_GROWTH, EndClass.PREVENTIVE)


IDLE = {"max_requests": 400, "idle_fraction": 0.1, "idle_after": 3.0, "max_host_rss_growth_mb": 30.0}


@pytest.mark.parametrize("requests, idle_for, growth, expected", [
    (45, 3.0, Growth(rss_mb=7.5), IDLE_OPPORTUNISTIC),  # 11 % used, idle long enough
    (45, 2.9, Growth(rss_mb=7.5), None),  # not idle long enough
    (30, 60.0, Growth(rss_mb=2.0), None),  # 7.5 % used: too early to recycle even when idle
    (10, 60.0, Growth(rss_mb=3.5), IDLE_OPPORTUNISTIC),  # the memory limit is 11.7 % used
    (45, 60.0, Growth(rss_mb=30.0), HOST_RSS_GROWTH),  # the growth limit itself wins over idle
    (45, 0.0, Growth(rss_mb=29.9), None),  # busy: no opportunistic recycle
])
def test_idle_opportunistic_vs_growth(requests: int, idle_for: float, growth: Growth, expected: str | None) -> None:
    r = readings(requests=requests, limit=400, idle_for=idle_for, growth=growth)
    t = recycle_trigger(cfg(**IDLE), r, now=1010.0)
    assert (t.reason if t else None) == expected
    if expected == IDLE_OPPORTUNISTIC:
        assert t is not None and t.cls is EndClass.SCHEDULED


def test_limit_fraction_is_the_nearest_limit() -> None:
    c = cfg(max_requests=100, max_uptime=1000.0, max_gpu_memory_growth_mb=100.0, max_host_rss_growth_mb=50.0)
    r = readings(ready_at=0.0, requests=20, limit=100, growth=Growth(rss_mb=20.0, gpu_mb=10.0))
    assert limit_fraction(c, r, now=100.0) == pytest.approx(0.4)  # RSS 20/50
    assert limit_fraction(c, r, now=900.0) == pytest.approx(0.9)  # uptime 900/1000
    assert limit_fraction(cfg(), readings(ready_at=0.0, requests=20, growth=r.growth), now=900.0) == 0.0


# -- the backlog rule (a generation that inherits queued requests) -----------------------------
def test_requests_that_waited_through_the_recycle_do_not_count_toward_the_limit() -> None:
    ready = 100.0
    assert not counts_toward_limit(arrived_at=40.0, ready_at=ready)  # queued during the recycle
    assert counts_toward_limit(arrived_at=100.0, ready_at=ready)
    assert counts_toward_limit(arrived_at=100.5, ready_at=ready)
    assert not counts_toward_limit(arrived_at=1.0, ready_at=None)  # not ready yet


def test_a_generation_that_inherits_its_limit_in_backlog_does_not_recycle_when_it_comes_up() -> None:
    """The H200 case: 250 requests queued during a recycle, max_requests 250. The new generation
    takes all of them the moment it is ready; none counts, so no second recycle follows."""
    c = cfg(max_requests=250)
    ready = 1000.0
    arrivals = [950.0 + i * 0.2 for i in range(250)]  # all during the previous recycle
    toward = sum(counts_toward_limit(a, ready) for a in arrivals)
    assert toward == 0
    assert recycle_trigger(c, readings(ready_at=ready, requests=toward, limit=250), now=ready + 0.045) is None
    # it recycles after 250 requests of its own
    assert recycle_trigger(c, readings(ready_at=ready, requests=250, limit=250), now=ready + 60) is not None


def test_idle_time_of_a_new_generation_counts_from_ready_only() -> None:
    # the supervisor passes idle_for = min(proxy idle, now - ready): a generation ready 1 s ago
    # after an idle recycle is not "idle for 30 s"
    c = cfg(max_requests=100, idle_fraction=0.0001, idle_after=30.0)
    assert recycle_trigger(c, readings(ready_at=1000.0, requests=1, limit=100, idle_for=1.0), now=1001.0) is None


# -- hang or starved --------------------------------------------------------------------------
def window(samples: list[tuple[float, float | None]], keep: float = 30.0) -> ProgressWindow:
    w = ProgressWindow(keep=keep)
    for at, tokens in samples:
        w.add(at, tokens)
    return w


def test_no_token_moved_over_the_whole_window_is_stalled() -> None:
    w = window([(0.0, 500.0), (15.0, 500.0), (35.0, 500.0), (40.0, 500.0)])
    v = w.verdict(now=40.0, span=30.0)
    assert v is Verdict.STALLED and v in HANG


def test_a_starved_engine_that_moved_inside_the_window_is_not_hung() -> None:
    # the probe timed out, but tokens moved 20 s ago: starved (a backlog, busy cores), not hung
    w = window([(0.0, 500.0), (20.0, 900.0), (35.0, 900.0), (40.0, 900.0)])
    v = w.verdict(now=40.0, span=30.0)
    assert v is Verdict.MOVING and v not in HANG


def test_progress_only_before_the_window_does_not_count() -> None:
    w = window([(0.0, 100.0), (5.0, 900.0), (10.0, 900.0), (30.0, 900.0), (45.0, 900.0)])
    assert w.verdict(now=45.0, span=30.0) is Verdict.STALLED


def test_a_young_generation_is_not_judged_before_it_lived_a_whole_window() -> None:
    """Clean slate after a recycle: the window of a new generation starts empty, and a
    generation younger than the window is never declared hung (the old flake)."""
    w = window([(100.0, 0.0), (110.0, 0.0)])
    v = w.verdict(now=110.0, span=30.0)
    assert v is Verdict.TOO_SHORT and v not in HANG
    w.add(131.0, 0.0)
    assert w.verdict(now=131.0, span=30.0) is Verdict.STALLED


def test_a_young_generation_that_moves_is_moving_at_once() -> None:
    w = window([(100.0, 0.0), (104.0, 64.0)])
    assert w.verdict(now=104.0, span=30.0) is Verdict.MOVING


def cpu_window(samples: list[tuple[float, float | None, float | None]], keep: float = 30.0) -> ProgressWindow:
    w = ProgressWindow(keep=keep)
    for at, tokens, cpu in samples:
        w.add(at, tokens, cpu)
    return w


def test_metrics_silent_but_the_api_server_busy_is_starved_not_hung() -> None:
    """Measured here: on 2 loaded cores, streaming 4000-token answers, vLLM's API server did not
    answer /metrics for 9 s. It kept using CPU: starved, never a hang."""
    w = cpu_window([(0.0, 500.0, 10.0), (4.0, None, 11.5), (9.6, None, 13.0)], keep=5.0)
    v = w.verdict(now=9.6, span=5.0)
    assert v is Verdict.BUSY and v not in HANG


def test_metrics_silent_and_no_cpu_used_is_a_hang() -> None:
    # a stopped or deadlocked API server: no answer, no CPU over the whole window
    w = cpu_window([(0.0, 500.0, 10.0), (12.0, None, 10.0), (25.0, None, 10.0), (40.0, None, 10.0)])
    v = w.verdict(now=40.0, span=30.0)
    assert v is Verdict.SILENT and v in HANG


def test_metrics_silent_and_cpu_unknown_proves_nothing() -> None:
    w = window([(0.0, 500.0), (12.0, None), (25.0, None), (40.0, None)])
    v = w.verdict(now=40.0, span=30.0)
    assert v is Verdict.UNKNOWN and v not in HANG


def test_a_scrape_that_failed_inside_the_window_does_not_hide_progress() -> None:
    w = window([(0.0, 500.0), (20.0, None), (38.0, 700.0)])
    assert w.verdict(now=40.0, span=30.0) is Verdict.MOVING


def test_a_probe_longer_than_the_window_widens_it() -> None:
    # window 5 s, but the probe took 20 s: tokens that moved 12 s ago still count
    w = window([(0.0, 10.0), (8.0, 60.0), (20.0, 60.0)], keep=20.0)
    assert w.verdict(now=20.0, span=5.0) is Verdict.STALLED
    assert w.verdict(now=20.0, span=max(5.0, 20.0)) is Verdict.MOVING


def test_the_window_forgets_what_is_far_older_than_it() -> None:
    w = ProgressWindow(keep=10.0)
    for t in range(0, 1000):
        w.add(float(t), float(t))
    assert len(w.scrapes) <= 32


# -- records and small rules ------------------------------------------------------------------
def test_recent_is_bounded_and_counts_everything() -> None:
    r: Recent[FailureRecord] = Recent(size=3)
    for i in range(10):
        r.add(FailureRecord(kind="crash", at=f"t{i}", exit_code=0, detail="", generation=i))
    assert r.total == 10 and len(r) == 3 and [f.generation for f in r] == [7, 8, 9]
    assert r.items[-1].summary().generation == 9


@pytest.mark.parametrize("args, owned", [
    (["--port", "1"], "--port"), (["--host=0.0.0.0"], "--host=0.0.0.0"), (["--ho", "0.0.0.0"], "--ho"),
    (["--mod", "x"], "--mod"), (["--max-model-len", "512"], None), (["--enforce-eager"], None),
    (["-p", "1"], None), (["--", "x"], None),
])
def test_owned_vllm_arguments_abbreviations_included(args: list[str], owned: str | None) -> None:
    assert find_owned_arg(args) == owned


MIXED = [  # as NVML lists them: by PCI bus
    {"index": 0, "uuid": "GPU-4090aaaa", "name": "NVIDIA GeForce RTX 4090", "pci_bus_id": "00000000:01:00.0"},
    {"index": 1, "uuid": "GPU-a100bbbb", "name": "NVIDIA A100 80GB PCIe", "pci_bus_id": "00000000:41:00.0"},
]


@pytest.mark.parametrize("env, name", [
    ({}, "NVIDIA GeForce RTX 4090,NVIDIA A100 80GB PCIe"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-a100bbbb"}, "NVIDIA A100 80GB PCIe"),
    ({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "NVIDIA A100 80GB PCIe"),
    # CUDA numbers fastest-first: index 1 may be the 4090; say both rather than guess wrong
    ({"CUDA_VISIBLE_DEVICES": "1"}, "NVIDIA GeForce RTX 4090,NVIDIA A100 80GB PCIe"),
])
def test_the_gpu_name_follows_the_one_gpu_index_rule(env: dict[str, str], name: str) -> None:
    nvml = SimpleNamespace(available=True, static=MIXED)
    assert visible_gpu_name(nvml, env) == name  # type: ignore[arg-type]
    assert visible_gpu_name(None, env) == ""


def test_a_slow_loop_turn_says_where_its_time_went() -> None:
    assert slow_turn(0.0, 0.25, 0.3, 0.4, 0.45) is None  # a normal turn says nothing
    assert slow_turn(0.0, 0.25, 0.3, SLOW_TURN_S - 0.1, SLOW_TURN_S - 0.05) is None
    # the loop itself blocked (or starved): the sleep took the time
    assert slow_turn(0.0, 13.0, 13.0, 13.1, 13.1) == {"seconds": 13.1, "sleep_s": 13.0, "commands_s": 0.0,
                                                       "replicas_s": 0.1, "heartbeat_s": 0.0}
    # a replica's await took it
    parts = slow_turn(0.0, 0.25, 0.25, 7.25, 7.3)
    assert parts is not None and parts["replicas_s"] == 7.0 and parts["sleep_s"] == 0.25



def test_the_beat_goes_on_through_a_slow_turn_but_not_a_wedged_one_or_an_overrun() -> None:
    from vllm_guard.runtime.supervisor import WEDGED_TURN_S, may_beat

    assert may_beat(False, None, 100.0)  # asleep between turns
    assert may_beat(False, 100.0 - SLOW_TURN_S * 2, 100.0)  # a slow launch on a starved box
    assert not may_beat(False, 100.0 - WEDGED_TURN_S, 100.0)
    assert not may_beat(True, None, 100.0)


def test_a_blocked_event_loop_is_logged_with_where_it_is_stuck() -> None:
    import asyncio
    import time

    import structlog

    from vllm_guard.runtime.loopwatch import LoopWatch

    def stuck_in_here() -> None:
        time.sleep(1.6)

    async def main() -> LoopWatch:
        w = LoopWatch(blocked_s=0.5)
        w.start()
        await asyncio.sleep(0.3)
        stuck_in_here()  # blocks the loop, as a synchronous /proc walk would
        await asyncio.sleep(0.4)
        w.stop()
        return w

    with structlog.testing.capture_logs() as logs:
        w = asyncio.run(main())
    blocked = [e for e in logs if e["event"] == "event_loop_blocked"]
    assert w.stalls == len(blocked) >= 1, logs  # (a starved box may add stalls of its own)
    assert any("stuck_in_here" in e["stack"] for e in blocked), blocked
    resumed = [e for e in logs if e["event"] == "event_loop_resumed"]
    assert any(e["seconds"] >= 1.0 for e in resumed), resumed
    assert all(e["ended"] - e["began"] == pytest.approx(e["seconds"], abs=0.01) and e["ended"] <= time.time()
               for e in resumed), resumed
    # time.sleep is a blocking call, not work: the loop thread slept through it
    assert any(e["asleep_s"] >= 0.5 and e["cpu_s"] < 0.5 for e in resumed), resumed


def test_a_loop_busy_with_its_own_work_is_told_from_one_that_waits() -> None:
    import asyncio
    import time

    import structlog

    from vllm_guard.runtime.loopwatch import LoopWatch

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:  # CPU seconds of this thread, whatever the box's load
            pass

    async def main() -> None:
        w = LoopWatch(blocked_s=0.5)
        w.start()
        await asyncio.sleep(0.3)
        spin(1.5)
        await asyncio.sleep(0.4)
        w.stop()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    resumed = [e for e in logs if e["event"] == "event_loop_resumed"]
    assert any(e["cpu_s"] >= 1.0 for e in resumed), resumed
