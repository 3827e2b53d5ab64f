"""A small streaming client for the tests: real SSE over real sockets, every result checked."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    request_id: str = ""
    status: int = 0
    chunks: int = 0
    chunk_tokens: int = 0  # token ids carried by the chunks (vLLM may merge deltas under load)
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None
    generation: str | None = None
    started: float = 0.0
    first_byte: float | None = None
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, max_tokens: int,
                            prompt: str = "hello world", timeout: float = 600.0,
                            res: StreamResult | None = None) -> StreamResult:
    """One streaming completion; `res` (optional) is filled in as bytes arrive."""
    rid = uuid.uuid4().hex
    if res is None:
        res = StreamResult(request_id=rid)
    res.request_id, res.started = rid, time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"X-Request-Id": rid}, timeout=timeout) as r:
            res.status = r.status_code
            res.generation = r.headers.get("x-vllm-guard-generation")
            async for line in r.aiter_lines():
                if res.first_byte is None:
                    res.first_byte = time.monotonic()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = json.dumps(obj["error"])
                    continue
                if obj.get("choices"):
                    res.chunks += 1
                    res.chunk_tokens += sum(len(c.get("token_ids") or []) for c in obj["choices"])
                if obj.get("usage"):
                    res.completion_tokens = obj["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.ended = time.monotonic()
    return res


async def run_load(url: str, model: str, total: int, concurrency: int, max_tokens: int,
                   results: list[StreamResult] | None = None) -> list[StreamResult]:
    """`total` streaming requests, `concurrency` at a time (closed loop)."""
    out: list[StreamResult] = [] if results is None else results
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one() -> None:
            async with sem:
                out.append(await stream_completion(client, url, model, max_tokens))
        await asyncio.gather(*(one() for _ in range(total)))
    return out


@dataclass
class LoadSummary:
    total: int
    ok: int
    errors: list[str] = field(default_factory=list)


def summarize(results: list[StreamResult], max_tokens: int) -> LoadSummary:
    s = LoadSummary(total=len(results), ok=0)
    for r in results:
        if r.ok and r.completion_tokens == max_tokens and r.chunk_tokens == max_tokens:
            s.ok += 1
        else:
            s.errors.append(f"{r.request_id}: status={r.status} done={r.done} chunks={r.chunks} "
                            f"chunk_tokens={r.chunk_tokens} "
                            f"tokens={r.completion_tokens} error={r.error}")
    return s
