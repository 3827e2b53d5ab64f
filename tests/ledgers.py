"""Ledgers for the report's tests, written by the project's own writers.

`runtime_ledger` is what a runtime leaves when no soak and no watchdog ever ran: its
generations, recycles and failures, every request through the runtime's own `TrafficRecorder`
(the proxy's listener: per-minute histograms and per-request rows) and its memory readings.
`add_watchdog` adds the watchdog's ticks (NVML thermals and power, process memory);
`add_soak` a soak's requests and memory samples.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_guard.core import ledger as L
from vllm_guard.core.protocol import MemoryReading, ProcessMemory, Role
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading, StatusBrief
from vllm_guard.core.timefmt import iso
from vllm_guard.loadgen.params import SoakParams
from vllm_guard.loadgen.store import MemoryRow, RequestRow, SoakStore
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone
from vllm_guard.runtime.records.traffic import TrafficRecorder
from vllm_guard.runtime.records.writer import RuntimeLedger


@dataclass(frozen=True)
class Box:
    gpu: str = "NVIDIA A100-SXM4-80GB"
    leak_mb: float = 0.2  # EngineCore RSS per request
    gpu_leak_mb: float = 0.1
    ttft_s: float = 0.04  # median TTFT
    hours: float = 2.0
    rate: float = 1.0  # requests per second
    replicas: int = 1
    seed: int = 0
    crash: bool = True  # replica 0's second generation crashes once


def base_time(hours: float) -> dt.datetime:
    """The ledger ends about now: an open generation counts up to now."""
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=hours)


def _iso(base: dt.datetime, s: float) -> str:
    return iso(base + dt.timedelta(seconds=s))


def runtime_ledger(path: Path, box: Box = Box()) -> dt.datetime:
    """Two generations per replica (a scheduled recycle at 1 h), an unplanned crash of replica 0's
    second generation, one request per 1/rate s per replica, memory every 5 s. Returns the base time."""
    base = base_time(box.hours)
    end = box.hours * 3600.0
    conn = L.connect(path)
    gen = 0
    gens: list[tuple[int, int, float, float]] = []  # (replica, generation, ready, end)
    for r in range(box.replicas):
        gen += 1
        conn.execute("INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, "
                     "boot_id, gpu_name, model, replica, requests_served) VALUES (?, ?, ?, ?, 'scheduled', "
                     "'max_requests', 'b', ?, 'tiny', ?, ?)",
                     (gen, _iso(base, 0), _iso(base, 60), _iso(base, 3600), box.gpu, r, int(3540 * box.rate)))
        conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight, duration_s, replica) "
                     "VALUES (?, 'max_requests', 'scheduled', ?, 2, 60, ?)", (gen, _iso(base, 3590), r))
        gens.append((r, gen, 60.0, 3600.0))
        gen += 1
        conn.execute("INSERT INTO generations (generation, started_at, ready_at, boot_id, gpu_name, model, replica, "
                     "requests_served) VALUES (?, ?, ?, 'b', ?, 'tiny', ?, ?)",
                     (gen, _iso(base, 3610), _iso(base, 3660), box.gpu, r, int((end - 3660) * box.rate)))
        gens.append((r, gen, 3660.0, end))
        if r == 0 and box.crash:
            conn.execute("INSERT INTO failures (generation, kind, class, at, exit_code, detail, restored_at) VALUES "
                         "(?, 'crash', 'unplanned', ?, -9, 'engine process died', ?)",
                         (gen, _iso(base, 6000), _iso(base, 6060)))
    conn.close()
    rng = np.random.default_rng(box.seed)
    led = RuntimeLedger(path)
    rec = TrafficRecorder(led, 86400.0, clock=lambda: base.timestamp() + end + 120)
    t0 = base.timestamp()
    for r, g, ready, stop in gens:
        n = int((stop - ready) * box.rate)
        for i in range(n):
            t = ready + i / box.rate
            ttft = box.ttft_s * float(np.exp(rng.normal(0, 0.25)))
            failed = i % 500 == 250
            rec.record(RequestDone(
                request_id=f"r{r}-{g}-{i}", counted=True, outcome=Outcome.FAILED if failed else Outcome.COMPLETED,
                status=502 if failed else 200, reason="backend failed" if failed else "", arrived=t0 + t,
                e2e_s=ttft + 0.3, ttft_s=None if failed else ttft, generation=g, replica=r, chunks=16,
                max_gap_s=0.03, stream=True, prompt_tokens=32, completion_tokens=None if failed else 16))
        for k in range(int((stop - ready) / 5)):
            t = ready + 5.0 * k
            req = int(5.0 * k * box.rate)
            eng = 700 + box.leak_mb * req + float(rng.normal(0, 1))
            gpu = 30000 + box.gpu_leak_mb * req
            reading = MemoryReading(at=_iso(base, t), requests=req, rss_mb=eng + 600, uss_mb=None, gpu_mb=gpu,
                                    per_process=[
                                        ProcessMemory(pid=100 + g, role=Role.ENGINE_CORE, rss_mb=round(eng, 1),
                                                      uss_mb=round(eng - 100, 1), swap_mb=0.0, gpu_mb=gpu),
                                        ProcessMemory(pid=200 + g, role=Role.API_SERVER,
                                                      rss_mb=round(600 + float(rng.normal(0, 1)), 1),
                                                      uss_mb=500.0, swap_mb=0.0, gpu_mb=0.0)])
            rec.memory(g, r, reading, host_available_mb=50000.0, gpu_free_mb=81559 - 40000 - (gpu - 30000))
    rec.flush(everything=True)
    assert led.close(60.0)
    return base


def add_watchdog(path: Path, base: dt.datetime, box: Box = Box(), hot: tuple[float, float] = (4000.0, 5000.0)) -> None:
    """One watchdog tick per 30 s: NVML (temperature, clocks, throttling in `hot`, power, per-pid
    memory), host memory, the runtime's counters and its processes."""
    rng = np.random.default_rng(box.seed + 1)
    conn = L.connect(path)
    host = HostReading(mem_total_mb=64000.0, mem_available_mb=50000.0, swap_used_mb=0.0)
    for i in range(int(box.hours * 3600 / 30)):
        t = 30.0 * i
        at = _iso(base, t)
        h = 0x20 if hot[0] < t < hot[1] else 0
        gen = 1 if t < 3600 else 2
        req = max(0, int((t - (60 if gen == 1 else 3660)) * box.rate))
        pid = 100 + gen
        nvml = NvmlRecord.model_validate({"at_s": (base + dt.timedelta(seconds=t)).timestamp(), "gpus": [{
            "index": 0, "uuid": "GPU-1", "name": box.gpu, "temp_c": 60 + 20 * (h > 0) + rng.normal(0, 1),
            "sm_clock_mhz": 1980 - 300 * (h > 0), "sm_clock_max_mhz": 1980, "clock_reasons": h,
            "power_w": 300.0 + 50 * (h > 0), "mem_total_mb": 81559.0, "mem_used_mb": 40000.0 + box.gpu_leak_mb * req,
            "processes": [{"pid": pid, "used_mb": 30000.0 + box.gpu_leak_mb * req}]}]})
        procs = {str(pid): ProcReading.model_validate({"role": "engine_core", "rss_mb": 700 + box.leak_mb * req
                                                       + rng.normal(0, 1)})}
        status = StatusBrief(state="serving", generation=gen, requests_total=req, requests_generation=req,
                             in_flight=0, queued=0, failures=0, completed=req)
        for src, rec in (("nvml", nvml), ("host", host), ("status", status)):
            conn.execute("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)", (at, src, rec.model_dump_json()))
        conn.execute("INSERT INTO samples (at, source, data) VALUES (?, 'procs', ?)",
                     (at, json.dumps({k: v.model_dump(mode="json") for k, v in procs.items()})))
    conn.close()


def add_soak(path: Path, base: dt.datetime, box: Box = Box(), n: int = 1500) -> None:
    rng = np.random.default_rng(box.seed + 2)
    store = SoakStore(path)
    params = SoakParams(url="http://x", model="tiny", max_model_len=512, scenario="S1", prompt_tokens=16,
                        output_tokens=16, concurrency=None, rate=0.2, burstiness=1.0, mode="steady",
                        burst_period_s=60.0, burst_duty=0.25, seed=0, duration_s=7200.0, timeout_s=600.0,
                        max_requests=None, state_dir=None)
    run = store.create_run("tok-" + box.gpu, params, "")
    rows = []
    half = n // 2
    for i in range(n):
        t = 60 + i * 4.7
        gen = 1 if i < half else 2
        rows.append(MemoryRow(run_id=run, at=_iso(base, t), generation=gen, state="serving", requests_total=i,
                              role="engine_core", pid=100 + gen, requests_generation=(i if gen == 1 else i - half),
                              rss_mb=700 + box.leak_mb * (i % half) + rng.normal(0, 1), uss_mb=600.0, gpu_mb=0.0,
                              host_available_mb=50000.0))
        sent = (base + dt.timedelta(seconds=t)).timestamp()
        ttft = 0.03 + 0.02 * rng.random()
        store.put_request(RequestRow(run_id=run, seq=i, request_id=f"r{i}", sent_at=sent, scheduled_at=sent,
                                     ended_at=sent + 0.3, status=200, ttft_s=ttft, ttft_sched_s=ttft, e2e_s=0.3,
                                     e2e_sched_s=0.3, itl_mean_s=0.01, chunks=16, output_tokens=16,
                                     error=None if i % 100 else "http_503_recycle", segment=0))
    store.put_samples(rows[::3])
    store.close()
