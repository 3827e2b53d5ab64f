#!/usr/bin/env python3
"""The weight holder across many recycles: its memory stays one copy while each recycle gives back
an injected per-request leak.

    python bench/holder_flat.py [--model DIR] [--recycles 20] [--requests 20] [--leak-mb 4]
        [--out F] [-- VLLM_ARGS...]

Starts `vllm-guard serve --hold-weights on` with `[inject] device_leak_mb_per_request` (GPU
memory on a GPU, host memory on vLLM-CPU), then per generation: `--requests` completions, the
memory of the generation (its process tree: NVML per process on a GPU, USS on the host) and of
the holder, then `vllm-guard recycle`. At the end the per-generation table, the holder's spread
(max - min) over all recycles, each generation's growth (the leak it took with it) and where
each generation's weights came from (the ledger). Without --model the embedded tiny model is
built in a temp dir (logic; size-dependent figures need the 7B shape on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

PY = sys.executable
GUARD = [PY, "-m", "vllm_guard.cli"]
CPU_ARGS = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16"]


def status(state: Path) -> dict[str, Any]:
    r = subprocess.run([*GUARD, "status", "--state-dir", str(state), "--json"], capture_output=True, text=True, timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def wait(state: Path, pred: Any, timeout: float, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"guard exited {proc.returncode}")
        st = status(state)
        if st and pred(st):
            return st
        time.sleep(0.5)
    raise TimeoutError("condition not reached")


def tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return []


def gpu_mb() -> dict[int, float] | None:
    """NVML's memory per process (MiB), or None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: the host numbers are the figures
        return None
    out: dict[int, float] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            out[p.pid] = out.get(p.pid, 0.0) + (p.usedGpuMemory or 0) / 2**20
    return out


def host_mb(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().uss / 2**20
        except psutil.Error:
            pass
    return total


def reading(pids: list[int]) -> dict[str, float | None]:
    g = gpu_mb()
    return {"host_mb": round(host_mb(pids), 1),
            "gpu_mb": None if g is None else round(sum(g.get(p, 0.0) for p in pids), 1)}


def complete(url: str, model: str, n: int) -> int:
    ok = 0
    with httpx.Client(timeout=300) as c:
        for i in range(n):
            r = c.post(url + "/v1/completions", json={"model": model, "prompt": f"count {i}", "max_tokens": 8,
                                                      "temperature": 0})
            ok += r.status_code == 200
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--recycles", type=int, default=20)
    p.add_argument("--requests", type=int, default=20, help="completions per generation")
    p.add_argument("--leak-mb", type=float, default=4.0, help="[inject] device_leak_mb_per_request")
    p.add_argument("--out", default=None)
    p.add_argument("--state-dir", default=None)
    p.add_argument("vllm_args", nargs="*")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="holder-flat-"))
    model = a.model
    if model is None:
        model = str(tmp / "tiny")
        subprocess.run([*GUARD, "model", "tiny", model], check=True, capture_output=True)
    state = Path(a.state_dir) if a.state_dir else tmp / "state"
    state.mkdir(parents=True, exist_ok=True)
    cfg = state / "guard.toml"
    cfg.write_text(f"[inject]\ndevice_leak_mb_per_request = {a.leak_mb}\n"
                   "[watchdog]\nprometheus_port = 0\n[server]\nmetrics_port = 0\n")
    port = int(subprocess.run([PY, "-c", "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"],
                              capture_output=True, text=True).stdout)
    url = f"http://127.0.0.1:{port}"
    vargs = a.vllm_args or ([] if gpu_mb() else CPU_ARGS)
    if a.tokenizer:
        vargs = ["--tokenizer", a.tokenizer, *vargs]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log = open(state / "server.log", "wb")
    proc = subprocess.Popen([*GUARD, "serve", "--config", str(cfg), "--model", model, "--port", str(port), "--state-dir",
                             str(state), "--hold-weights", "on", "--probe-interval", "60s", "--", *vargs],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    rows: list[dict[str, Any]] = []
    try:
        for n in range(1, a.recycles + 2):
            st = wait(state, lambda s: s["state"] == "serving" and s["generation"] >= n
                      and s["replicas"][0]["weights_source"] is not None, 1800, proc)
            r = st["replicas"][0]
            gen_pids = tree(r["pid"])
            holder = r["holder"] or {}
            at_ready = reading(gen_pids)
            ok = complete(url, model, a.requests)
            time.sleep(1.0)
            at_end = reading(gen_pids)
            hold = reading([holder["pid"]]) if holder.get("pid") else {}
            row = {"generation": st["generation"], "source": r["weights_source"], "completed": ok,
                   "holder_pid": holder.get("pid"), "holder_state": holder.get("state"),
                   "holder_bytes": holder.get("bytes"), "holder_host_mb": hold.get("host_mb"),
                   "holder_gpu_mb": hold.get("gpu_mb"), "gen_at_ready": at_ready, "gen_at_end": at_end}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if n <= a.recycles:
                subprocess.run([*GUARD, "recycle", "--state-dir", str(state), "--reason", "holder-flat"],
                               check=True, capture_output=True, timeout=60)
                wait(state, lambda s: s["generation"] > n, 1800, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    with sqlite3.connect(state / "ledger.sqlite") as c:
        ledger = [dict(zip(("generation", "weights_source", "strategy"), r)) for r in
                  c.execute("SELECT generation, weights_source, strategy FROM generations ORDER BY generation")]
        downtimes = [r[0] for r in c.execute("SELECT downtime_s FROM recycles WHERE downtime_s IS NOT NULL ORDER BY id")]
    key = "holder_gpu_mb" if rows and rows[0]["holder_gpu_mb"] is not None else "holder_host_mb"
    holder_vals = [r[key] for r in rows[1:] if r[key] is not None]
    gkey = "gpu_mb" if rows and rows[0]["gen_at_end"]["gpu_mb"] is not None else "host_mb"
    growth = [round(r["gen_at_end"][gkey] - r["gen_at_ready"][gkey], 1) for r in rows]
    summary = {
        "recycles": len(rows) - 1, "sources": [r["source"] for r in rows], "ledger": ledger,
        "holder_pids": sorted({r["holder_pid"] for r in rows if r["holder_pid"]}),
        "holder_measure": key, "holder_min": min(holder_vals, default=None), "holder_max": max(holder_vals, default=None),
        "holder_spread": round(max(holder_vals) - min(holder_vals), 1) if holder_vals else None,
        "generation_measure": gkey, "growth_per_generation": growth,
        "generation_at_ready": [r["gen_at_ready"][gkey] for r in rows],
        "downtime_s": downtimes, "completed": sum(r["completed"] for r in rows),
        "asked": a.requests * len(rows), "rows": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
