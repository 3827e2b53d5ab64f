"""`vllm-guard demo`: the product in two minutes on the embedded tiny model.

Serves the tiny model under the guard, drives concurrent streaming load through the proxy while
the guard recycles on `max_requests`, forces one more graceful recycle through the admin socket
mid-load, and prints the runtime's status. Every stream is checked: none may fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from . import admin
from .backend import free_port


async def _stream(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> tuple[bool, str]:
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, done, error = None, False, False
    async with session.post(url + "/v1/completions", json=body) as r:
        gen = r.headers.get("X-Vllm-Guard-Generation", "?")
        if r.status != 200:
            return False, gen
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                error = error or "error" in event
                if event.get("usage"):  # vLLM may merge deltas into fewer chunks: count tokens
                    tokens = event["usage"]["completion_tokens"]
    return done and not error and tokens == max_tokens, gen


async def _load(url: str, model: str, total: int, concurrency: int, state_dir: Path) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    per_gen: dict[str, int] = {}
    failed = 0
    forced = False
    done = 0

    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            nonlocal failed, done, forced
            async with sem:
                ok, gen = await _stream(session, url, model, 16)
            done += 1
            per_gen[gen] = per_gen.get(gen, 0) + 1
            failed += not ok
            print(f"\r  streamed {done}/{total}  failed {failed}  generations {sorted(per_gen)}",
                  end="", flush=True)
            if done == total // 2 and not forced:
                forced = True
                await admin.request(state_dir, "POST", "/recycle", {"reason": "demo: forced by operator"})
                print("\n  -> forced a graceful recycle through the admin socket", flush=True)

        await asyncio.gather(*(one() for _ in range(total)))
    print()
    return {"per_generation": per_gen, "failed": failed}


def run_demo(state_dir: str | None, port: int | None, total: int) -> int:
    own_state = state_dir is None
    sd = Path(state_dir or tempfile.mkdtemp(prefix="vllm-guard-demo-"))
    port = port or free_port()
    env = {**os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log_path = sd / "guard.log"
    sd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vllm_guard.runtime", "serve", "--port", str(port), "--state-dir", str(sd),
           "--max-requests", str(max(total // 3, 4)), "--max-requests-jitter", "2",
           "--", "--enforce-eager", "--max-model-len", "512"]
    print(f"vllm-guard demo: serving the embedded tiny model (random weights: its text is noise)\n"
          f"  state dir {sd}, proxy http://127.0.0.1:{port}, runtime log {log_path}")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        status = _wait_serving(proc, sd, 600)
        print(f"  generation 1 ready (vLLM {status['vllm_version']}); children "
              + ", ".join(f"{c['role']}={c['pid']}" for c in status["children"]))
        t0 = time.monotonic()
        result = asyncio.run(_load(f"http://127.0.0.1:{port}", status["model"], total, 4, sd))
        status = _wait_serving(proc, sd, 600)
        print(f"  {total} streams in {time.monotonic() - t0:.0f}s, failed: {result['failed']}, "
              f"served per generation: {json.dumps(result['per_generation'], sort_keys=True)}\n")
        from .cli import format_status

        print(format_status(status))
        return 0 if result["failed"] == 0 and status["failed_requests"] == 0 else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if own_state and proc.returncode == 0:
            shutil.rmtree(sd, ignore_errors=True)


def _wait_serving(proc: subprocess.Popen[bytes], sd: Path, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"vllm-guard serve exited with {proc.returncode}; see {sd / 'guard.log'}")
        try:
            st = asyncio.run(admin.request(sd, "GET", "/status"))
            if st["state"] == "serving":
                return st
        except admin.AdminError:
            pass
        time.sleep(1)
    raise SystemExit(f"not serving after {timeout:.0f}s; see {sd / 'guard.log'}")
