#!/usr/bin/env python3
"""Proxy overhead: direct vs guarded, interleaved rounds in one run, paired differences.

    python bench/bench_proxy.py synthetic [--rounds 8] [--requests 400] [--concurrency 16]
    python bench/bench_proxy.py guard --state-dir D [--model NAME] ...   # a running vllm-guard
    python bench/bench_proxy.py guard [-- VLLM_ARGS]   # spawns a guarded tiny model itself

`synthetic` isolates the proxy: a fast SSE upstream (aiohttp, no model) in one process, the real
`vllm_guard.runtime.proxy.Proxy` in another, the client in a third. `guard` compares the vLLM
backend URL (from the runtime's status) with the guard's public port on a live server.
Each round runs direct then guarded (order alternating); the figures are per-round paired
differences (TTFT p50/p99 added) and throughput ratios, with 95 % t intervals over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the synthetic upstream and the standalone proxy (each runs as its own process) -----------
def serve_upstream(port: int, chunks: int) -> None:
    from aiohttp import web

    payload = [b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'] * chunks

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in payload:
            await resp.write(p)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_proxy(port: int, upstream: str) -> None:
    from vllm_guard.core import logsetup
    from vllm_guard.core.config import ServerConfig
    from vllm_guard.runtime.proxy import Proxy, Target

    logsetup.configure("info")  # as `serve` does: JSON access events, one per request

    async def main() -> None:
        cfg = ServerConfig(port=port, access_log=os.environ.get("BENCH_ACCESS_LOG", "1") == "1")
        proxy = Proxy(cfg, on_limit=lambda t: None, on_error=lambda t: None)
        target = Target(generation=1, url=upstream)
        target.open(600)
        await proxy.start()
        await proxy.set_target(target)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def wait_port(port: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port}")


# -- measurement --------------------------------------------------------------------------------
def client(url: str, model: str, total: int, conc: int, max_tokens: int, label: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "loadclient.py"), url, model, str(total), str(conc),
                          str(max_tokens), label], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def summarize_round(r: dict) -> dict:
    ttft = np.array(r["ttft_s"]) * 1000
    return {"p50_ms": float(np.percentile(ttft, 50)), "p99_ms": float(np.percentile(ttft, 99)),
            "req_s": r["requests"] / r["wall_s"], "chunks_s": r["chunks"] / r["wall_s"],
            "failed": r["failed"]}


def _cpu(pid: int | None) -> float:
    if not pid:
        return 0.0
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def interval(xs: list[float]) -> tuple[float, float, float]:
    a = np.asarray(xs)
    m = float(a.mean())
    if len(a) < 2:
        return m, m, m
    h = float(stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)))
    return m, m - h, m + h


def compare(direct_url: str, guarded_url: str, model: str, rounds: int, total: int, conc: int,
            max_tokens: int, proxy_pid: int | None = None) -> dict:
    client(direct_url, model, min(total, 50), conc, max_tokens, "warmup")
    client(guarded_url, model, min(total, 50), conc, max_tokens, "warmup")
    pairs = []
    cpu0 = _cpu(proxy_pid)
    for i in range(rounds):
        order = [("direct", direct_url), ("guarded", guarded_url)]
        if i % 2:
            order.reverse()
        got = {label: summarize_round(client(url, model, total, conc, max_tokens, label)) for label, url in order}
        pairs.append(got)
        print(f"round {i + 1}/{rounds}: " + "  ".join(
            f"{k} p50 {v['p50_ms']:.2f} ms p99 {v['p99_ms']:.2f} ms {v['req_s']:.0f} req/s"
            for k, v in got.items()), file=sys.stderr)
    cpu_s = _cpu(proxy_pid) - cpu0 if proxy_pid else None
    d50 = interval([p["guarded"]["p50_ms"] - p["direct"]["p50_ms"] for p in pairs])
    d99 = interval([p["guarded"]["p99_ms"] - p["direct"]["p99_ms"] for p in pairs])
    ratio = interval([p["guarded"]["chunks_s"] / p["direct"]["chunks_s"] for p in pairs])
    return {
        "rounds": rounds, "requests_per_round": total, "concurrency": conc, "max_tokens": max_tokens,
        "direct_p50_ms": interval([p["direct"]["p50_ms"] for p in pairs])[0],
        "direct_p99_ms": interval([p["direct"]["p99_ms"] for p in pairs])[0],
        "added_ttft_p50_ms": {"mean": d50[0], "ci95": [d50[1], d50[2]]},
        "added_ttft_p99_ms": {"mean": d99[0], "ci95": [d99[1], d99[2]]},
        "throughput_ratio": {"mean": ratio[0], "ci95": [ratio[1], ratio[2]]},
        "failed": sum(p[k]["failed"] for p in pairs for k in p),
        # CPU the proxy process spent per proxied request (user+sys, all rounds): robust to noise
        "proxy_cpu_us_per_request": round(1e6 * cpu_s / (rounds * total), 1) if cpu_s is not None else None,
        "cpu_count": os.cpu_count(),
    }


def spawn_guard(vllm_args: list[str]) -> tuple[subprocess.Popen, str]:
    """A guarded tiny-model server of our own (when no --state-dir is given)."""
    import tempfile

    from vllm_guard.runtime import admin

    sd = tempfile.mkdtemp(prefix="bench-proxy-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "vllm_guard.cli", "serve", "--port", str(free_port()), "--state-dir", sd,
           "--probe-interval", "60s", "--", *(vllm_args or ["--enforce-eager", "--max-model-len", "512"])]
    proc = subprocess.Popen(cmd, stdout=open(Path(sd) / "guard.log", "ab"), stderr=subprocess.STDOUT, env=env)
    end = time.monotonic() + 900
    while time.monotonic() < end and proc.poll() is None:
        try:
            if asyncio.run(admin.request(sd, "GET", "/status"))["state"] == "serving":
                return proc, sd
        except admin.AdminError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"guard did not serve; see {sd}/guard.log")


def main() -> None:
    argv = sys.argv[1:]
    vllm_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, vllm_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["synthetic", "guard", "_upstream", "_proxy"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--state-dir")
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int)
    ap.add_argument("--upstream")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.vllm_args = vllm_args
    if a.mode == "_upstream":
        return serve_upstream(a.port, a.max_tokens)
    if a.mode == "_proxy":
        return serve_proxy(a.port, a.upstream)
    if a.mode == "synthetic":
        up, px = free_port(), free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "_upstream", "--port", str(up),
                                   "--max-tokens", str(a.max_tokens)]),
                 subprocess.Popen([sys.executable, __file__, "_proxy", "--port", str(px),
                                   "--upstream", f"http://127.0.0.1:{up}"], stderr=subprocess.DEVNULL)]
        try:
            wait_port(up)
            wait_port(px)
            res = compare(f"http://127.0.0.1:{up}", f"http://127.0.0.1:{px}", "synthetic", a.rounds,
                          a.requests, a.concurrency, a.max_tokens, proxy_pid=procs[1].pid)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
        res["upstream"] = "synthetic SSE (aiohttp, no model)"
    else:
        from vllm_guard.runtime import admin

        guard = None if a.state_dir else spawn_guard(a.vllm_args)
        sd = a.state_dir or guard[1]
        try:
            st = asyncio.run(admin.request(sd, "GET", "/status"))
            res = compare(st["backend_url"], f"http://127.0.0.1:{st['port']}", a.model or st["model"],
                          a.rounds, a.requests, a.concurrency, a.max_tokens, proxy_pid=st["pid"])
        finally:
            if guard is not None:
                guard[0].terminate()
                guard[0].wait(300)
        res["upstream"] = f"vLLM {st['vllm_version']} ({st.get('gpu_name') or 'CPU'}), model {st['model']}"
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
