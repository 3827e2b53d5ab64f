"""Closed-loop streaming client shared by the runtime benchmarks (TTFT, E2E, throughput).

Runs in its own process so its CPU use does not sit in the proxy's event loop. Each request
goes through `vllm_guard.core.stream.stream_completion`, the soak's client: TTFT is the first
chunk with a choice, a request is good when it ends with `[DONE]` and no error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import aiohttp

from vllm_guard.core.stream import stream_completion

_IDS = itertools.count()


@dataclass
class RunResult:
    label: str
    requests: int = 0
    failed: int = 0
    chunks: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    generations: dict[str, int] = field(default_factory=dict)
    first_by_generation: dict[str, float] = field(default_factory=dict)  # wall clock of the 1st chunk

    @property
    def req_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.wall_s if self.wall_s else 0.0


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, res: RunResult,
                      timeout_s: float = 1800.0) -> None:
    wall0, mono0 = time.time(), time.monotonic()
    r, t_send = await stream_completion(session, url, {**body, "stream": True},
                                        f"bench-{res.label}-{next(_IDS)}", timeout_s)
    gen = "error" if r.status == 0 else str(r.generation) if r.generation is not None else "direct"
    if r.ttft_s is not None and gen not in res.first_by_generation:
        res.first_by_generation[gen] = wall0 + (t_send - mono0) + r.ttft_s
    res.requests += 1
    res.generations[gen] = res.generations.get(gen, 0) + 1
    if r.error is not None:
        res.failed += 1
        return
    res.chunks += r.chunks
    res.ttft_s.append(r.ttft_s or 0.0)
    res.e2e_s.append(r.e2e_s or 0.0)


async def run(url: str, model: str, total: int, concurrency: int, max_tokens: int, label: str,
              prompt: str = "hello world", extra: dict | None = None) -> RunResult:
    res = RunResult(label=label)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, **(extra or {})}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await one_request(s, url, body, res, 600.0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.wall_s = time.perf_counter() - t0
    return res


def main() -> None:
    """`python bench/loadclient.py URL MODEL TOTAL CONC MAX_TOKENS LABEL [BODY_JSON]` -> one JSON
    line (BODY_JSON: more fields of every request's body)."""
    import sys

    url, model, total, conc, mt, label = sys.argv[1:7]
    extra = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    r = asyncio.run(run(url, model, int(total), int(conc), int(mt), label, extra=extra))
    print(json.dumps({"label": r.label, "requests": r.requests, "failed": r.failed, "chunks": r.chunks,
                      "wall_s": r.wall_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                      "generations": r.generations, "first_by_generation": r.first_by_generation}))


if __name__ == "__main__":
    main()
