#!/usr/bin/env python3
"""Record a real NVML trace and measure a real CUDA leak through NVML (run on the GPU box).

    python3 bench/gpu_nvml_record.py --out $OUT/nvml_h200.jsonl [--idle-s 30] [--requests 3000]

1. Prints the capability table (which NVML fields this GPU supports) as JSON.
2. Records a trace at 1 Hz: `--idle-s` seconds idle (label "idle"), then the whole leak run
   (label "load"), then `--tail-s` idle again: the base for tests/fixtures/watchdog (see
   docs/WATCHDOG.md, "Regenerating the fixtures").
3. For each allocator variant, a child CUDA process serves `--requests` "requests": each keeps
   150 KB (the seed's rate) beside transient matmuls. The parent reads the child's per-process
   memory via nvmlDeviceGetComputeRunningProcesses every 50 requests and reports the Theil-Sen
   slope in MB per 100 requests against the true rate (14.65 MB/100).
Writes `<out>.result.json` beside the trace. Needs torch (CUDA), pynvml, scipy, vllm_guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

LEAK_KB = 150
REPORT_EVERY = 50


def child(requests: int, leak_kb: int, size: int, min_req_s: float) -> int:
    """The leaking 'server': one line on stdout every REPORT_EVERY requests."""
    import torch

    dev = torch.device("cuda")
    keep = []
    a = torch.randn(size, size, device=dev)
    torch.cuda.synchronize()
    print("ready 0", flush=True)
    for i in range(1, requests + 1):
        t0 = time.perf_counter()
        while True:
            b = a @ a  # transient: allocated and freed per request
            torch.cuda.synchronize()
            del b
            if time.perf_counter() - t0 >= min_req_s:
                break
        keep.append(torch.empty(leak_kb * 1024, dtype=torch.uint8, device=dev).fill_(1))
        if i % REPORT_EVERY == 0:
            torch.cuda.synchronize()
            print(f"req {i}", flush=True)
    sys.stdin.readline()  # the parent reads the final memory, then lets us go
    return 0


def proc_mb(nv, pid: int) -> float | None:
    total = None
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            if int(p.pid) == pid and isinstance(p.usedGpuMemory, int):
                total = (total or 0.0) + p.usedGpuMemory / 2**20
    return total


def leak_run(nv, args: argparse.Namespace, alloc_conf: str) -> dict:
    from scipy import stats

    env = dict(os.environ)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    cmd = [sys.executable, __file__, "--child", "--requests", str(args.requests),
           "--size", str(args.size), "--min-req-s", str(args.min_req_s)]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    xs, ys, ts = [], [], []
    t0 = time.monotonic()
    assert p.stdout is not None and p.stdin is not None
    for line in p.stdout:
        word, n = line.split()
        mb = proc_mb(nv, p.pid)
        if mb is not None:
            xs.append(int(n)), ys.append(mb), ts.append(time.monotonic() - t0)
        if int(n) >= args.requests:
            break
    try:
        p.stdin.write("\n")
        p.stdin.flush()
    except BrokenPipeError:  # the child died: its series so far is still worth reporting
        pass
    p.wait(timeout=60)
    true = LEAK_KB * 1024 * 100 / 2**20
    out = {"alloc_conf": alloc_conf or "default", "points": len(xs), "requests": args.requests,
           "true_mb_per_100": round(true, 3), "seconds": round(ts[-1], 1) if ts else None,
           "first_mb": ys[0] if ys else None, "last_mb": ys[-1] if ys else None,
           "series": list(zip(xs, ys))}
    if len(xs) >= 3:
        warm = [i for i, x in enumerate(xs) if x >= 100] or list(range(len(xs)))
        slope, _, lo, hi = stats.theilslopes([ys[i] for i in warm], [xs[i] for i in warm])
        out.update(slope_mb_per_100=round(slope * 100, 3), ci95=[round(lo * 100, 3), round(hi * 100, 3)],
                   error_pct=round((slope * 100 - true) / true * 100, 1))
        steps = sorted({round(b - a, 1) for a, b in zip(ys, ys[1:]) if b != a})
        out["step_sizes_mb"] = steps[:10]
    return out


def record(sampler, writer, label: list[str], stop: threading.Event, hz: float) -> None:
    nxt = time.monotonic()
    while not stop.is_set():
        rec = sampler.sample()
        rec["label"] = label[0]
        writer.write(rec)
        nxt += 1.0 / hz
        stop.wait(max(0.0, nxt - time.monotonic()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="trace path (JSONL)")
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--tail-s", type=float, default=10.0)
    ap.add_argument("--hz", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--size", type=int, default=2048, help="matmul size of the transient work")
    ap.add_argument("--min-req-s", type=float, default=0.01, help="GPU work per request (s)")
    ap.add_argument("--variants", default="default,expandable_segments:True")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.requests, LEAK_KB, args.size, args.min_req_s)
    if not args.out:
        ap.error("--out is required")

    import pynvml as nv
    from vllm_guard.core.nvml import NvmlSession
    from vllm_guard.watchdog.trace import TraceWriter

    sampler = NvmlSession(timeout_s=5.0)
    if not sampler.available:
        print(json.dumps({"error": sampler.error}))
        return 1
    sampler.sample()  # fills the capability table
    print(json.dumps(sampler.capability_table(), indent=2), flush=True)
    out = Path(args.out)
    writer = TraceWriter(out, sampler.meta())
    label, stop = ["idle"], threading.Event()
    th = threading.Thread(target=record, args=(sampler, writer, label, stop, args.hz), daemon=True)
    th.start()
    time.sleep(args.idle_s)
    label[0] = "load"
    results = []
    try:
        for v in [x for x in args.variants.split(",") if x]:
            r = leak_run(nv, args, "" if v == "default" else v)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "series"}), flush=True)
        label[0] = "idle"
        time.sleep(args.tail_s)
    finally:
        stop.set()
        th.join()
    writer.close()
    writer_meta = sampler.meta()  # capability table after every field was tried
    sampler.close()
    lines = out.read_text().splitlines()
    lines[0] = json.dumps(writer_meta, separators=(",", ":"))
    out.write_text("\n".join(lines) + "\n")
    summary = {"trace": str(out), "samples": len(lines) - 1, "capabilities": writer_meta, "leak": results}
    out.with_suffix(".result.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"trace": str(out), "samples": len(lines) - 1}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
