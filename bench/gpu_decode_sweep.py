#!/usr/bin/env python3
"""Decode step time at every batch size, for several vLLM configurations side by side: does a
shorter CUDA-graph capture list (a start lever) cost decode speed at a batch size it pads?

    python3 bench/gpu_decode_sweep.py --out DIR --model MODEL_DIR [--tokenizer DIR] \\
        --sizes 1-256 --config default= \\
        --config 'levers15=VLLM_USE_MEGA_AOT_ARTIFACT=1 --compilation-config {...}'

vLLM loads every installed general plugin, ours included where the project is installed beside
it: a configuration meant as pristine vLLM says so with `VLLM_PLUGINS=` (e.g. `--config
plain=VLLM_PLUGINS=`); one without it has our patches loaded, as a guarded generation does.

Every configuration is its own plain vLLM server, all up at once on the one GPU (their KV caches
are sized by `--kv-cache-memory-bytes`, so they fit side by side), so each batch size is measured
on every configuration within seconds, in an order that alternates: drift of the box (clocks,
heat) falls on all alike. A batch of b is one request with `n` = b (8 prompt tokens, `--tokens`
output tokens each, `ignore_eos`, temperature 1): vLLM adds its b sequences together, so after
the prefill every decode step runs exactly b. (b separate requests arrive over ~100 ms and
their prefills interleave with the first ones' decode: 9-15 ms at one size.) The figure is vLLM's own mean inter-token latency over the batch (the delta
of `vllm:inter_token_latency_seconds` sum/count on its /metrics, engine-core timestamps: no
client or HTTP time in it); decode tokens/s is b over it. Sizes whose ratio to the first
configuration is off by more than `--recheck` are measured again `--repeats` times and the
median kept. DIR/sweep.json holds every size's step time per configuration and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import split_config  # noqa: E402
from gpu_serving import PY, free_port, wait_http  # noqa: E402

ITL = re.compile(r"^vllm:inter_token_latency_seconds_(sum|count)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def sizes_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return sorted(set(out))


def itl_totals(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = {"sum": 0.0, "count": 0.0}
    for kind, value in ITL.findall(text):
        got[kind] += float(value)
    return got["sum"], got["count"]


def one_request(url: str, model: str, prompt: list[int], tokens: int, n: int) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "n": n,
                       "ignore_eos": True, "temperature": 1.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return int(json.loads(r.read())["usage"]["completion_tokens"])
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None


def batch(url: str, model: str, b: int, tokens: int, seed: int, vocab: int) -> dict[str, float]:
    """One request of b sequences (`n` = b: vLLM adds them to the batch together, so every decode
    step after the prefill runs exactly b); vLLM's mean inter-token latency over them (seconds)."""
    s0, c0 = itl_totals(url)
    t0 = time.monotonic()
    prompt = [10 + (seed * 7919 + j * 31) % (vocab - 20) for j in range(8)]
    done = one_request(url, model, prompt, tokens, b)
    wall = time.monotonic() - t0
    s1, c1 = itl_totals(url)
    if done != b * tokens or c1 - c0 <= 0:
        raise RuntimeError(f"batch {b}: {done} tokens of {b * tokens}, {c1 - c0} inter-token samples")
    return {"itl_s": (s1 - s0) / (c1 - c0), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--config", action="append", required=True, help="NAME=WORDS (env K=V and vLLM args)")
    p.add_argument("--sizes", default="1-256")
    p.add_argument("--tokens", type=int, default=24, help="output tokens per request")
    p.add_argument("--kv", default="8G", help="--kv-cache-memory-bytes of each server")
    p.add_argument("--recheck", type=float, default=0.01, help="re-measure sizes off by more than this")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this long (a partial sweep)")
    p.add_argument("--recheck-reserve-s", type=float, default=0.0,
                   help="of --budget-s, keep this long for the re-measurements (the first pass stops earlier)")
    a = p.parse_args()
    a.tokenizer = a.tokenizer or a.model
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    vocab = int(json.loads((Path(a.model) / "config.json").read_text())["vocab_size"])
    servers: list[tuple[str, str, subprocess.Popen[bytes], dict[str, Any]]] = []
    try:
        for spec in a.config:
            name, env, extra = split_config(spec)
            port = free_port()
            log = open(root / f"{name}.server.log", "wb")
            proc = subprocess.Popen(
                [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model, "--tokenizer", a.tokenizer,
                 "--port", str(port), "--kv-cache-memory-bytes", a.kv, "--max-model-len", "1024",
                 "--gpu-memory-utilization", "0.3", *extra],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
            servers.append((name, f"http://127.0.0.1:{port}", proc, {"env": env, "vllm_args": extra}))
        for name, url, proc, info in servers:
            info["up_s"] = round(wait_http(url + "/health", a.start_timeout, proc), 1)
        sizes = sizes_of(a.sizes)
        results: dict[str, Any] = {name: {**info, "itl_ms": {}} for name, _, _, info in servers}
        for name, url, _, _ in servers:  # warm-up: the first batches after a start are not steady
            for b in (1, max(sizes)):
                batch(url, a.model, b, a.tokens, seed=0, vocab=vocab)

        def measure(b: int, rnd: int) -> None:
            order = servers if (b + rnd) % 2 == 0 else servers[::-1]
            for name, url, _, _ in order:
                r = batch(url, a.model, b, a.tokens, seed=b * 10 + rnd, vocab=vocab)
                results[name]["itl_ms"].setdefault(str(b), []).append(round(r["itl_s"] * 1000, 4))

        measured: list[int] = []
        for b in sizes:
            if time.monotonic() - t_begin > a.budget_s - a.recheck_reserve_s:
                break
            measure(b, 0)
            measured.append(b)
        first = servers[0][0]

        def ratio(name: str, b: int) -> float:
            mine = statistics.median(results[name]["itl_ms"][str(b)])
            base = statistics.median(results[first]["itl_ms"][str(b)])
            return base / mine  # decode speed relative to the first configuration

        for b in measured:
            if time.monotonic() - t_begin > a.budget_s:
                break
            if any(abs(ratio(n, b) - 1) > a.recheck for n, _, _, _ in servers[1:]):
                for rnd in range(1, a.repeats + 1):
                    measure(b, rnd)
        for name, _, _, _ in servers:
            r = results[name]
            r["speed_ratio"] = {str(b): round(ratio(name, b), 4) for b in measured}
            worst = min(r["speed_ratio"].items(), key=lambda kv: kv[1])
            r["worst"] = {"batch": int(worst[0]), "speed_ratio": worst[1]}
            r["sizes_below_0.99"] = [int(b) for b, v in r["speed_ratio"].items() if v < 0.99]
        results["_meta"] = {"sizes_measured": len(measured), "tokens": a.tokens, "kv": a.kv,
                            "seconds": round(time.monotonic() - t_begin, 1)}
        (root / "sweep.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({n: {k: results[n][k] for k in ("up_s", "worst", "sizes_below_0.99")}
                          for n, _, _, _ in servers}), flush=True)
        return 0
    finally:
        for _, _, proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for _, _, proc, _ in servers:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
