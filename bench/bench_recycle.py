#!/usr/bin/env python3
"""Recycle downtime beside cold start, and failed requests across recycles (target 0).

    python bench/bench_recycle.py [--model DIR] [--recycles 3] [--concurrency 4] [--out F]
        [-- VLLM_ARGS...]

Starts `vllm-guard serve`, keeps a closed-loop streaming load running, forces `--recycles`
graceful recycles through the admin socket, then reads the ledger. Per recycle:
  - drain -> ready: the runtime's own `duration_s` (drain start to the next generation ready);
  - client-seen downtime: recycle start to the first byte of the first response served by the
    next generation (what a client waiting in the proxy's queue experiences);
  - cold start of that generation (spawn to ready) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from loadclient import RunResult, one_request  # noqa: E402

from vllm_guard.runtime.servers import admin
from vllm_guard.runtime.child.backend import free_port
from vllm_guard.core.timefmt import parse_iso  # noqa: E402


def status(sd: Path) -> dict:
    return asyncio.run(admin.request(sd, "GET", "/status"))


def wait_serving(sd: Path, gen: int, proc: subprocess.Popen, timeout: float = 900) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"guard exited {proc.returncode}")
        try:
            st = status(sd)
            if st["state"] == "serving" and st["generation"] >= gen:
                return st
        except admin.AdminError:
            pass
        time.sleep(0.5)
    raise SystemExit("timeout waiting for serving")


async def load_and_recycle(url: str, model: str, sd: Path, recycles: int, conc: int, max_tokens: int) -> RunResult:
    res = RunResult(label="guarded")
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def worker() -> None:
            while not stop.is_set():
                await one_request(s, url, body, res)

        async def driver() -> None:
            for i in range(recycles):
                await asyncio.sleep(5)
                st = await admin.request(sd, "GET", "/status")
                gen = st["generation"]
                await admin.request(sd, "POST", "/recycle", {"reason": f"bench-{i + 1}"})
                while True:
                    await asyncio.sleep(0.5)
                    st = await admin.request(sd, "GET", "/status")
                    if st["state"] == "serving" and st["generation"] > gen and str(gen + 1) in res.first_by_generation:
                        break
            await asyncio.sleep(3)
            stop.set()

        t0 = time.perf_counter()
        await asyncio.gather(driver(), *(worker() for _ in range(conc)))
        res.wall_s = time.perf_counter() - t0
    return res


def main() -> None:
    argv = sys.argv[1:]
    vllm_args = ["--enforce-eager", "--max-model-len", "512"]
    if "--" in argv:
        i = argv.index("--")
        argv, vllm_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--recycles", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sd = Path(tempfile.mkdtemp(prefix="bench-recycle-"))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "vllm_guard.cli", "serve", "--port", str(port), "--state-dir", str(sd),
           *(["--model", a.model] if a.model else []), "--", *vllm_args]
    with open(sd / "guard.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        st = wait_serving(sd, 1, proc)
        res = asyncio.run(load_and_recycle(f"http://127.0.0.1:{port}", st["model"], sd, a.recycles,
                                           a.concurrency, a.max_tokens))
        st = status(sd)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    db = sqlite3.connect(sd / "ledger.sqlite")
    gens = {g: (parse_iso(s), parse_iso(r)) for g, s, r in db.execute(
        "SELECT generation, started_at, ready_at FROM generations WHERE ready_at IS NOT NULL")}
    rows = []
    for gen, started, duration in db.execute("SELECT generation, started_at, duration_s FROM recycles ORDER BY id"):
        nxt = str(gen + 1)
        first = res.first_by_generation.get(nxt)
        t_start = parse_iso(started).timestamp()
        cold = gens.get(gen + 1)
        rows.append({"generation": gen, "drain_to_ready_s": duration,
                     "client_downtime_s": round(first - t_start, 3) if first else None,
                     "cold_start_s": round((cold[1] - cold[0]).total_seconds(), 3) if cold else None})
    first_cold = gens.get(1)
    out = {"recycles": rows, "requests": res.requests, "failed_requests": res.failed,
           "guard_failed_requests": st["failed_requests"], "first_cold_start_s":
           round((first_cold[1] - first_cold[0]).total_seconds(), 3) if first_cold else None,
           "vllm": st["vllm_version"], "gpu": st.get("gpu_name"), "cpu_count": os.cpu_count(),
           "concurrency": a.concurrency, "vllm_args": vllm_args}
    print(json.dumps(out, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
