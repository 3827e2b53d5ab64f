#!/usr/bin/env python3
"""What the runtime's traffic and memory records cost: ledger size over 30 days at a steady rate,
and CPU per request, through the runtime's own writer (`RuntimeLedger`, `TrafficRecorder`).

    .venv/bin/python bench/bench_ledger.py [--rate 10] [--days 30] [--out FILE]

Growth: a clock is simulated (no waiting). One hour of requests at `--rate` goes through the
recorder (the proxy's listener: per-minute histograms and a row per request); its minute rows,
as written, stand for every hour of the `--days` (histograms of a steady load are alike, and
kept for the ledger's life); then a full retention (`[ledger] request_retention`, 24 h) of
per-request rows goes through the recorder, with the retention deletes the runtime queues
every 5 minutes; and `--days` of memory readings (4 processes every 5 s) with the same
downsampling the runtime applies. The file's size is then what a ledger reaches after those
days (SQLite reuses the pages of deleted rows: past the retention it stops growing by rows).
CPU: `time.process_time()` (every thread: the listener's and the writer's SQLite work) over
records sent through the recorder until they are on disk, per request; and the proxy's own
change per request (keeping a 1 KiB tail instead of 64 bytes, and reading the usage record).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import sys
import tempfile
import time
import timeit
from pathlib import Path

from vllm_guard.core import ledger as L
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.protocol import MemoryReading, ProcessMemory, Role
from vllm_guard.core.timefmt import iso_from_epoch
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone, usage_of
from vllm_guard.runtime.records.traffic import MINUTE_S, TrafficRecorder
from vllm_guard.runtime.records.writer import RuntimeLedger

T0 = 1_800_000_000.0
ROLES = (Role.API_SERVER, Role.ENGINE_CORE, Role.WORKER, Role.HELPER)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def request(rng: random.Random, t: float, i: int) -> RequestDone:
    ttft = 0.03 * math.exp(rng.gauss(0, 0.6))
    chunks = rng.randint(8, 256)
    e2e = ttft + chunks * 0.012 * math.exp(rng.gauss(0, 0.2))
    failed = rng.random() < 0.002
    return RequestDone(request_id=f"chatcmpl-{i:012d}-{rng.getrandbits(64):016x}", counted=True,
                       outcome=Outcome.FAILED if failed else Outcome.COMPLETED, status=502 if failed else 200,
                       reason="the backend's answer was truncated" if failed else "", arrived=t, e2e_s=e2e,
                       ttft_s=ttft, generation=7, replica=0, chunks=chunks, max_gap_s=0.05, stream=True,
                       prompt_tokens=rng.randint(50, 2000), completion_tokens=None if failed else chunks)


def drain(led: RuntimeLedger) -> None:
    while led.health().pending_writes:
        time.sleep(0.01)


def growth(db: Path, rate: float, days: float, retention_s: float) -> dict[str, object]:
    rng = random.Random(0)
    clock = Clock(T0)
    led = RuntimeLedger(db)
    rec = TrafficRecorder(led, retention_s, clock=clock)
    n_hour = int(3600 * rate)
    for i in range(n_hour):  # one hour: its minute rows are the pattern of every hour
        clock.t = T0 + i / rate
        rec.record(request(rng, clock.t, i))
    clock.t = T0 + 3600 + 60
    rec.flush(everything=True)
    drain(led)
    conn = sqlite3.connect(db)
    pattern = conn.execute("SELECT * FROM edge_minutes ORDER BY minute").fetchall()
    conn.execute("DELETE FROM edge_requests")  # the hour's rows: counted again below
    cols = len(pattern[0])
    rows = []
    for h in range(1, int(days * 24)):
        for r in pattern:
            rows.append((None, r[1] + 3600 * h, *r[2:]))
    conn.executemany(f"INSERT INTO edge_minutes VALUES ({', '.join('?' * cols)})", rows)
    conn.commit()
    conn.close()
    # a full retention of per-request rows, with the deletes every 5 minutes, at the end of the days
    start = T0 + days * 86400 - retention_s - 600
    n = int((retention_s + 600) * rate)
    next_maintain = start + 300
    for i in range(n):
        clock.t = start + i / rate
        rec.record(request(rng, clock.t, n_hour + i))
        if clock.t >= next_maintain:
            rec.maintain(clock.t)
            next_maintain += 300
    rec.flush(everything=True)
    drain(led)
    # memory: 4 processes every 5 s for the days, downsampled as the runtime does (every 5 min)
    next_maintain = T0 + 300
    for k in range(int(days * 86400 / 5)):
        t = T0 + 5.0 * k
        procs = [ProcessMemory(pid=100 + j, role=ROLES[j], rss_mb=700.0 + j, uss_mb=600.0, swap_mb=0.0, gpu_mb=None)
                 for j in range(4)]
        rec.memory(7, 0, MemoryReading(at=iso_from_epoch(t), requests=k, rss_mb=2800.0, uss_mb=2400.0, gpu_mb=None,
                                       per_process=procs))
        if t >= next_maintain:
            rec.maintain(t)
            next_maintain += 300
        if k % 2000 == 0:
            drain(led)
    led.close(600.0)
    conn = sqlite3.connect(db)
    counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
              for t in ("edge_minutes", "edge_requests", "process_memory")}
    try:
        sizes = {name: size for name, size in conn.execute(
            "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC") if size > 4096 * 4}
    except sqlite3.OperationalError:
        sizes = {}
    conn.close()
    return {"rate_rps": rate, "days": days, "request_retention_s": retention_s, "rows": counts,
            "bytes_by_table_and_index": sizes, "file_bytes": db.stat().st_size,
            "file_mb": round(db.stat().st_size / 2**20, 1)}


def cpu_per_request(db: Path, n: int = 100_000) -> dict[str, float]:
    """Process CPU (all threads) of sending `n` requests through the recorder to disk."""
    rng = random.Random(1)
    reqs = [request(rng, T0 + i / 10.0, i) for i in range(n)]
    led = RuntimeLedger(db)
    led.attach([], GuardConfig())
    assert led.traffic is not None
    rec = led.traffic
    c0, w0 = time.process_time(), time.perf_counter()
    for r in reqs:
        rec.record(r)
    listener_s = time.process_time() - c0
    rec.flush(everything=True)
    drain(led)
    total_s = time.process_time() - c0
    wall = time.perf_counter() - w0
    led.close()
    chunk = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,' \
            b'"text":" word"}]}\n\n'
    tail = chunk * 8
    per_chunk_64 = min(timeit.repeat(lambda: (tail[-64:] + chunk)[-64:], number=100_000, repeat=5)) / 100_000
    per_chunk_1k = min(timeit.repeat(lambda: (tail + chunk)[-1024:], number=100_000, repeat=5)) / 100_000
    final = tail + b'data: {"choices":[],"usage":{"prompt_tokens":16,"total_tokens":32,"completion_tokens":16}}\n\n' \
        b'data: [DONE]\n\n'
    usage = min(timeit.repeat(lambda: usage_of(final[-1024:]), number=20_000, repeat=5)) / 20_000
    return {"requests": n, "listener_cpu_us": round(1e6 * listener_s / n, 2),
            "recorded_to_disk_cpu_us": round(1e6 * total_s / n, 2), "wall_us": round(1e6 * wall / n, 2),
            "proxy_tail_per_chunk_us_64b": round(1e6 * per_chunk_64, 3),
            "proxy_tail_per_chunk_us_1kib": round(1e6 * per_chunk_1k, 3),
            "proxy_usage_parse_us": round(1e6 * usage, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--retention", type=float, default=float(GuardConfig().ledger.request_retention))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as d:
        t = time.monotonic()
        g = growth(Path(d) / L.LEDGER_NAME, a.rate, a.days, a.retention)
        g["bench_wall_s"] = round(time.monotonic() - t, 1)
        print(json.dumps(g, indent=2), file=sys.stderr, flush=True)
        c = cpu_per_request(Path(d) / "cpu.sqlite")
    res = {"growth": g, "cpu": c}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
