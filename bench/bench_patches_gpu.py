"""The patches plugin on a real GPU (vLLM 0.25.1, one H200): the checks the CPU box cannot make.

For the lead to run on the device (it needs CUDA, NVML and vllm==0.25.1):
    python3 bench/bench_patches_gpu.py --model DIR --out $OUT/patches_gpu.json
It checks and records:
  1. `patches list --json` on the installed vLLM equals docs/patches/vllm-<version>.json;
  2. every vLLM process reports its patch states (one GPU: api_server + engine_core, no worker);
  3. `gpu_memory_budget_gib` set the allocator fraction (injector's `gpu_budget` record);
  4. `device_leak_mb_per_request`: EngineCore's NVML memory slope vs the injected rate;
  5. `block_leak_every`: the audit reclaims exactly the injected block ids;
  6. idle-release ran once after the load with CUDA reserved bytes before/after.
Exit 0 when every check passes, 1 otherwise (the JSON says which).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_patches import GUARD, Server, sequential  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def nvml_used_mb(pid: int) -> float | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return p.usedGpuMemory / 2**20
    finally:
        pynvml.nvmlShutdown()
    return None


def records(srv: Server, name: str, event: str) -> list[dict[str, Any]]:
    """`inject.jsonl` or `events.jsonl` of generation 1, read with the runtime's reader."""
    from vllm_guard.core import plugin as contract

    read = {contract.INJECT: contract.injected, contract.EVENTS: contract.events}[name]
    return [r for r in read(srv.state, 1) if r.get("event") == event]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--leak-mb", type=float, default=0.15)
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    checks: dict[str, Any] = {}

    listed = subprocess.run([*GUARD, "patches", "list", "--json"], capture_output=True, text=True, timeout=120)
    table = json.loads(listed.stdout)
    committed = ROOT / "docs" / "patches" / f"vllm-{table['vllm_version']}.json"
    checks["patches_list_equals_committed"] = committed.exists() and json.loads(committed.read_text()) == table
    checks["patches_list"] = table

    import tempfile

    import bench_patches

    bench_patches.VLLM_ARGS[:] = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                                  "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    root = Path(tempfile.mkdtemp(prefix="bench-patches-gpu-"))
    env = {"VLLM_GUARD_INJECT": f"device_leak_mb_per_request={args.leak_mb},block_leak_every=10,"
                                f"gpu_memory_budget_gib={args.budget_gib}",
           "VLLM_GUARD_PATCHES": "idle_release_after=3"}
    srv = Server("gpu", args.model, env, root)
    try:
        srv.wait_serving()
        time.sleep(5)
        st = srv.status()
        live = {int(p): r for p, r in st.get("patches", {}).items() if r.get("alive")}
        checks["processes"] = {str(p): {"process": r["process"], "patches": r["patches"]} for p, r in live.items()}
        engine = next(p for p, r in live.items() if r["process"] == "engine_core")
        checks["gpu_budget"] = records(srv, "inject.jsonl", "gpu_budget")
        mb0 = nvml_used_mb(engine)
        import asyncio

        asyncio.run(sequential(srv, 20, 1))  # warm
        mb1, n1 = nvml_used_mb(engine), max(r["n"] for r in records(srv, "inject.jsonl", "request"))
        asyncio.run(sequential(srv, args.requests, 2, words=20, max_tokens=8))
        time.sleep(6)
        mb2, n2 = nvml_used_mb(engine), max(r["n"] for r in records(srv, "inject.jsonl", "request"))
        slope = (mb2 - mb1) / (n2 - n1) * 100 if mb1 is not None and mb2 is not None else None
        checks["device_leak"] = {"nvml_mb": [mb0, mb1, mb2], "requests": n2 - n1,
                                 "nvml_mb_per_100": slope, "injected_mb_per_100": args.leak_mb * 100}
        leaked = records(srv, "inject.jsonl", "block_leak")
        reclaimed = records(srv, "events.jsonl", "orphans_reclaimed")
        checks["audit_equals_injector"] = (
            Counter(i for r in leaked for i in r["block_ids"]) == Counter(i for r in reclaimed for i in r["block_ids"]))
        checks["leaked_blocks"] = sum(len(r["block_ids"]) for r in leaked)
        rel = [r for r in records(srv, "events.jsonl", "idle_release") if r.get("role") == "engine_core"]
        checks["idle_release_engine_core"] = rel[-1] if rel else None
    finally:
        srv.stop()
    slope = checks.get("device_leak", {}).get("nvml_mb_per_100")
    want = checks.get("device_leak", {}).get("injected_mb_per_100", 0)
    checks["device_leak_within_20pct"] = slope is not None and abs(slope - want) <= 0.2 * want
    roles = {v["process"] for v in checks.get("processes", {}).values()}
    ok = all([checks["patches_list_equals_committed"], roles >= {"api_server", "engine_core"},
              bool(checks.get("gpu_budget")), checks["device_leak_within_20pct"],
              checks.get("audit_equals_injector"), checks.get("idle_release_engine_core") is not None])
    checks["ok"] = ok
    text = json.dumps(checks, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
