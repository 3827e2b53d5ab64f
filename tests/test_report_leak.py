"""Leak slopes within generations: a saw-tooth of recycles must not hide (or fake) a leak."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_guard.core.samples import Tick
from vllm_guard.report.leak import Series, group_slope, stratified_slope, time_to_limit_h
from vllm_guard.report.memory import leak_report, points_from_watchdog


def _sawtooth(rate_mb: float, gens: int = 4, n: int = 120, seed: int = 0) -> list[Series]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(gens):
        x = np.sort(rng.uniform(0, 800, n))
        y = 700 + 30 * g + rate_mb * x + rng.normal(0, 2.0, n) + 8 * (rng.random(n) < 0.05)  # allocator steps
        out.append(Series(g + 1, list(x), list(y)))
    return out


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.2])
def test_stratified_slope_recovers_the_rate_with_an_interval(rate: float) -> None:
    s = stratified_slope(_sawtooth(rate), 0.90).scaled(100)
    assert s.slope == pytest.approx(100 * rate, abs=0.15)
    assert s.low <= 100 * rate <= s.high or abs(s.slope - 100 * rate) < 0.05
    assert s.n_groups == 4 and s.n_points == 480
    pooled = np.concatenate([np.array(g.y) for g in _sawtooth(rate)])
    naive = group_slope(range(len(pooled)), pooled)  # across recycles, in order: not the leak
    assert rate == 0.0 or abs(naive.slope * 100 / (100 * rate) - 1) > 0.2 or naive.slope < rate


def test_single_group_matches_scipy_and_degenerate_input() -> None:
    g = _sawtooth(0.1, gens=1)[0]
    a, b = stratified_slope([g]), group_slope(g.x, g.y)
    assert a.slope == pytest.approx(b.slope, rel=0.02)
    assert a.low == pytest.approx(b.low, rel=0.05) and a.high == pytest.approx(b.high, rel=0.05)
    assert group_slope([1, 1, 1], [1, 2, 3]).slope is None
    assert stratified_slope([]).slope is None
    assert time_to_limit_h(1000, 10) == 100 and time_to_limit_h(1000, -1) is None


def test_watchdog_rows_are_read_per_tick() -> None:
    """The watchdog's per-source records of one tick (core.samples): procs, status, nvml, host."""
    ticks = []
    for i in range(60):
        req = 25 + 10 * i
        ticks.append(Tick.from_sources(f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}.000Z", {
            "procs": {"4242": {"role": "engine_core", "rss_mb": 600 + 0.2 * req, "uss_mb": 500 + 0.2 * req}},
            "status": {"state": "serving", "generation": 1, "requests_total": req, "requests_generation": req,
                       "in_flight": 0, "queued": 0, "failures": 0},
            "nvml": {"at_s": 1.7e9 + i, "gpus": [{"index": 0, "uuid": "GPU-1", "name": "g",
                                                   "processes": [{"pid": 4242, "used_mb": 900.0}]}]},
            "host": {"mem_total_mb": 16000.0, "mem_available_mb": 10000.0, "swap_used_mb": 0.0},
        }))
    pts = points_from_watchdog(ticks)
    assert len(pts) == 60 and pts[0].gpu_mb == 900.0 and pts[0].host_available_mb == 10000.0
    rep = leak_report(pts, "watchdog")
    rss = next(p for p in rep["processes"] if p["metric"] == "rss_mb")
    assert rss["per_100_requests"]["slope"] == pytest.approx(20.0, rel=1e-6)
    assert rss["per_hour"]["slope"] == pytest.approx(0.2 * 10 * 3600, rel=1e-6)
    no_procs = Tick.from_sources("2026-01-01T00:00:00.000Z", {"host": {"mem_total_mb": 1.0, "mem_available_mb": 1.0,
                                                                        "swap_used_mb": 0.0}})
    assert points_from_watchdog([no_procs]) == [] and leak_report([], None)["processes"] == []
