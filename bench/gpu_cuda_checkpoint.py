#!/usr/bin/env python3
"""How long the driver's checkpoint API takes to move a CUDA process's GPU state to host memory and
back (`cuCheckpointProcessLock/Checkpoint/Restore/Unlock`, the calls NVIDIA's `cuda-checkpoint`
makes and CRIU's CUDA plugin drives). The restore half is what an engine snapshot restored after a
startup gate would cost on top of CRIU's own work; CRIU itself is looked for, not run.

    python3 bench/gpu_cuda_checkpoint.py --out FILE.json [--gib 20] [--rounds 2]

A child process (torch) fills `--gib` GiB of GPU memory with a known pattern and waits; this
process (no CUDA context of its own: only the driver's checkpoint calls) locks, checkpoints,
reads NVML's memory (the child's memory should be gone), restores and unlocks it, then the child
checks its data. Needs an NVIDIA driver with the checkpoint API (550+; 570+ for all four calls).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import sys, torch
gib = float(sys.argv[1])
n = int(gib * (1 << 30)) // 4
x = torch.arange(n, dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
want = int(x[::4096].sum().item())
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        y = x[::4096].sum().item()
        z = (x[:1 << 20] * 2).sum().item()  # a kernel after the restore, not only a read
        print("ok" if int(y) == want and int(z) == 2 * sum(range(1 << 20)) else f"BAD {y} {want}", flush=True)
    elif line.strip() == "exit":
        break
"""

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


def nvml_used_mib() -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = {p.pid: (p.usedGpuMemory or 0) >> 20 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        return {"device_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used >> 20, "processes_mib": procs}
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gib", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    res: dict[str, Any] = {"gib": a.gib, "criu": shutil.which("criu"), "cuda_checkpoint": shutil.which("cuda-checkpoint")}
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        res["driver_version"] = _driver(cu)
        fns = ["cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
               "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
        res["api"] = {f: hasattr(cu, f) for f in fns}
        if not all(res["api"].values()):
            raise RuntimeError("the driver lacks part of the checkpoint API")
        _check(cu.cuInit(0), "cuInit")
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(a.gib)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        try:
            t = time.monotonic()
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the child did not start")
            res["child_fill_s"] = round(time.monotonic() - t, 2)
            res["before"] = nvml_used_mib()
            rounds = []
            for _ in range(a.rounds):
                r: dict[str, Any] = {}
                pid = child.pid
                t = time.monotonic()
                _check(cu.cuCheckpointProcessLock(pid, None), "lock")
                r["lock_s"] = round(time.monotonic() - t, 3)
                t = time.monotonic()
                _check(cu.cuCheckpointProcessCheckpoint(pid, None), "checkpoint")
                r["checkpoint_s"] = round(time.monotonic() - t, 3)
                r["state"] = _state(cu, pid)
                r["while_checkpointed"] = nvml_used_mib()
                t = time.monotonic()
                _check(cu.cuCheckpointProcessRestore(pid, None), "restore")
                r["restore_s"] = round(time.monotonic() - t, 3)
                t = time.monotonic()
                _check(cu.cuCheckpointProcessUnlock(pid, None), "unlock")
                r["unlock_s"] = round(time.monotonic() - t, 3)
                child.stdin.write("check\n")
                child.stdin.flush()
                t = time.monotonic()
                r["data"] = child.stdout.readline().strip()
                r["first_kernel_after_s"] = round(time.monotonic() - t, 3)
                r["after"] = nvml_used_mib()
                rounds.append(r)
                print(json.dumps(r), flush=True)
            res["rounds"] = rounds
        finally:
            try:
                child.stdin.write("exit\n")
                child.stdin.flush()
                child.wait(30)
            except Exception:  # noqa: BLE001 - the child is killed below
                child.kill()
    except Exception as e:  # noqa: BLE001 - recorded: the result says what did not work
        res["error"] = f"{type(e).__name__}: {e}"
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}))
    return 0 if "error" not in res else 1


def _driver(cu: ctypes.CDLL) -> int:
    v = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(v))
    return v.value


def _state(cu: ctypes.CDLL, pid: int) -> str:
    s = ctypes.c_int(-1)
    _check(cu.cuCheckpointProcessGetState(pid, ctypes.byref(s)), "get state")
    return STATES.get(s.value, str(s.value))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


if __name__ == "__main__":
    sys.exit(main())
