#!/usr/bin/env python3
"""Recycle strategies under open-loop streaming load: TTFT p99 over a run that recycles vs one
that does not, failed requests, and each recycle's gap (the ledger's downtime_s), in one run.

CPU (vLLM-CPU, the tiny model; scenarios run one after another on this small box):

    python bench/bench_strategies.py cpu --out F.json [--scenarios none,overlap,cold,gated,replicas2]
        [--recycles 3] [--rate 2] [--max-tokens 16]

GPU (one command, < 9 minutes, JSON rewritten after every step so a timeout keeps what was done):

    python3 bench/bench_strategies.py gpu --out $OUT/strategies.json [--deadline 420]

  Three guards on one GPU at once, each serving a random-weight Llama-2-7B shape (mk7b.py,
  `--tokenizer` the tiny model, `--kv-cache-memory-bytes 6G`: ~21 GiB, a 7B on a 24 GiB card):
  - `cold` and `gated` (the 24 GiB budget: two generations do not fit, so the choice is between
    these two): light load, recycles; the gap of each (target for gated <= 12 s);
  - `overlap` (the 80 GiB budget: two fit): open-loop load, a recycle-free window first, then
    recycles; TTFT p99 across the recycles / p99 of the recycle-free window (target <= 1.5).
  The strategies are forced (`--recycle-strategy`): on one shared H200 the device-wide free
  memory says nothing about an emulated card. Which one `auto` picks from readings is the pure
  `runtime.strategy.choose`, unit-tested.

Scenario `none` is the recycle-free reference; every other scenario sends `recycle` through the
admin socket, waits for it to finish (every replica serving, nothing retiring), and goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vllm_guard.core import admin
from vllm_guard.core import ledger as L
from vllm_guard.core.protocol import Command, CommandRequest, StatusSnapshot
from vllm_guard.core.stream import stream_completion

GUARD = [sys.executable, "-m", "vllm_guard.cli"]
CPU_VLLM = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16"]
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
GPU_VLLM = ["--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory-bytes", "6G",
            "--gpu-memory-utilization", "0.16"]
_IDS = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


# -- open-loop load ------------------------------------------------------------------------------
@dataclass
class Sample:
    sent: float  # monotonic
    ttft_s: float | None
    error: str | None
    generation: int | None


@dataclass
class Load:
    """Poisson arrivals at `rate`/s, each a streaming completion; nothing waits for an answer."""

    url: str
    model: str
    rate: float
    max_tokens: int
    samples: list[Sample] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _stop: bool = False

    async def run(self) -> None:
        rnd = random.Random(7)
        body = {"model": self.model, "prompt": "hello world", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            nxt = time.monotonic()
            while not self._stop:
                nxt += rnd.expovariate(self.rate)
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                t = asyncio.create_task(self._one(s, body))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=300)

    async def _one(self, s: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        sent = time.monotonic()
        r, _ = await stream_completion(s, self.url, body, f"bench-strat-{next(_IDS)}", 600.0)
        self.samples.append(Sample(sent, r.ttft_s, r.error, r.generation))

    def stop(self) -> None:
        self._stop = True

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        xs = [x for x in self.samples if since <= x.sent < until]
        ok = [x.ttft_s for x in xs if x.error is None and x.ttft_s is not None]
        errors: dict[str, int] = {}
        for x in xs:
            if x.error is not None:
                errors[x.error] = errors.get(x.error, 0) + 1
        gens: dict[str, int] = {}
        for x in xs:
            gens[str(x.generation)] = gens.get(str(x.generation), 0) + 1
        return {"requests": len(xs), "failed": len(xs) - len(ok), "errors": errors,
                "ttft_p50_s": pct(ok, 0.5), "ttft_p99_s": pct(ok, 0.99), "ttft_max_s": pct(ok, 1.0),
                "by_generation": gens}


# -- one guarded server --------------------------------------------------------------------------
class Guard:
    def __init__(self, name: str, root: Path, model: str, args: list[str], vllm_args: list[str],
                 env: dict[str, str]) -> None:
        self.name = name
        self.state = root / name
        self.state.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.state / "guard.log"
        conf = self.state / "guard.toml"
        conf.write_text("[server]\nmetrics_port = 0\n")  # several guards at once: no metrics port to share
        cmd = [*GUARD, "serve", "--config", str(conf), "--model", model, "--port", str(self.port),
               "--state-dir", str(self.state), "--probe-interval", "30s", *args, "--", *vllm_args]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=True)

    async def status(self) -> StatusSnapshot | None:
        try:
            return await admin.fetch_status(self.state, timeout=10)
        except admin.AdminError:
            return None

    async def wait(self, pred: Any, timeout: float, what: str) -> StatusSnapshot:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: guard exited {self.proc.returncode} waiting for {what}")
            st = await self.status()
            if st is not None and pred(st):
                return st
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name}: {what} not within {timeout:.0f}s")

    @staticmethod
    def settled(st: StatusSnapshot) -> bool:
        reps = st.replicas
        # a standby parked beside a serving generation is its next generation too: settled
        return (st.recycle_in_progress is None and st.state.value == "serving"
                and all(r.state.value == "serving" and (r.next_generation is None or r.standby is not None)
                        and not r.retiring for r in reps))

    async def recycle(self, timeout: float) -> dict[str, Any]:
        """One admin recycle (every replica in turn); waits until all serve and nothing retires."""
        before = await self.wait(self.settled, 120, "settled before a recycle")
        t0 = time.monotonic()
        reply = await admin.send(self.state, CommandRequest(command=Command.RECYCLE, reason="bench"))
        want = before.recycles + max(1, len(before.replicas))
        st = await self.wait(lambda s: s.recycles >= want and self.settled(s), timeout, "the recycle to finish")
        return {"detail": reply.detail, "wall_s": round(time.monotonic() - t0, 2),
                "generations": [r.generation for r in st.replicas]}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def ledger(self) -> dict[str, Any]:
        try:
            conn = L.open_readonly(self.state)
            try:
                h = L.read_runtime(conn)
            finally:
                conn.close()
        except L.LedgerError as e:
            return {"error": str(e)}
        return {
            "recycles": [{"generation": r.generation, "replica": r.replica, "strategy": r.strategy,
                          "downtime_s": r.downtime_s, "duration_s": r.duration_s, "max_queued": r.max_queued,
                          "trigger": r.trigger} for r in h.recycles],
            "failures": [{"generation": f.generation, "kind": f.kind, "detail": f.detail} for f in h.failures],
        }

    def events(self, names: set[str]) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") in names:
                    out.append({k: e.get(k) for k in ("event", "timestamp", "generation", "replica", "strategy",
                                                       "why", "downtime_s", "duration_s", "queued", "after_stop_s",
                                                       "parked_after_s", "load_s") if k in e})
        return out


EVENTS = {"recycle_begin", "recycle_done", "generation_parked", "gate_opened", "generation_switched",
          "recycle_fallback", "generation_ready", "generation_failed"}


# -- a scenario ----------------------------------------------------------------------------------
@dataclass
class Plan:
    name: str
    strategy: str | None  # None: no recycle (the reference)
    replicas: int = 1
    recycles: int = 3  # admin recycles (each recycles every replica in turn)
    rate: float = 2.0
    baseline_s: float = 0.0  # a recycle-free window of load before the first recycle
    hold_s: float = 60.0  # `none`: how long the load runs
    settle_s: float = 10.0  # load between recycles and after the last one
    recycle_s: float = 150.0  # about how long one recycle takes (no recycle starts later than this before the deadline)


async def scenario(p: Plan, root: Path, model: str, vllm_args: list[str], env: dict[str, str], max_tokens: int,
                   deadline: float, out: dict[str, Any], save: Any, start_timeout: float = 900,
                   guard_args: list[str] | None = None) -> None:
    res: dict[str, Any] = {"strategy": p.strategy, "replicas": p.replicas, "rate": p.rate, "recycles": []}
    out[p.name] = res
    args = ["--replicas", str(p.replicas), *(guard_args or [])]
    if p.strategy is not None:
        args += ["--recycle-strategy", p.strategy]
    g = Guard(p.name, root, model, args, vllm_args, env)
    load: Load | None = None
    task: asyncio.Task[None] | None = None
    try:
        t0 = time.monotonic()
        st = await g.wait(lambda s: sum(r.state.value == "serving" for r in s.replicas) >= p.replicas,
                          min(start_timeout, deadline - time.monotonic()), "every replica serving")
        res["start_s"] = round(time.monotonic() - t0, 1)
        load = Load(g.url, st.served_model or model, p.rate, max_tokens)
        task = asyncio.create_task(load.run())
        t_load = time.monotonic()
        if p.strategy is None:
            await asyncio.sleep(min(p.hold_s, max(0.0, deadline - time.monotonic())))
        else:
            await asyncio.sleep(p.baseline_s)
            t_first = time.monotonic()
            for i in range(p.recycles):
                left = deadline - time.monotonic()
                if left < p.recycle_s:  # it would not finish in time
                    res["cut"] = f"deadline: {i} of {p.recycles} recycles done"
                    break
                res["recycles"].append(await g.recycle(left))
                save()
                await asyncio.sleep(p.settle_s)
            if p.baseline_s:
                res["window_baseline"] = load.summary(t_load, t_first)
                res["window_recycles"] = load.summary(t_first)
        load.stop()
        await asyncio.wait_for(task, 320)
        res["load"] = load.summary()
    except (RuntimeError, TimeoutError, asyncio.TimeoutError, admin.AdminError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if load is not None:
            load.stop()
            res.setdefault("load", load.summary())
        if task is not None and not task.done():
            task.cancel()
        res["exit_code"] = g.stop()
        res["ledger"] = g.ledger()
        res["events"] = g.events(EVENTS)
        keep_logs(g, out.get("logs_dir"))
        save()


def keep_logs(g: Guard, dst: str | None) -> None:
    """The tail of the runtime's log and of each generation's vLLM log, next to the JSON."""
    if not dst:
        return
    d = Path(dst) / g.name
    d.mkdir(parents=True, exist_ok=True)
    for src in [g.log, *sorted((g.state / "logs").glob("generation-*.log"))]:
        try:
            lines = src.read_text(errors="replace").splitlines()[-300:]
            (d / src.name).write_text("\n".join(lines) + "\n")
        except OSError:
            pass


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    """TTFT p99 of each scenario / the reference's; the ledger's gap per recycle."""
    r: dict[str, Any] = {}
    ref = (out.get("none") or {}).get("load", {}).get("ttft_p99_s")
    for name, res in out.items():
        if not isinstance(res, dict) or "load" not in res:
            continue
        p99 = res["load"].get("ttft_p99_s")
        row: dict[str, Any] = {"ttft_p99_s": p99, "failed": res["load"].get("failed"),
                               "requests": res["load"].get("requests")}
        if ref and p99:
            row["p99_vs_none"] = round(p99 / ref, 2)
        wb, wr = res.get("window_baseline", {}).get("ttft_p99_s"), res.get("window_recycles", {}).get("ttft_p99_s")
        if wb and wr:
            row["p99_recycles_vs_own_baseline"] = round(wr / wb, 2)
        recs = res.get("ledger", {}).get("recycles", [])
        row["strategies"] = [x["strategy"] for x in recs]
        row["downtime_s"] = [x["downtime_s"] for x in recs]
        row["max_queued"] = [x["max_queued"] for x in recs]
        r[name] = row
    return r


def writer(path: Path, out: dict[str, Any]) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    def save() -> None:
        out["summary"] = ratios(out)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(path)
    return save


# -- the two variants ----------------------------------------------------------------------------
async def cpu(a: argparse.Namespace) -> None:
    out: dict[str, Any] = {"variant": "cpu", "started": time.strftime("%FT%TZ", time.gmtime()),
                           "nproc": os.cpu_count(), "rate": a.rate, "max_tokens": a.max_tokens}
    save = writer(Path(a.out), out)
    out["logs_dir"] = str(Path(a.work) / "logs")
    root = Path(a.work)
    model = a.model or os.environ.get("VLLM_GUARD_TINY_MODEL") or str(root / "tiny")
    if not Path(model, "config.json").exists():
        subprocess.run([*GUARD, "model", "tiny", model], check=True)
    deadline = time.monotonic() + a.deadline
    for name in a.scenarios.split(","):
        strategy = None if name == "none" else "overlap" if name == "replicas2" else name
        reps = 2 if name == "replicas2" else 1
        # an admin recycle recycles every replica in turn: ceil(recycles / replicas) commands
        p = Plan(name, strategy, replicas=reps, recycles=-(-a.recycles // reps), rate=a.rate,
                 hold_s=a.hold, settle_s=a.settle)
        await scenario(p, root, model, CPU_VLLM, CPU_ENV, a.max_tokens, deadline, out, save)
    out["finished"] = time.strftime("%FT%TZ", time.gmtime())
    save()


async def gpu(a: argparse.Namespace) -> None:
    out: dict[str, Any] = {"variant": "gpu", "started": time.strftime("%FT%TZ", time.gmtime())}
    path = Path(a.out)
    out["logs_dir"] = str(path.parent / "strategies-logs")
    path.parent.mkdir(parents=True, exist_ok=True)
    save = writer(path, out)
    deadline = time.monotonic() + a.deadline
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = str(e)
    if not Path(a.model, "config.json").exists():
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, a.mk7b, a.model], capture_output=True, text=True, timeout=240)
        out["mk7b"] = {"rc": r.returncode, "s": round(time.monotonic() - t0, 1), "tail": r.stderr[-500:]}
    save()
    root = Path(a.work)
    vargs = [*GPU_VLLM, "--tokenizer", a.tokenizer]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}
    guard_args = [] if a.standby is None else ["--standby", a.standby]
    out["standby"] = a.standby or "the config's (auto)"
    plans = [Plan("cold", "cold", recycles=1, rate=1.0, settle_s=5, recycle_s=100),
             Plan("gated", "gated", recycles=2, rate=1.0, settle_s=5, recycle_s=100),
             Plan("overlap", "overlap", recycles=2, rate=a.rate, baseline_s=40, settle_s=10, recycle_s=100)]
    await asyncio.gather(*(scenario(p, root, a.model, vargs, env, a.max_tokens, deadline, out, save,
                                    start_timeout=300, guard_args=guard_args) for p in plans))
    out["finished"] = time.strftime("%FT%TZ", time.gmtime())
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="variant", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("--scenarios", default="none,overlap,cold,gated,replicas2")
    c.add_argument("--model", default=None)
    c.add_argument("--recycles", type=int, default=3)
    c.add_argument("--rate", type=float, default=2.0)
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument("--hold", type=float, default=240.0, help="seconds of load for `none`")
    c.add_argument("--settle", type=float, default=10.0)
    c.add_argument("--deadline", type=float, default=1500.0, help="seconds for the whole run")
    c.add_argument("--work", default="/tmp/bench-strategies")
    c.add_argument("--out", required=True)
    g = sub.add_parser("gpu")
    g.add_argument("--model", default="/tmp/llama7b")
    g.add_argument("--mk7b", default=".gpu/stage/mk7b.py")
    g.add_argument("--tokenizer", default="/tmp/tiny")
    g.add_argument("--rate", type=float, default=4.0)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--deadline", type=float, default=420.0, help="seconds; no recycle starts after it")
    g.add_argument("--work", default="/tmp/bench-strategies")
    g.add_argument("--standby", choices=["auto", "off"], default=None,
                   help="[server] standby for every guard (default: the config's, auto); off compares with runs "
                        "made before the standby existed")
    g.add_argument("--out", required=True)
    a = ap.parse_args()
    asyncio.run(cpu(a) if a.variant == "cpu" else gpu(a))


if __name__ == "__main__":
    main()
