"""Rules that had a second definition beside the first, each now read from its one home and fed
the same input on every path that applies it. Latency quantiles (`core.latency`): the soak's
summary, the runtime's status and minutes, the report's traffic and soak figures. The clock
drop over the watchdog's window (`core.gpu`). Process identity (`child.keeper`, which the
runtime's `procs` applies to the ledger's records too). Fast: no vLLM."""

from __future__ import annotations

import collections
import datetime as dt
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_guard.core import gpu, latency
from vllm_guard.core import stream as client
from vllm_guard.loadgen.live import Live
from vllm_guard.loadgen.params import SoakParams
from vllm_guard.loadgen.runner import summary as soak_summary
from vllm_guard.loadgen.store import RequestRow, SoakStore
from vllm_guard.report.build import figures
from vllm_guard.report.thermal import GpuPoint, worst_drop
from vllm_guard.runtime.child import keeper, procs
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone
from vllm_guard.runtime.frontdoor.proxy import Proxy
from vllm_guard.runtime.records.traffic import TrafficRecorder
from vllm_guard.runtime.records.writer import RuntimeLedger

TTFT = np.random.default_rng(7).lognormal(np.log(0.05), 0.8, 700)  # the same requests on every path


def _soak(ttft: np.ndarray) -> dict[str, object]:
    """The soak's end-of-run summary (what `vllm-guard soak` prints and the benchmarks read)."""
    live = Live()
    for v in ttft:
        live.add(client.Result(status=200, ttft_s=float(v), e2e_s=float(v) + 0.2, output_tokens=8), 0.0,
                 float(v) + 0.2)
    s = SimpleNamespace(live=live, sampler=None, run_id=1, behind=0, store=SimpleNamespace(commits=0, rows=0),
                        p=SimpleNamespace(closed_loop=True, concurrency=1, rate=math.inf))
    return soak_summary(s, "done")  # type: ignore[arg-type]


def _ledger(db: Path, ttft: np.ndarray) -> None:
    """The runtime's minutes (its own recorder, as the proxy's listener feeds it) and a soak's rows
    of the same requests, in one ledger."""
    t0 = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)).timestamp()
    led = RuntimeLedger(db)
    rec = TrafficRecorder(led, 86400.0, clock=lambda: t0 + 7200)
    for i, v in enumerate(ttft):
        rec.record(RequestDone(request_id=f"r{i}", counted=True, outcome=Outcome.COMPLETED, status=200, reason="",
                               arrived=t0 + i, e2e_s=float(v) + 0.2, ttft_s=float(v), generation=1, replica=0,
                               chunks=8, max_gap_s=0.03, stream=True, prompt_tokens=16, completion_tokens=8))
    rec.flush(everything=True)
    assert led.close(60.0)
    store = SoakStore(db)
    params = SoakParams(url="http://x", model="tiny", max_model_len=512, scenario="S1", prompt_tokens=16,
                        output_tokens=8, concurrency=1, rate=math.inf, burstiness=1.0, mode="steady",
                        burst_period_s=60.0, burst_duty=0.25, seed=0, duration_s=3600.0, timeout_s=60.0,
                        max_requests=None, state_dir=None)
    run = store.create_run("tok", params, "")
    for i, v in enumerate(ttft):
        store.put_request(RequestRow(run_id=run, seq=i, request_id=f"r{i}", sent_at=t0 + i, scheduled_at=t0 + i,
                                     ended_at=t0 + i + float(v) + 0.2, status=200, ttft_s=float(v),
                                     ttft_sched_s=float(v), e2e_s=float(v) + 0.2, e2e_sched_s=float(v) + 0.2,
                                     itl_mean_s=0.01, chunks=8, output_tokens=8, error=None, segment=0))
    store.close()


def _r6(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def test_the_same_requests_give_one_p50_and_p99_in_soak_status_and_report(tmp_path: Path) -> None:
    """Before: the soak's 1 % buckets read at their upper edge, the status' sorted recent list, the
    report's soak section np.percentile, the report's traffic 2 % buckets interpolated."""
    soak = _soak(TTFT)
    status = latency.summary(collections.deque(TTFT, maxlen=4096))
    db = tmp_path / "l.sqlite"
    _ledger(db, TTFT)
    r, _ = figures(db)
    p50 = {"soak": soak["ttft_p50_s"], "status": status.p50_s, "report traffic (runtime's minutes)":
           _r6(r.traffic.ttft_s.p50), "report soak": _r6(r.soak.ttft_s.p50)}
    p99 = {"soak": soak["ttft_p99_s"], "status": status.p99_s, "report traffic (runtime's minutes)":
           _r6(r.traffic.ttft_s.p99), "report soak": _r6(r.soak.ttft_s.p99)}
    assert r.traffic.requests == len(TTFT) and status.samples == len(TTFT)
    assert len(set(p50.values())) == 1, p50
    assert len(set(p99.values())) == 1, p99
    assert p50["soak"] == pytest.approx(float(np.quantile(TTFT, 0.5)), rel=0.01)  # the rule: within 1 %
    assert p99["soak"] == pytest.approx(float(np.quantile(TTFT, 0.99)), rel=0.02)


def test_the_status_ttft_is_the_core_summary() -> None:
    recent = collections.deque(TTFT, maxlen=4096)
    proxy = SimpleNamespace(ttft=recent, upstream=SimpleNamespace(ttft=recent))
    assert Proxy.ttft_summary(proxy) == latency.summary(recent)  # type: ignore[arg-type]


def _clock_points(ratios: list[float], every_s: float, idle_every: int = 7) -> list[GpuPoint]:
    return [GpuPoint(t=every_s * i, name="H100", temp_c=60.0, sm_clock_mhz=1980.0 * r,
                     sm_clock_max_mhz=None if i % 3 else 1980.0, reasons=gpu.GPU_IDLE if i % idle_every == 0 else 0,
                     temp_slowdown_c=90.0) for i, r in enumerate(ratios)]


def test_the_reports_worst_clock_drop_is_the_watchdogs_figure_over_its_worst_window() -> None:
    """report.thermal's sliding windows agree with `core.gpu.clock_drop_pct` applied to each window
    the watchdog keeps (points no older than the window), idle points and a missing max included."""
    rng = np.random.default_rng(2)
    ratios = list(np.clip(1.0 - np.abs(rng.normal(0, 0.08, 400)), 0.3, 1.0))
    pts, window = _clock_points(ratios, 5.0), 300.0
    t = np.array([p.t for p in pts])
    samples = [(p.sm_clock_mhz, p.sm_clock_max_mhz or 1980.0, p.reasons) for p in pts]
    busy_t = [p.t for p, s in zip(pts, samples) if gpu.busy_clock_ratio(*s) is not None]
    worst = max(gpu.clock_drop_pct(s for s, ti in zip(samples, t) if end - window <= ti <= end) or 0.0
                for end in busy_t if end - busy_t[0] >= window)
    assert worst_drop(pts, 1980.0, window) == pytest.approx(worst, abs=1e-9)
    short = pts[:20]  # shorter than one window: the whole run's drop
    assert worst_drop(short, 1980.0, window) == pytest.approx(gpu.clock_drop_pct(samples[:20]), abs=1e-12)


# -- process identity ------------------------------------------------------------------------------
@pytest.fixture
def sleeper() -> object:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()


def test_the_ledgers_start_time_is_the_keepers_identity(sleeper: subprocess.Popen[bytes]) -> None:
    """What the runtime records (epoch s, as psutil's create_time) reads back to the exact start
    ticks the keeper knows the process by; one tick off is another process."""
    import psutil

    ticks = keeper.start_ticks(sleeper.pid)
    started = procs.start_time(sleeper.pid)
    assert ticks is not None and started is not None
    assert started == pytest.approx(psutil.Process(sleeper.pid).create_time(), abs=1e-6)
    assert procs.ticks_of(started) == ticks and keeper.same_process(keeper.start_ticks(sleeper.pid), ticks)
    assert not keeper.same_process(ticks + 1, ticks) and not keeper.same_process(None, ticks)
    assert keeper.born_in(ticks, ticks) and not keeper.born_in(ticks - 1, ticks)


def test_a_recorded_tree_is_killed_only_when_the_start_matches_to_the_tick(sleeper: subprocess.Popen[bytes]) -> None:
    started = procs.start_time(sleeper.pid)
    assert started is not None
    one_tick = 1.0 / procs.CLOCK_TICKS
    assert procs.kill_recorded_tree(sleeper.pid, started + one_tick, timeout=2.0) == []  # a reused pid: left alone
    assert sleeper.poll() is None
    assert procs.kill_recorded_tree(sleeper.pid, started, timeout=5.0) == [sleeper.pid]
    deadline = time.monotonic() + 5.0
    while sleeper.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sleeper.poll() is not None  # killed (and reaped by kill_recorded_tree)
