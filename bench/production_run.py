#!/usr/bin/env python3
"""A production-style run: the README's own commands under traffic that is not the guard's soak.

`vllm-guard serve` (request-count recycling off; a preventive recycle when the tree's host RSS has
grown `--growth-mb` past its warm-up baseline) with `vllm-guard watchdog` beside it, both from one
guard.toml whose `[inject] host_leak_mb_per_request` makes EngineCore leak slowly (the leak that
forces those recycles); traffic from the OpenAI Python client (installed with vLLM) at a steady
open-loop rate (Poisson arrivals, each request sent on schedule whatever the ones before it do):
streamed completions with and without `stream_options.include_usage` and plain ones, prompts and
lengths varied. Then SIGTERM to both, and `vllm-guard report` on the ledger (text, JSON, HTML)
with the example price file. Nothing of the soak runs: the report answers from what the runtime
recorded of this traffic (and the watchdog's samples).

    flock /tmp/vllm-guard-cpu.lock .venv/bin/python bench/production_run.py \\
        [--duration 2h] [--rate 2] [--leak-mb 0.08] [--growth-mb 200] [--model DIR] \\
        [--out docs/results/production-run] [--state-dir DIR] [--vllm-args "..."]

Writes to `--out`: `guard.toml`, `report.{txt,json,html}`, `client.jsonl` (one line per request:
the client's own view), `summary.json` (what was sent, what the client saw, the recycles by
trigger and class from the ledger, the report's verdict lines) and the guard's and watchdog's
logs; the ledger stays in `--state-dir` (default: a new temporary dir, printed). A 2-hour run at
the defaults (2 req/s, 0.08 MB per request: ~575 MB/h) recycles about every 20 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymodel import GUARD, tiny_model  # noqa: E402

CPU_VLLM_ARGS = "--enforce-eager --max-model-len 512 --max-num-seqs 16"
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = ("the guard keeps serving while a new engine starts and the old one drains its requests to the end "
         "memory grows a little with every request until the runtime recycles the process").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip()
    return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)


def guard_toml(path: Path, a: argparse.Namespace, port: int, metrics_port: int, prom_port: int) -> None:
    path.write_text(
        "[server]\n"
        f"port = {port}\n"
        f"metrics_port = {metrics_port}\n"
        "access_log = false\n"
        "[recycle]\n"
        f"max_host_rss_growth_mb = {a.growth_mb}\n"
        'memory_interval = "5s"\n'
        "[inject]\n"
        f"host_leak_mb_per_request = {a.leak_mb}\n"
        "[watchdog]\n"
        'interval = "2s"\n'
        'kernel = "off"\n'
        f"prometheus_port = {prom_port}\n")


def status(state: Path) -> dict[str, Any]:
    out = subprocess.run([*GUARD, "status", "--state-dir", str(state), "--json"], capture_output=True, text=True,
                         timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_serving(state: Path, guard: subprocess.Popen[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if guard.poll() is not None:
            raise RuntimeError(f"vllm-guard serve exited with {guard.returncode} before serving")
        if status(state).get("state") == "serving":
            return
        time.sleep(2.0)
    raise TimeoutError("vllm-guard serve: not serving in time")


async def traffic(url: str, rate: float, seconds: float, log: Path, seed: int) -> dict[str, Any]:
    """Open loop: request i is sent at its scheduled time (Poisson), on its own task."""
    import httpx
    from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

    rng = random.Random(seed)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600.0,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600.0))
    model = (await client.models.list()).data[0].id
    counts = {"sent": 0, "ok": 0, "failed": 0}
    out = log.open("w")

    async def one(i: int, sched: float) -> None:
        words = rng.randint(8, 60)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        kind = ("stream_usage", "stream_usage", "stream", "plain")[i % 4]
        max_tokens = rng.randint(8, 48)
        t0 = time.monotonic()
        rec: dict[str, Any] = {"i": i, "kind": kind, "sched_delay_s": round(t0 - sched, 4)}
        try:
            if kind == "plain":
                r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
                rec["ttft_s"] = rec["e2e_s"] = round(time.monotonic() - t0, 4)
                rec["completion_tokens"] = r.usage.completion_tokens if r.usage else None
            else:
                extra = {"stream_options": {"include_usage": True}} if kind == "stream_usage" else {}
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                         stream=True, **extra)
                first = None
                async for chunk in stream:
                    if first is None and chunk.choices:
                        first = time.monotonic() - t0
                    if chunk.usage is not None:
                        rec["completion_tokens"] = chunk.usage.completion_tokens
                rec["ttft_s"] = None if first is None else round(first, 4)
                rec["e2e_s"] = round(time.monotonic() - t0, 4)
            rec["ok"] = True
            counts["ok"] += 1
        except (APIStatusError, APIConnectionError, APITimeoutError) as e:
            rec.update(ok=False, error=type(e).__name__, status=getattr(e, "status_code", None))
            counts["failed"] += 1
        out.write(json.dumps(rec) + "\n")

    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    at = start
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at - start > seconds:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        task = asyncio.create_task(one(i, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        counts["sent"] += 1
        i += 1
    if tasks:
        await asyncio.wait(tasks, timeout=900)
    out.close()
    await client.close()
    return counts


def ledger_facts(db: Path) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        recycles = [dict(trigger=t, cls=c, n=n) for t, c, n in conn.execute(
            "SELECT trigger, class, COUNT(*) FROM recycles GROUP BY trigger, class")]
        failures = [dict(kind=k, n=n) for k, n in conn.execute("SELECT kind, COUNT(*) FROM failures GROUP BY kind")]
        minutes = conn.execute("SELECT COUNT(*), SUM(requests), SUM(completed), SUM(failed), SUM(completion_tokens) "
                               "FROM edge_minutes").fetchone()
        return {"generations": conn.execute("SELECT COUNT(*) FROM generations").fetchone()[0],
                "recycles": recycles, "failures": failures,
                "edge_minutes": {"rows": minutes[0], "requests": minutes[1], "completed": minutes[2],
                                 "failed": minutes[3], "completion_tokens": minutes[4]},
                "edge_request_rows": conn.execute("SELECT COUNT(*) FROM edge_requests").fetchone()[0],
                "process_memory_rows": conn.execute("SELECT COUNT(*) FROM process_memory").fetchone()[0],
                "watchdog_ticks": conn.execute("SELECT COUNT(DISTINCT at) FROM samples").fetchone()[0],
                "soak_requests": conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]}
    finally:
        conn.close()


def stop(p: subprocess.Popen[bytes], timeout: float = 180.0) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return int(p.returncode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", default="2h", help="traffic time (e.g. 10m, 2h)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, open loop (Poisson)")
    ap.add_argument("--leak-mb", type=float, default=0.08, help="[inject] host_leak_mb_per_request (EngineCore)")
    ap.add_argument("--growth-mb", type=float, default=200.0, help="[recycle] max_host_rss_growth_mb")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny model, built now)")
    ap.add_argument("--vllm-args", default=CPU_VLLM_ARGS)
    ap.add_argument("--out", default="docs/results/production-run")
    ap.add_argument("--state-dir", default=None, help="where the ledger goes (default: a new temporary dir)")
    ap.add_argument("--prices", default="docs/examples/prices-field-report.toml")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model = tiny_model(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    state = Path(a.state_dir or tempfile.mkdtemp(prefix="vllm-guard-production-"))
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = out / "guard.toml"
    guard_toml(cfg, a, port, free_port(), free_port())
    env = {**os.environ, **CHILD_ENV}
    glog, wlog = open(out / "guard.log", "ab"), open(out / "watchdog.log", "ab")  # noqa: SIM115
    t_start = time.time()
    guard = subprocess.Popen([*GUARD, "serve", "--config", str(cfg), "--state-dir", str(state), "--model", model,
                              "--", *a.vllm_args.split()], stdout=glog, stderr=subprocess.STDOUT, env=env)
    procs = [guard]
    counts: dict[str, Any] = {}
    try:
        wait_serving(state, guard, 900)
        procs.append(subprocess.Popen([*GUARD, "watchdog", "--config", str(cfg), "--state-dir", str(state)],
                                      stdout=wlog, stderr=subprocess.STDOUT, env=env))
        print(f"serving on :{port}, state {state}; traffic for {a.duration} at {a.rate} req/s", flush=True)
        counts = asyncio.run(traffic(f"http://127.0.0.1:{port}", a.rate, duration_s(a.duration),
                                     out / "client.jsonl", a.seed))
        print(f"client: {counts}", flush=True)
    finally:
        codes = {"watchdog": stop(procs[1]) if len(procs) > 1 else None, "serve": stop(guard)}
        glog.close()
        wlog.close()
    prices = ["--prices", a.prices] if a.prices and Path(a.prices).exists() else []
    for fmt, ext in (("text", "txt"), ("json", "json"), ("html", "html")):
        subprocess.run([*GUARD, "report", "--db", str(state), "--format", fmt, "--out", str(out / f"report.{ext}"),
                        *prices], check=True)
    report = json.loads((out / "report.json").read_text())
    summary = {"started": t_start, "wall_s": round(time.time() - t_start, 1), "args": vars(a), "model": model,
               "state_dir": str(state), "exit_codes": codes, "client": counts,
               "ledger": ledger_facts(state / "ledger.sqlite"), "verdict": report["summary"]["lines"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(report["summary"]["lines"]))
    print(f"ledger in {state}; reports in {out}")
    return 0 if codes["serve"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
