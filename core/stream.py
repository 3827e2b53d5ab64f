"""One streaming completion, timed at the client and sorted into an error category.

Latency is measured from the actual send time and from the *scheduled* send time; the latter
includes any wait for a concurrency slot or a late event loop, so coordinated omission cannot
hide a stall (vLLM #54101). A chunk counts as a chunk; tokens come from the usage record. The
body is read event by event with the one SSE reader (`core.sse`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import sse

# error categories (the `error` column; NULL = success)
CONNECT, TIMEOUT, DISCONNECT, TRUNCATED, STREAM_ERROR, RECYCLE_503 = (
    "connect", "timeout", "disconnect", "truncated", "stream_error", "http_503_recycle")
LOST = "lost_in_flight"  # sent by a soak process that was killed before the result was stored


@dataclass
class Result:
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_mean_s: float | None = None
    itl_max_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    generation: int | None = None
    error: str | None = None
    detail: str | None = None
    done: bool = field(default=False, repr=False)


@dataclass
class _Reading:
    """One stream's events as they complete: chunks, time to the first, gaps, usage, errors."""

    res: Result
    t_send: float
    last: float | None = None  # when the last chunk came
    gaps_sum: float = 0.0
    gaps_n: int = 0
    gaps_max: float = 0.0

    def event(self, ev: sse.Event) -> None:
        if ev.data is None:
            return  # a comment or another field
        if ev.done:
            self.res.done = True
            return
        obj = json.loads(ev.data)
        if "error" in obj:
            self.res.error, self.res.detail = STREAM_ERROR, json.dumps(obj["error"])[:300]
            return
        if obj.get("choices"):
            now = time.monotonic()
            self.res.chunks += 1
            if self.last is None:
                self.res.ttft_s = now - self.t_send
            else:
                gap = now - self.last
                self.gaps_sum, self.gaps_n = self.gaps_sum + gap, self.gaps_n + 1
                self.gaps_max = max(self.gaps_max, gap)
            self.last = now
        usage = obj.get("usage")
        if usage:
            self.res.output_tokens = usage.get("completion_tokens")
            self.res.prompt_tokens = usage.get("prompt_tokens")

    def end(self) -> None:
        if self.gaps_n:
            self.res.itl_mean_s, self.res.itl_max_s = self.gaps_sum / self.gaps_n, self.gaps_max


def _http_category(status: int, headers: Any, body: bytes) -> str:
    if status == 503 and ("Retry-After" in headers or b"vllm_guard" in body):
        return RECYCLE_503
    return f"http_{status}"


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                            request_id: str, timeout_s: float) -> tuple[Result, float]:
    """POST a streaming completion; returns the result and the monotonic send time."""
    res = Result()
    t_send = time.monotonic()
    reading = _Reading(res, t_send)
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            res.status = r.status
            gen = r.headers.get("X-Vllm-Guard-Generation")
            res.generation = int(gen) if gen and gen.isdigit() else None
            if r.status != 200:
                text = await r.read()
                res.error, res.detail = _http_category(r.status, r.headers, text), text[:300].decode("utf-8", "replace")
                res.e2e_s = time.monotonic() - t_send
                return res, t_send
            split = sse.Splitter()
            async for piece in r.content.iter_any():
                for ev in split.feed(piece):
                    reading.event(ev)
    except asyncio.TimeoutError as e:
        res.error, res.detail = TIMEOUT, f"no complete answer within {timeout_s}s {e}".strip()
    except aiohttp.ClientConnectorError as e:
        res.error, res.detail = CONNECT, str(e)[:300]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            ConnectionResetError) as e:
        res.error, res.detail = DISCONNECT, f"{type(e).__name__}: {e}"[:300]
    except (aiohttp.ClientError, ValueError) as e:
        res.error, res.detail = DISCONNECT, f"{type(e).__name__}: {e}"[:300]
    res.e2e_s = time.monotonic() - t_send
    if res.error is None and not res.done:
        res.error, res.detail = TRUNCATED, f"stream ended without [DONE] after {res.chunks} chunks"
    reading.end()
    return res, t_send
