"""The highest request rate the soak client sustains with correct timing.

Against the synthetic upstream (`vllm_guard.loadgen.upstream`, 4 chunks per answer, no delay) on the
same box, the soak runs `--seconds` at each rate; timing is correct when the send lag (actual
send - scheduled send, from the ledger) has p99 <= `--max-lag-p99-ms` and every scheduled
request was sent and answered. Prints one line per rate and the highest passing rate.

    .venv/bin/python bench/bench_soak_rate.py [--rates 100,200,400,800,1200,1600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

GUARD = [sys.executable, "-m", "vllm_guard.cli"]  # no console script needed (the device installs with --target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_rate(url: str, rate: float, seconds: float, tmp: Path) -> dict[str, float]:
    db = tmp / f"rate-{rate:g}.sqlite"
    t0 = time.monotonic()
    p = subprocess.Popen([*GUARD, "soak", "--url", url, "--db", str(db), "--scenario", "custom",
                          "--prompt-tokens", "8", "--output-tokens", "4", "--rate", str(rate), "--duration", f"{seconds}s",
                          "--no-progress", "--timeout", "30s"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    proc = psutil.Process(p.pid)
    while p.poll() is None:  # the soak's peak RSS: bounded memory means it does not grow with time
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    out, err = p.communicate()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(err.decode()[-2000:])
    with sqlite3.connect(db) as c:
        rows = np.array(c.execute("SELECT sent_at - scheduled_at, e2e_s, error IS NULL FROM requests").fetchall(), float)
        span = c.execute("SELECT MAX(sent_at) - MIN(sent_at) FROM requests").fetchone()[0]
    lag = rows[:, 0]
    return {"rate": rate, "requests": len(rows), "ok": int(rows[:, 2].sum()), "sent_rate": len(rows) / span,
            "lag_p50_ms": 1000 * float(np.percentile(lag, 50)), "lag_p99_ms": 1000 * float(np.percentile(lag, 99)),
            "lag_max_ms": 1000 * float(lag.max()), "e2e_p50_ms": 1000 * float(np.percentile(rows[:, 1], 50)),
            "wall_s": wall, "peak_rss_mb": peak / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100,200,400,800,1200,1600,2400")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--max-lag-p99-ms", type=float, default=5.0)
    p.add_argument("--json")
    a = p.parse_args()
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "vllm_guard.loadgen.upstream", "--port", str(port), "--chunks", "4"])
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-rate-"))
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        results, best = [], None
        for rate in (float(x) for x in a.rates.split(",")):
            res = one_rate(url, rate, a.seconds, tmp)
            res["loadavg_1m"] = os.getloadavg()[0]
            res["pass"] = res["ok"] == res["requests"] and res["lag_p99_ms"] <= a.max_lag_p99_ms
            results.append(res)
            print(f"rate {rate:>6g}/s: sent {res['sent_rate']:.1f}/s, {res['ok']}/{res['requests']} ok, send lag p50 "
                  f"{res['lag_p50_ms']:.2f} ms p99 {res['lag_p99_ms']:.2f} ms max {res['lag_max_ms']:.1f} ms, "
                  f"e2e p50 {res['e2e_p50_ms']:.2f} ms, soak peak RSS {res['peak_rss_mb']:.0f} MB "
                  f"-> {'PASS' if res['pass'] else 'fail'}", flush=True)
            if res["pass"]:
                best = rate
        print(f"load average at the end: {os.getloadavg()} on {os.cpu_count()} CPUs")
        print(f"highest rate with correct timing (lag p99 <= {a.max_lag_p99_ms} ms, all answered): {best}")
        if a.json:
            Path(a.json).write_text(json.dumps({"cpus": os.cpu_count(), "results": results, "best": best}, indent=2))
        return 0
    finally:
        up.terminate()
        up.wait(10)


if __name__ == "__main__":
    sys.exit(main())
