#!/usr/bin/env python3
"""Proxy overhead: direct vs guarded, interleaved rounds in one run, paired differences.

    python bench/bench_proxy.py synthetic [--rounds 8] [--requests 400] [--concurrency 16]
    python bench/bench_proxy.py synthetic --record [--baseline PYTHON:SCRIPT]   # the ledger's cost
    python bench/bench_proxy.py guard --state-dir D [--model NAME] ...   # a running vllm-guard
    python bench/bench_proxy.py guard [-- VLLM_ARGS]   # spawns a guarded tiny model itself
    python bench/bench_proxy.py resume --model-dir TINY [--rounds 8] [--requests 400] [--max-tokens 64]

`synthetic` isolates the proxy: a fast SSE upstream (aiohttp, no model) in one process, the real
`vllm_guard.runtime.frontdoor.proxy.Proxy` in another, the client in a third. `guard` compares the vLLM
backend URL (from the runtime's status) with the guard's public port on a live server.
Each round runs direct then guarded (order alternating); the figures are per-round paired
differences (TTFT p50/p99 added) and throughput ratios, with 95 % t intervals over rounds.

`resume` prices the resumable-stream path (the proxy parses every event, keeps the token ids,
follows the detokenization, re-encodes the event): one synthetic upstream in vLLM's chunk format
(token ids when asked for, as vLLM does), two proxies in front of it — one as today (no
tokenizer: streams pass through untouched), one resuming (the embedded model's tokenizer) —
the same load through both, alternating. The figure is each proxy's CPU time per chunk and
their difference, with a 95 % t interval over rounds.

`--record` attaches what `serve` attaches to its proxy: the runtime ledger (a temporary state dir)
and its traffic recorder (a row per request, per-minute histograms, through the writer thread,
whose CPU counts in the proxy's process), and the upstream ends each stream with vLLM's usage
record, which the proxy reads. `--baseline PYTHON:SCRIPT` runs a second proxy from another
checkout (e.g. `/work/main/.venv/bin/python:/work/main/bench/bench_proxy.py`) in the same rounds,
so the cost per request of the two is compared pairwise (CPU microseconds per request and TTFT).
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
    usage = (b'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"synthetic","choices":[],'
             b'"usage":{"prompt_tokens":16,"total_tokens":%d,"completion_tokens":%d}}\n\n' % (16 + chunks, chunks))

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for p in payload:
            await resp.write(p)
        await resp.write(usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_vllm_upstream(port: int, chunks: int, model_dir: str) -> None:
    """The synthetic upstream in vLLM 0.32's chunk format: token ids when asked for."""
    from aiohttp import web
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    the = tok.token_to_id("Ġthe")
    prompt = tok.encode("hello world", add_special_tokens=False).ids

    def chunk(i: int, ids: bool) -> bytes:
        choice = {"index": 0, "text": " the", "logprobs": None, "finish_reason": "length" if i == chunks - 1 else None,
                  "stop_reason": None, "prompt_token_ids": prompt if ids and i == 0 else None,
                  "token_ids": [the] if ids else None}
        obj = {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": "synthetic",
               "choices": [choice]}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    with_ids = [chunk(i, True) for i in range(chunks)]
    without = [chunk(i, False) for i in range(chunks)]

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for p in (with_ids if body.get("return_token_ids") else without):
            await resp.write(p)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_proxy(port: int, upstream: str, model: str = "", record: bool = False) -> None:
    from vllm_guard.core import logsetup
    from vllm_guard.core.config import ServerConfig
    from vllm_guard.runtime.frontdoor.proxy import Proxy
    from vllm_guard.runtime.frontdoor.target import Target

    logsetup.configure("info")  # as `serve` does: JSON access events, one per request

    async def main() -> None:
        cfg = ServerConfig(port=port, model=model, access_log=os.environ.get("BENCH_ACCESS_LOG", "1") == "1")
        proxy = Proxy(cfg, on_limit=lambda t: None, on_error=lambda t: None)
        if record:  # what `serve` attaches (runtime/lifecycle.py): the ledger and its traffic recorder
            import tempfile

            from vllm_guard.core.config import GuardConfig
            from vllm_guard.runtime.records.writer import RuntimeLedger

            RuntimeLedger(tempfile.mkdtemp(prefix="bench-proxy-ledger-")).attach(proxy.listeners, GuardConfig())
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
def client(url: str, model: str, total: int, conc: int, max_tokens: int, label: str,
           extra: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "loadclient.py"), url, model, str(total), str(conc),
                          str(max_tokens), label, *([json.dumps(extra)] if extra else [])],
                         capture_output=True, text=True, check=True)
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


def compare_with_baseline(direct_url: str, arms: dict[str, tuple[str, int]], rounds: int, total: int, conc: int,
                          max_tokens: int) -> dict:
    """Direct and two proxies (`arms`: name -> (url, pid)) in the same rounds, order rotating;
    per round each proxy's CPU per request and TTFT p50 added over direct, then the pairwise
    difference of the two proxies with its 95 % interval."""
    urls = {"direct": direct_url, **{k: u for k, (u, _) in arms.items()}}
    for url in urls.values():
        client(url, "synthetic", min(total, 50), conc, max_tokens, "warmup")
    rows = []
    names = list(urls)
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        got: dict[str, dict] = {}
        for name in order:
            pid = arms[name][1] if name in arms else None
            c0 = _cpu(pid)
            got[name] = summarize_round(client(urls[name], "synthetic", total, conc, max_tokens, name))
            got[name]["cpu_us"] = 1e6 * (_cpu(pid) - c0) / total if pid else None
        rows.append(got)
        print(f"round {i + 1}/{rounds}: " + "  ".join(
            f"{k} p50 {v['p50_ms']:.2f} ms" + (f" cpu {v['cpu_us']:.0f} us/req" if v["cpu_us"] else "")
            for k, v in got.items()), file=sys.stderr)
    a, b = list(arms)
    out: dict = {"rounds": rounds, "requests_per_round": total, "concurrency": conc, "max_tokens": max_tokens,
                 "cpu_count": os.cpu_count(), "failed": sum(r[k]["failed"] for r in rows for k in r)}
    for name in arms:
        cpu = interval([r[name]["cpu_us"] for r in rows])
        add = interval([r[name]["p50_ms"] - r["direct"]["p50_ms"] for r in rows])
        out[name] = {"proxy_cpu_us_per_request": {"mean": cpu[0], "ci95": [cpu[1], cpu[2]]},
                     "added_ttft_p50_ms": {"mean": add[0], "ci95": [add[1], add[2]]}}
    dcpu = interval([r[a]["cpu_us"] - r[b]["cpu_us"] for r in rows])
    dttft = interval([1000 * (r[a]["p50_ms"] - r[b]["p50_ms"]) for r in rows])
    out[f"{a}_minus_{b}"] = {"cpu_us_per_request": {"mean": dcpu[0], "ci95": [dcpu[1], dcpu[2]]},
                             "ttft_p50_us": {"mean": dttft[0], "ci95": [dttft[1], dttft[2]]}}
    return out


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


def compare_resume(plain_url: str, resume_url: str, pids: dict[str, int], rounds: int, total: int, conc: int,
                   max_tokens: int, extra: dict | None = None) -> dict:
    """Proxy CPU per chunk, today's pass-through vs the resumable path, same load, alternating."""
    urls = {"passthrough": plain_url, "resumable": resume_url}
    for url in urls.values():
        client(url, "synthetic", min(total, 50), conc, max_tokens, "warmup", extra)
    per_chunk: dict[str, list[float]] = {k: [] for k in urls}
    ratio = []
    for i in range(rounds):
        order = list(urls) if i % 2 == 0 else list(reversed(urls))
        got = {}
        for label in order:
            cpu0 = _cpu(pids[label])
            got[label] = r = client(urls[label], "synthetic", total, conc, max_tokens, label, extra)
            per_chunk[label].append(1e6 * (_cpu(pids[label]) - cpu0) / max(1, r["chunks"]))
            assert r["failed"] == 0, r
        ratio.append((got["resumable"]["chunks"] / got["resumable"]["wall_s"])
                     / (got["passthrough"]["chunks"] / got["passthrough"]["wall_s"]))
        print(f"round {i + 1}/{rounds}: " + "  ".join(f"{k} {v[-1]:.1f} us/chunk" for k, v in per_chunk.items()),
              file=sys.stderr)
    added = interval([b - a for a, b in zip(per_chunk["passthrough"], per_chunk["resumable"])])
    pt, rs, tr = interval(per_chunk["passthrough"]), interval(per_chunk["resumable"]), interval(ratio)
    return {
        "rounds": rounds, "requests_per_round": total, "concurrency": conc, "chunks_per_request": max_tokens,
        "request_extra": extra or {},
        "passthrough_cpu_us_per_chunk": {"mean": round(pt[0], 2), "ci95": [round(pt[1], 2), round(pt[2], 2)]},
        "resumable_cpu_us_per_chunk": {"mean": round(rs[0], 2), "ci95": [round(rs[1], 2), round(rs[2], 2)]},
        "added_cpu_us_per_chunk": {"mean": round(added[0], 2), "ci95": [round(added[1], 2), round(added[2], 2)]},
        "throughput_ratio": {"mean": round(tr[0], 3), "ci95": [round(tr[1], 3), round(tr[2], 3)]},
        "cpu_count": os.cpu_count(),
    }


def spawn_guard(vllm_args: list[str]) -> tuple[subprocess.Popen, str]:
    """A guarded tiny-model server of our own (when no --state-dir is given)."""
    import tempfile

    from vllm_guard.runtime.servers import admin

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
    ap.add_argument("mode", choices=["synthetic", "guard", "resume", "_upstream", "_vllm_upstream", "_proxy"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--state-dir")
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int)
    ap.add_argument("--upstream")
    ap.add_argument("--model-dir", default="", help="resume: the embedded model (its tokenizer.json)")
    ap.add_argument("--stop", action="append", default=[], help="resume: stop strings in every request")
    ap.add_argument("--out")
    ap.add_argument("--record", action="store_true", help="the proxy records to a runtime ledger, as serve's does")
    ap.add_argument("--baseline", default=None, metavar="PYTHON:SCRIPT",
                    help="a second proxy from another checkout in the same rounds (synthetic)")
    a = ap.parse_args(argv)
    a.vllm_args = vllm_args
    if a.mode == "_upstream":
        return serve_upstream(a.port, a.max_tokens)
    if a.mode == "_vllm_upstream":
        return serve_vllm_upstream(a.port, a.max_tokens, a.model_dir)
    if a.mode == "_proxy":
        return serve_proxy(a.port, a.upstream, a.model_dir, a.record)
    if a.mode == "resume":
        if not (Path(a.model_dir) / "tokenizer.json").is_file():
            raise SystemExit(f"--model-dir {a.model_dir!r} has no tokenizer.json (vllm-guard model tiny DIR)")
        up, plain, res_port = free_port(), free_port(), free_port()
        upstream = f"http://127.0.0.1:{up}"
        procs = {"upstream": subprocess.Popen([sys.executable, __file__, "_vllm_upstream", "--port", str(up),
                                               "--max-tokens", str(a.max_tokens), "--model-dir", a.model_dir]),
                 # no tokenizer where the model dir has none: streams pass through as today
                 "passthrough": subprocess.Popen([sys.executable, __file__, "_proxy", "--port", str(plain),
                                                  "--upstream", upstream, "--model-dir", "/nonexistent"],
                                                 stderr=subprocess.DEVNULL),
                 "resumable": subprocess.Popen([sys.executable, __file__, "_proxy", "--port", str(res_port),
                                                "--upstream", upstream, "--model-dir", a.model_dir],
                                               stderr=subprocess.DEVNULL)}
        try:
            for port in (up, plain, res_port):
                wait_port(port)
            time.sleep(2.0)  # the resuming proxy loads its tokenizer in a thread at start
            res = compare_resume(f"http://127.0.0.1:{plain}", f"http://127.0.0.1:{res_port}",
                                 {k: p.pid for k, p in procs.items()}, a.rounds, a.requests, a.concurrency,
                                 a.max_tokens, {"stop": a.stop} if a.stop else None)
        finally:
            for p in procs.values():
                p.terminate()
                p.wait()
        res["upstream"] = "synthetic SSE in vLLM's chunk format (aiohttp, no model)"
        print(json.dumps(res, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
        return None
    if a.mode == "synthetic" and a.baseline:
        py, script = a.baseline.split(":", 1)
        up, px, bx = free_port(), free_port(), free_port()
        upstream = f"http://127.0.0.1:{up}"
        procs = [subprocess.Popen([sys.executable, __file__, "_upstream", "--port", str(up),
                                   "--max-tokens", str(a.max_tokens)]),
                 subprocess.Popen([sys.executable, __file__, "_proxy", "--port", str(px), "--upstream", upstream,
                                   *(["--record"] if a.record else [])], stderr=subprocess.DEVNULL),
                 subprocess.Popen([py, script, "_proxy", "--port", str(bx), "--upstream", upstream],
                                  stderr=subprocess.DEVNULL)]
        try:
            for port in (up, px, bx):
                wait_port(port)
            res = compare_with_baseline(upstream, {"this": (f"http://127.0.0.1:{px}", procs[1].pid),
                                                   "baseline": (f"http://127.0.0.1:{bx}", procs[2].pid)},
                                        a.rounds, a.requests, a.concurrency, a.max_tokens)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
        res["upstream"] = "synthetic SSE (aiohttp, no model), each stream ending with a usage record"
        res["this"]["recording"], res["baseline"]["source"] = a.record, a.baseline
    elif a.mode == "synthetic":
        up, px = free_port(), free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "_upstream", "--port", str(up),
                                   "--max-tokens", str(a.max_tokens)]),
                 subprocess.Popen([sys.executable, __file__, "_proxy", "--port", str(px),
                                   "--upstream", f"http://127.0.0.1:{up}", *(["--record"] if a.record else [])],
                                  stderr=subprocess.DEVNULL)]
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
        from vllm_guard.runtime.servers import admin

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
