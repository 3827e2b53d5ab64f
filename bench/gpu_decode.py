#!/usr/bin/env python3
"""Decode speed of plain vLLM with and without a start lever, the way `vllm bench serve` measures
it: output tokens/s at a fixed concurrency (1 and 16 by default), the median of `--runs` runs, each
configuration its own vLLM server in turn on the one GPU. A lever that shortens a start (fewer
CUDA-graph sizes, the mega AOT artifact) must not cost decode speed; this says whether it does.

    python3 bench/gpu_decode.py --out DIR --model MODEL_DIR [--tokenizer DIR] \\
        --config default= --config 'levers=ENV=1 --compilation-config {...}'

vLLM loads every installed general plugin, ours included where the project is installed beside
it: a configuration meant as pristine vLLM says so with `VLLM_PLUGINS=`.

A `--config` is NAME=WORDS: words of the form K=V (K in capitals) go to the server's environment,
the rest are vLLM arguments after the shared ones (gpu_serving.py's GPU_ARGS). DIR/decode.json has
each configuration's start time and, per concurrency, every run's output tok/s and the median;
`ratio` is each configuration's median over the first configuration's.
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_serving import GPU_ARGS, PY, VLLM_BENCH, free_port, wait_http  # noqa: E402

ENV_WORD = re.compile(r"^[A-Z][A-Z0-9_]*=")


def split_config(spec: str) -> tuple[str, dict[str, str], list[str]]:
    name, _, words = spec.partition("=")
    if not name:
        raise SystemExit(f"--config {spec!r}: NAME=WORDS")
    env, args = {}, []
    for w in words.split():
        if ENV_WORD.match(w):
            k, _, v = w.partition("=")
            env[k] = v
        else:
            args.append(w)
    return name, env, args


def bench_once(url: str, a: argparse.Namespace, conc: int, out: Path, tag: str) -> float:
    res_name = f"{tag}.json"
    cmd = [PY, "-c", VLLM_BENCH, "--base-url", url, "--model", a.model, "--tokenizer", a.tokenizer,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(max(conc * a.waves, 4)),
           "--max-concurrency", str(conc), "--request-rate", "inf", "--seed", "0", "--ignore-eos",
           "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", res_name]
    with open(out / f"{tag}.log", "wb") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench exited {r.returncode}; see {out / (tag + '.log')}")
    return float(json.loads((out / res_name).read_text())["output_throughput"])


def run_config(spec: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    name, env, extra = split_config(spec)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(out / "server.log", "wb") as log:
        proc = subprocess.Popen([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model, "--tokenizer",
                                 a.tokenizer, "--port", str(port), *GPU_ARGS, *extra],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            start_s = wait_http(url + "/health", a.start_timeout, proc)
            bench_once(url, a, 1, out, "warmup")  # first requests after a start are not steady
            result: dict[str, Any] = {"env": env, "vllm_args": extra, "start_s": round(start_s, 1)}
            for conc in a.concurrency:
                runs = [round(bench_once(url, a, conc, out, f"c{conc}-{i}"), 1) for i in range(a.runs)]
                result[f"c{conc}"] = {"runs": runs, "median_tok_s": statistics.median(runs)}
            return result
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--config", action="append", required=True, help="NAME=WORDS (env K=V and vLLM args)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--waves", type=int, default=4, help="prompts per run = concurrency x waves")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--start-timeout", type=float, default=600.0)
    a = p.parse_args()
    a.tokenizer = a.tokenizer or a.model
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for spec in a.config:
        name = spec.partition("=")[0]
        try:
            results[name] = run_config(spec, a, root)
        except Exception as e:  # noqa: BLE001 - one configuration's failure is recorded, the others run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        first = next(iter(results.values()))
        for r in results.values():
            for conc in a.concurrency:
                k = f"c{conc}"
                if k in r and k in first:
                    r[k]["ratio"] = round(r[k]["median_tok_s"] / first[k]["median_tok_s"], 4)
        (root / "decode.json").write_text(json.dumps(results, indent=2))
        print(json.dumps({name: results[name]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
