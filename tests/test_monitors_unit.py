"""The runtime's memory monitor (`replica.monitors.memory_loop`) and its forecast of the time to
the memory limit (`forecast`, what `decide` reads as `to_limit_s`), without vLLM: a made-up
process tree read through `MemoryIO`, on a clock of the test's own. Milliseconds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_guard.core import leak
from vllm_guard.core.config import GuardConfig, RecycleConfig
from vllm_guard.core.protocol import ChildProcess, MemoryReading, MemoryStatus, ProcessMemory, Role
from vllm_guard.runtime.replica import monitors
from vllm_guard.runtime.replica.monitors import FORECAST_POINTS, MemoryIO, forecast, growth_rate, memory_loop


# -- the forecast -------------------------------------------------------------------------------
def test_forecast_is_headroom_over_the_robust_growth_rate() -> None:
    line = [(float(t), 1000.0 + 2.0 * t) for t in range(FORECAST_POINTS)]  # 2 MB/s
    assert forecast(line, 100.0) == pytest.approx(50.0)
    spike = line[:3] + [(3.0, 5000.0)] + line[4:]  # one wild reading does not move Theil-Sen
    assert forecast(spike, 100.0) == pytest.approx(50.0)
    assert forecast(line, -5.0) == 0.0  # already past the limit: now


def test_no_forecast_without_growth_headroom_or_enough_readings() -> None:
    line = [(float(t), 1000.0 + 2.0 * t) for t in range(FORECAST_POINTS)]
    assert forecast(line[:-1], 100.0) is None  # too few readings to trust a rate
    assert forecast(line, None) is None  # no headroom known (no NVML for the GPU's)
    assert forecast([(t, 1000.0) for t, _ in line], 100.0) is None  # flat
    assert forecast([(t, 2000.0 - mb) for t, mb in line], 100.0) is None  # shrinking
    assert growth_rate(line[:-1]) is None and growth_rate(line) == pytest.approx(2.0)
    assert growth_rate([(t, 2000.0 - mb) for t, mb in line]) == pytest.approx(-2.0)  # a rate, though no forecast


# -- the loop -----------------------------------------------------------------------------------
class Stop(Exception):
    pass


@dataclass
class World:
    """A generation taking 2 requests/s; its EngineCore's RSS grows 2 MB/s, its GPU memory
    4 MB/s on a GPU with 10 000 MiB free at t = 0; the host has 10 000 MiB available."""

    now: float = 0.0
    reads: list[float] = field(default_factory=list)
    notes: list[tuple[MemoryStatus, Any, Any, float | None]] = field(default_factory=list)
    gpu_rates: list[float | None] = field(default_factory=list)  # the GPU growth rate each note gave
    ledger: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    readings: int = 12

    @property
    def dispatched(self) -> int:
        return int(2 * self.now)

    @property
    def completed(self) -> int:
        return max(0, self.dispatched - 1)

    def read(self, pid: int, requests: int, nvml: object) -> monitors.MemoryRead:
        self.reads.append(self.now)
        rss, gpu = 1000.0 + 2.0 * self.now, 30000.0 + 4.0 * self.now
        p = ProcessMemory(pid=pid, role=Role.ENGINE_CORE, rss_mb=rss, uss_mb=rss - 100, swap_mb=0.0, gpu_mb=gpu)
        cur = MemoryReading(at="2026-01-01T00:00:00Z", requests=requests, rss_mb=rss, uss_mb=rss - 100, gpu_mb=gpu,
                            per_process=[p])
        return cur, [ChildProcess(pid=pid, role=Role.ENGINE_CORE)], {"GPU-1": (70000.0 + 4.0 * self.now, 80000.0)}, 10000.0

    async def sleep(self, s: float) -> None:
        self.now += s
        await asyncio.sleep(0)

    def io(self) -> MemoryIO:
        return MemoryIO(read=self.read, prestaged=lambda cfg, model: 0.0, clock=lambda: self.now, sleep=self.sleep)

    def wake(self) -> None:
        if len(self.notes) >= self.readings:
            raise Stop


def _run(w: World, warmup: int = 3, interval: float = 2.0) -> None:
    cfg = GuardConfig(recycle=RecycleConfig(memory_warmup_requests=warmup, memory_interval=interval))
    gen = SimpleNamespace(
        target=w, row=7, number=2, replica=0,
        backend=SimpleNamespace(pid=4242, model="m", remember=lambda found: None),
        note_memory=lambda status, growth, fit, to_limit, gpu_mb_s: (
            w.notes.append((status, growth, fit, to_limit)), w.gpu_rates.append(gpu_mb_s)))
    ledger = SimpleNamespace(generation_progress=lambda row, n: w.ledger.append(("progress", (row, n))),
                             process_memory=lambda *a: w.ledger.append(("memory", a)))
    with pytest.raises(Stop):
        asyncio.run(memory_loop(gen, cfg, None, ledger, ["GPU-1"], w.wake, w.io()))  # type: ignore[arg-type]


def test_the_baseline_is_taken_as_warm_up_ends_not_at_the_next_interval() -> None:
    """Warm-up is `core.leak.warmed_up`: 3 requests are reached at t = 1.5 s, and the baseline is
    read then (polled every 50 ms), not at the next interval (t = 2 s): a fast leak does not hide
    in a late baseline. Then one reading per interval."""
    w = World()
    _run(w)
    assert w.reads[0] == 0.0 and w.reads[1] == pytest.approx(1.5, abs=0.051)
    assert [round(b - a, 6) for a, b in zip(w.reads[1:], w.reads[2:])] == [2.0] * (len(w.reads) - 2)
    first, second = w.notes[0][0], w.notes[1][0]
    assert first.baseline is None and w.notes[0][1] is None  # no growth before warm-up
    assert second.baseline is not None and leak.warmed_up(second.baseline.requests, 3)
    assert not leak.warmed_up(first.current.requests, 3)
    status, growth, _, _ = w.notes[-1]
    assert growth.rss_mb == pytest.approx(2.0 * (w.reads[-1] - w.reads[1]), abs=0.1)
    assert growth.gpu_mb == pytest.approx(4.0 * (w.reads[-1] - w.reads[1]), abs=0.1)
    assert status.warmup_requests == 3


def test_the_time_to_the_limit_is_the_nearer_of_host_and_gpu_once_enough_readings() -> None:
    """The host has 10 000 MiB at 2 MB/s (5 000 s); the GPU's free memory shrinks at 4 MB/s from
    10 000 MiB: the GPU is the nearer limit. No forecast before FORECAST_POINTS readings after
    the baseline; from then on the GPU's growth rate comes with it (the next generation's prior)."""
    w = World()
    _run(w)
    to_limit = [n[3] for n in w.notes]
    first = 1 + FORECAST_POINTS - 1  # the baseline's reading is the first point
    assert all(x is None for x in to_limit[:first]) and all(x is not None for x in to_limit[first:])
    t = w.reads[-1]
    assert to_limit[-1] == pytest.approx((10000.0 - 4.0 * t) / 4.0, rel=1e-6)
    assert w.notes[-1][2].gpu_free_mb == pytest.approx(10000.0 - 4.0 * t)
    assert all(r is None for r in w.gpu_rates[:first]) and w.gpu_rates[first:] == [pytest.approx(4.0)] * (
        len(w.gpu_rates) - first)


def test_every_reading_reaches_the_ledger_and_the_served_count_with_it() -> None:
    w = World(readings=4)
    _run(w)
    kinds = [k for k, _ in w.ledger]
    assert kinds == ["progress", "memory"] * 4
    assert [a for k, a in w.ledger if k == "progress"][-1] == (7, max(0, int(2 * w.reads[-1]) - 1))
    memory = [a for k, a in w.ledger if k == "memory"]
    assert all(a[:2] == (2, 0) and a[3] == 10000.0 for a in memory)  # generation, replica, ..., host available


def test_without_warm_up_the_first_reading_is_the_baseline() -> None:
    w = World(readings=2)
    _run(w, warmup=0)
    assert w.notes[0][0].baseline is not None and w.reads == [0.0, 2.0]
