"""The one leak rule (core.leak) and the one Theil-Sen (core.stats), as the report applies them:
a saw-tooth of recycles must not hide (or fake) a leak, a warm-up step is not one, a time to
out of memory only for a leak shown, and the watchdog says the same of the same points."""

from __future__ import annotations

import random

import numpy as np
import pytest
from scipy import stats

from vllm_guard.core import leak as rule
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.protocol import RequestCounters, Role
from vllm_guard.core.samples import HostReading, ProcReading, Tick
from vllm_guard.core.stats import theil_sen, theil_sen_groups
from vllm_guard.report.ledgerread import LedgerData, ProcessMemoryRow
from vllm_guard.report.memory import leak_report, points_from_watchdog
from vllm_guard.watchdog.drift import DriftDetector
from test_watchdog_units import cfg_of, sample, status


def _sawtooth(rate_mb: float, gens: int = 4, n: int = 120, seed: int = 0) -> list[rule.Series]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(gens):
        x = np.sort(rng.uniform(100, 900, n))
        y = 700 + 30 * g + rate_mb * x + rng.normal(0, 2.0, n) + 8 * (rng.random(n) < 0.05)  # allocator steps
        out.append(rule.Series(list(3600.0 * g + x), list(x), list(y)))
    return out


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.2])
def test_stratified_slope_recovers_the_rate_with_an_interval(rate: float) -> None:
    s = theil_sen_groups([(g.x, g.y) for g in _sawtooth(rate)], 0.95)
    assert s is not None and s.groups == 4 and s.n == 480
    assert s.slope * 100 == pytest.approx(100 * rate, abs=0.15)
    assert s.low <= rate <= s.high or abs(s.slope - rate) < 0.0005
    pooled = np.concatenate([np.array(g.y) for g in _sawtooth(rate)])
    naive = theil_sen(range(len(pooled)), pooled)  # across recycles, in order: not the leak
    assert naive is not None and (rate == 0.0 or abs(naive.slope / rate - 1) > 0.2 or naive.slope < rate)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_group_is_scipys_theil_sen_exactly(seed: int) -> None:
    """The report's stratified fit used floor/ceil ranks without tie corrections, the watchdog's
    scipy's: two intervals for one series. Now one estimator: one group is scipy's, exactly."""
    rng = random.Random(seed)
    x = [float(rng.randint(0, 80)) for _ in range(150)]
    y = [round(500 + 0.4 * v + rng.gauss(0, 3)) for v in x]
    ref = stats.theilslopes(y, x, 0.95)
    got = theil_sen_groups([(x, y)], 0.95)
    assert got is not None
    assert (got.slope, got.low, got.high) == pytest.approx((ref.slope, ref.low_slope, ref.high_slope), rel=1e-12)
    assert theil_sen_groups([([1, 1, 1], [1, 2, 3])]) is None and theil_sen_groups([]) is None


def test_the_rule_a_step_is_not_a_leak_and_too_few_is_not_yet() -> None:
    flat_step = [rule.Series([float(i) for i in range(400)], [float(2 * i) for i in range(400)],
                             [1760 + (2000 if 2 * i >= 400 else 0) + 0.3 * ((i * 7919) % 5 - 2) for i in range(400)])]
    v = rule.judge(flat_step)
    assert not v.shown and v.time_to_oom_h(10_000) is None and "no leak shown yet" in v.why_not()
    settling = [rule.Series([float(i) for i in range(400)], [float(2 * i) for i in range(400)],
                            [900 + 0.5 * min(2 * i, 500) + 0.3 * ((i * 7919) % 5 - 2) for i in range(400)])]
    v = rule.judge(settling)  # grows over the first 500 requests, then flat: the whole clears, the end does not
    assert v.enough and not v.shown and v.per_100 is not None and v.per_100.low > rule.NOISE_FLOOR_MB_PER_100
    assert "the second half does not clear it" in v.why_not(), v.why_not()
    leak = rule.judge(_sawtooth(0.2))
    assert leak.shown and leak.per_100 is not None and leak.per_100.slope == pytest.approx(20, abs=0.5)
    assert leak.time_to_oom_h(1000.0) is not None and leak.why_not() == ""
    short = rule.judge([rule.Series([0.0, 1.0, 2.0, 3.0], [100, 110, 120, 130], [1.0, 5.0, 9.0, 13.0])])
    assert not short.enough and not short.shown and "too few" in short.why_not()


def _drift(rate_mb: float, step: bool = False) -> tuple[bool, list[Tick]]:
    """The watchdog's detector and the ticks it saw (the report reads the same ticks)."""
    d = DriftDetector(cfg_of({"forecast_horizon": "24h"}))
    rng = random.Random(3)
    ticks, last = [], None
    for i in range(600):
        req = 2 * i
        rss = 600 + rate_mb * req + (120 if step and req >= 400 else 0) + rng.gauss(0, 1.0)
        s = sample(t=float(i), status=status(requests=RequestCounters(total=req, generation=req)),
                   procs={11: ProcReading(role=Role.ENGINE_CORE, rss_mb=rss)}, host=HostReading(
                       mem_total_mb=16000.0, mem_available_mb=8000.0, swap_used_mb=0.0, boot_id="b"))
        last = d.check(s)
        ticks.append(Tick.from_sources(f"2026-01-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}.000Z", {
            "procs": {"11": {"role": "engine_core", "rss_mb": rss}},
            "status": {"state": "serving", "generation": 1, "requests_total": req, "requests_generation": req,
                       "in_flight": 0, "queued": 0, "failures": 0},
            "host": {"mem_total_mb": 16000.0, "mem_available_mb": 8000.0, "swap_used_mb": 0.0}}))
    assert last is not None
    series = [v for v in last.data["series"] if v["memory"] == "host_rss"]
    return bool(series and series[0]["significant"]), ticks


@pytest.mark.parametrize("rate,step,expect", [(0.2, False, True), (0.0, True, False), (0.0, False, False)])
def test_the_watchdog_and_the_report_give_one_verdict(rate: float, step: bool, expect: bool) -> None:
    """The same points: the watchdog recycles on a leak exactly when the report shows one and
    forecasts out of memory; a warm-up step or flat memory is neither's leak."""
    watchdog_says, ticks = _drift(rate, step)
    d = LedgerData(path="x", ticks=ticks)
    f = leak_report(d, [0])
    eng = next(p for p in f.processes if p.role == "engine_core" and p.metric == "rss_mb")
    assert watchdog_says is expect and eng.leak is expect, (watchdog_says, eng.verdict)
    assert (eng.time_to_oom_h is not None) is expect
    assert points_from_watchdog(ticks)[0].requests == 0


def test_the_runtime_records_its_warm_up_and_the_report_uses_it() -> None:
    """The ledger says the runtime's warm-up (meta `runtime.memory_warmup_requests`): the
    report leaves out the same points as the runtime's growth baseline; without it, the one
    default (core.leak), which both config keys default to."""
    from vllm_guard.core.config import RecycleConfig
    from vllm_guard.report.ledgerread import RuntimeMeta

    assert RecycleConfig().memory_warmup_requests == WatchdogConfig().warmup_requests == rule.WARMUP_REQUESTS
    rows = [ProcessMemoryRow(float(i), 0, 1, 9, "engine_core", 10 * i, 700.0 + (50 if 10 * i < 300 else 0) + 0.1 * i,
                             None, None, None, 8000.0, None) for i in range(400)]
    d = LedgerData(path="x", process_memory=rows)
    f = leak_report(d, [0])
    assert f.warmup_requests == rule.WARMUP_REQUESTS and "default" in f.warmup_from
    d.runtime_meta = RuntimeMeta(memory_warmup_requests=300)
    f = leak_report(d, [0])
    eng = next(p for p in f.processes if p.metric == "rss_mb")
    assert f.warmup_requests == 300 and "runtime" in f.warmup_from
    assert eng.points == 370 and rule.warmed_up(300, 300) and not rule.warmed_up(299, 300)


def test_the_shipped_examples_forecast_only_the_leak() -> None:
    """docs/examples: the steady box (no injected leak) forecasts no out of memory, the leaky one
    (0.4 MB per request in EngineCore) does, on its EngineCore host RSS alone."""
    import json
    import subprocess

    from conftest import GUARD, ROOT

    ledgers = ROOT / "docs" / "results" / "cpu-2core-2026-12-01" / "example-ledgers"
    got = {}
    for box in ("steady", "leaky"):
        out = subprocess.run([GUARD, "report", "--db", str(ledgers / f"{box}.sqlite"), "--format", "json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        got[box] = json.loads(out.stdout)
    assert not [p for p in got["steady"]["leak"]["processes"] if p["time_to_oom_h"] is not None]
    assert "Out of memory: no forecast (no leak shown)" in got["steady"]["summary"]["lines"]
    leaks = [(p["role"], p["metric"]) for p in got["leaky"]["leak"]["processes"] if p["leak"] and p["metric"] == "rss_mb"]
    assert leaks == [("engine_core", "rss_mb")]
    eng = next(p for p in got["leaky"]["leak"]["processes"] if (p["role"], p["metric"]) == ("engine_core", "rss_mb"))
    assert eng["per_100_requests"]["slope"] == pytest.approx(40, rel=0.05) and eng["time_to_oom_h"] > 0
    shipped = (ROOT / "docs" / "examples" / "report-steady.txt").read_text()
    assert "Out of memory: no forecast" in shipped and "out of memory in" not in shipped


@pytest.mark.parametrize("cap_mb,left,of", [(0.0, 81559.0 - 20000.0, "81559 MB"),
                                            (24576.0, 24576.0 - 20000.0, "an injected 24576 MB budget")])
def test_the_report_reads_gpu_headroom_by_the_watchdogs_rule_capped_at_an_injected_budget(
        cap_mb: float, left: float, of: str) -> None:
    """The report's GPU headroom is the watchdog's: NVML free memory, with the card's total capped
    at an injected budget (the watchdog records it as `gpu_cap_mb`) by core.gpu's one rule."""
    from vllm_guard.report.memory import gpu_headroom

    tick = Tick.model_validate({"at": "2026-12-07T09:30:00.000Z", "nvml": {"at_s": 1.0, "gpus": [
        {"index": 0, "uuid": "GPU-x", "name": "NVIDIA H100 80GB HBM3", "mem_total_mb": 81559.0, "mem_used_mb": 20000.0}]}})
    assert gpu_headroom([tick], None, [], cap_mb) == (left, f"NVML free memory ({left:g} of {of})")
