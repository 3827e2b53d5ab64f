"""One try of a request at one generation: the socket work, and a typed account of how it ended.

A try sends the request (whole, or a stream's continuation), holds the response headers back
until the backend's first body bytes arrive (so "nothing has reached the client yet" is a fact,
not a guess), then passes the body through chunk by chunk, or follows a resumable stream event
by event (`stitch.Stream`). It never decides what happens next: it returns `Answered` (the
answer went to the client to its end, good or bad) or `Broke` with the `policy.Failure` that
ended it, and `dispatch` asks `policy.decide`. A backend answer with a 4xx, an error event that
is not the engine's death, a 5xx from a live engine (unless the policy retries 5xx) or a body
without `[DONE]` from a stream it does not follow is an answer: the client gets it as it was.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from vllm_guard.core import sse
from vllm_guard.core.protocol import FailReason, RejectReason

from . import resume
from .done import USAGE_TAIL, Counters, Outcome, usage_of
from .flight import Flight
from .policy import Failure, RetryPolicy
from .stitch import Stream
from .target import CONNECT_TIMEOUT_S, Target, Ticket
from .waiting import WaitQueue

log = structlog.get_logger("vllm_guard.proxy")

HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
}
CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError, BrokenPipeError)
_SSE_ERROR = b'data: {"error"'
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
RELAY_BATCH = 64  # events of one read handled between two turns of the loop (a resumable stream)


@dataclass(frozen=True)
class Answer:
    """A try whose answer reached the client: what its access line says."""

    generation: int
    method: str
    path: str
    status: int
    ttft_ms: float | None = None  # the first try's (a continuation's is not the request's TTFT)
    continuation: bool = False


@dataclass(frozen=True)
class Answered:
    """The answer went to the client to its end: ok, failed or truncated (the request is over)."""

    resp: web.StreamResponse
    answer: Answer
    outcome: str


@dataclass(frozen=True)
class Broke:
    """The try ended in `failure`. `resp`: the client's response once its headers went out;
    `answer`: this try's answer had reached the client; `followed`: as a stream the proxy
    follows event by event."""

    failure: Failure
    detail: str
    resp: web.StreamResponse | None = None
    answer: Answer | None = None
    followed: bool = False


def count_tokens(stream: Stream, f: Flight) -> None:
    """A followed stream's usage, as the proxy counted it (prompt and every part's tokens)."""
    if stream.prompt_ids is not None:
        f.tokens(len(stream.prompt_ids), len(stream.gen))


def _is_sse(up: aiohttp.ClientResponse) -> bool:
    return up.headers.get("Content-Type", "").startswith("text/event-stream")


class Upstream:
    def __init__(self, policy: RetryPolicy, counters: Counters, queue: WaitQueue) -> None:
        self.policy = policy
        self.counters = counters
        self.queue = queue
        self.ttft: collections.deque[float] = collections.deque(maxlen=4096)  # edge TTFT (s), recent
        # one try, from sending to its answer's end (the policy's per-try timeout)
        self.timeout = aiohttp.ClientTimeout(total=policy.per_try_timeout_s, connect=CONNECT_TIMEOUT_S)
        # each generation's context length, read from its /v1/models when a continuation needs it
        self._model_len: weakref.WeakKeyDictionary[Target, int] = weakref.WeakKeyDictionary()

    # -- the two kinds of try ------------------------------------------------------------------
    async def whole(self, request: web.Request, ticket: Ticket, body: bytes, f: Flight,
                    stream: Stream | None) -> Answered | Broke:
        """The request as the client sent it (`stream`: followed event by event, if resumable)."""
        t = ticket.target
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        headers["X-Request-Id"] = f.rid
        f.at("waiting for the first byte")
        up = await self._send(t, request.method, request.path_qs, body, headers)
        if isinstance(up, Broke):
            return up
        try:
            first = await self._first(up)
            if isinstance(first, Broke):
                return first
            if 400 <= up.status < 500:
                await self.queue.uncount(ticket)  # refused by the API server: never reached the engine
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in HOP:
                    resp.headers.add(k, v)
            resp.headers["X-Request-Id"] = f.rid
            resp.headers["X-Vllm-Guard-Generation"] = str(t.generation)
            sse_body = _is_sse(up)
            f.answered_by(t.generation, ticket.replica, sse_body)
            if up.content_length is not None and not sse_body:
                resp.content_length = up.content_length
            f.at("streaming")
            await resp.prepare(request)
            ttft = time.monotonic() - f.t0
            self.ttft.append(ttft)
            answer = Answer(t.generation, request.method, request.path, up.status, round(ttft * 1000, 2))
            followed = stream is not None and sse_body and up.status == 200
            if followed:
                assert stream is not None
                end = await self._relay(resp, up, first, ticket, f, stream)
            else:
                end = await self._pass(resp, up, first, ticket, f, sse_body)
            if isinstance(end, Broke):
                return Broke(end.failure, end.detail, resp, answer, followed)
            if end == "ok" and 400 <= up.status < 500:
                f.end(Outcome.REJECTED, up.status, f"vLLM answered {up.status}", RejectReason.VLLM_REFUSED)
            elif end == "ok":
                f.end(Outcome.COMPLETED, up.status)
            else:
                f.end(Outcome.FAILED, up.status, f"the backend's answer was {end}", FailReason.BACKEND_BROKE)
            return Answered(resp, answer, end)
        except BaseException:
            up.close()  # anything unfinished: drop the backend connection, so vLLM stops the request
            raise
        finally:
            up.release()

    async def continuation(self, resp: web.StreamResponse, ticket: Ticket, stream: Stream, f: Flight,
                           client_headers: Any) -> Answered | Broke:
        """The continuation of a stream whose backend died, relayed into the same client
        response. It carries the client's headers (its API key)."""
        t = ticket.target
        headers = {k: v for k, v in client_headers.items() if k.lower() not in HOP}
        headers.update({"Content-Type": "application/json", "X-Request-Id": f.rid})
        left = stream.left(self._model_len.get(t))
        if left is None:
            n = await self._max_model_len(t, headers)
            if isinstance(n, Broke):
                return n
            self._model_len[t] = n
            left = stream.left(n)
        if left is None or left <= 0:
            return Broke(Failure.NO_ROOM, f"{left} tokens were left to generate")
        self.counters.resumes += 1
        f.at("resuming")
        up = await self._send(t, "POST", resume.COMPLETIONS, stream.continuation(left), headers)
        if isinstance(up, Broke):
            return up
        try:
            first = await self._first(up)
            if isinstance(first, Broke):
                return first
            if up.status != 200 or not _is_sse(up):
                detail = first[:300].decode("utf-8", "replace")
                return Broke(Failure.DECLINED, f"generation {t.generation} refused its continuation "
                                               f"(HTTP {up.status}: {detail})")
            f.answered_by(t.generation, ticket.replica, True)
            f.at("streaming")
            answer = Answer(t.generation, "POST", resume.COMPLETIONS, up.status, continuation=True)
            end = await self._relay(resp, up, first, ticket, f, stream)
            if isinstance(end, Broke):
                return Broke(end.failure, end.detail, resp, answer, followed=True)
            if end == "ok":
                f.end(Outcome.COMPLETED, resp.status)
            else:
                f.end(Outcome.FAILED, resp.status, f"the continuation's answer was {end}", FailReason.BACKEND_BROKE)
            return Answered(resp, answer, end)
        except BaseException:
            up.close()
            raise
        finally:
            up.release()

    # -- the parts -----------------------------------------------------------------------------
    async def _send(self, t: Target, method: str, path: str, body: bytes,
                    headers: dict[str, str]) -> aiohttp.ClientResponse | Broke:
        assert t.session is not None
        try:
            # Cancelled here (the client left), aiohttp closes the backend connection: vLLM aborts.
            return await t.session.request(method, t.base + path, data=body, headers=headers, allow_redirects=False,
                                           timeout=self.timeout)
        except aiohttp.ClientConnectorError as e:  # nothing listens there any more
            return Broke(Failure.REFUSED, f"{type(e).__name__}: {e}")
        except _UPSTREAM_ERRORS as e:
            return Broke(Failure.DROPPED, f"{type(e).__name__}: {e}")

    async def _first(self, up: aiohttp.ClientResponse) -> bytes | Broke:
        """The answer's first body bytes; Broke when they say (or show) the backend failed."""
        try:
            first = await up.content.readany()
        except _UPSTREAM_ERRORS as e:
            up.close()
            return Broke(Failure.DROPPED, f"{type(e).__name__} before the first byte: {e}")
        if (up.status >= 500 or first.startswith(_SSE_ERROR)) and resume.engine_dead(first):
            up.close()
            return Broke(Failure.ENGINE_DEAD, f"engine dead (HTTP {up.status})")
        if not first and up.status == 200 and _is_sse(up):
            up.close()
            return Broke(Failure.EMPTY, "a stream that ended before its first event")
        if up.status >= 500 and Failure.HTTP_5XX in self.policy.retry_on:
            up.close()
            return Broke(Failure.HTTP_5XX, f"HTTP {up.status}: {first[:200].decode('utf-8', 'replace')}")
        return first

    async def _max_model_len(self, t: Target, headers: dict[str, str]) -> int | Broke:
        """The model's context length, from the target's /v1/models (a chat with no max_tokens
        goes on for what the context leaves)."""
        assert t.session is not None
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            async with t.session.get(t.base + "/v1/models", headers=auth) as r:
                models = await r.json()
            return int(models["data"][0]["max_model_len"])
        except (*_UPSTREAM_ERRORS, ValueError, KeyError, IndexError, TypeError) as e:
            return Broke(Failure.DROPPED, f"its /v1/models did not answer: {type(e).__name__}: {e}")

    async def _pass(self, resp: web.StreamResponse, up: aiohttp.ClientResponse, first: bytes, ticket: Ticket,
                    f: Flight, sse_body: bool) -> str | Broke:
        """Pass the body through; returns the outcome (ok, failed, truncated), or Broke when the
        backend broke off (DIED) or the client left."""
        t = ticket.target
        tail = first[-USAGE_TAIL:]  # the end of the answer: [DONE], and vLLM's usage record
        errored = sse_body and _SSE_ERROR in first
        try:
            if first:
                await resp.write(first)
                f.sent(time.monotonic())
            while True:
                try:
                    chunk = await up.content.readany()
                except _UPSTREAM_ERRORS as e:
                    return Broke(Failure.DIED, f"{type(e).__name__}: {e}")
                if not chunk:
                    break
                if sse_body and not errored and _SSE_ERROR in chunk:
                    errored = True  # vLLM's own error event (e.g. engine died): a failed request
                tail = (tail + chunk)[-USAGE_TAIL:]
                await resp.write(chunk)
                f.sent(time.monotonic())
            await resp.write_eof()
        except CLIENT_GONE:
            up.close()
            return Broke(Failure.CLIENT_GONE, "the client left")
        f.tokens(*usage_of(tail))
        truncated = sse_body and b"[DONE]" not in tail[-64:]
        if up.status >= 500 or truncated or errored:
            if f.stream and f.unresumable and (truncated or errored):
                self.counters.unresumable += 1
            log.warning("request_failed", request_id=f.rid, generation=t.generation, status=up.status,
                        truncated=truncated, error_event=errored, not_resumable=f.unresumable)
            return "truncated" if truncated else "failed"
        if ticket.counted:
            t.finished_one()
        return "ok"

    async def _relay(self, resp: web.StreamResponse, up: aiohttp.ClientResponse, first: bytes, ticket: Ticket,
                     f: Flight, stream: Stream) -> str | Broke:
        """A resumable stream, event by event, through `stream`. Returns the outcome as `_pass`
        does; Broke when the backend died before the stream ended (DIED), the try ran past its
        timeout (TIMEOUT) or the client left."""
        t = ticket.target
        split = sse.Splitter()
        chunk, broke = first, ""
        t.follows(up, stream.resumable)
        try:
            while True:
                events = split.feed(chunk) if chunk else []
                for i in range(0, max(1, len(events)), RELAY_BATCH):
                    if i:  # a large read (a slow client, a busy box): let the loop turn between parts
                        await asyncio.sleep(0)
                    out = [b for ev in events[i:i + RELAY_BATCH] for b in stream.feed(ev)]
                    if stream.stop_at_seam is not None and stream.finished and i + RELAY_BATCH >= len(events):
                        out += stream.closing()  # ended on a stop string across the seam: vLLM goes no further
                    if out:
                        await resp.write(b"".join(out))
                        f.sent(time.monotonic())
                if stream.done or stream.dead:
                    break
                try:
                    chunk = await up.content.readany()
                except asyncio.TimeoutError as e:
                    up.close()
                    return Broke(Failure.TIMEOUT, str(e))
                except _UPSTREAM_ERRORS as e:
                    broke = f"{type(e).__name__}: {e}"
                    break
                if not chunk:
                    broke = "the stream ended without [DONE]"
                    break
            if stream.dead or broke:
                up.close()
                if not stream.finished and up in t.cut:  # cut by the hand-over (one it left dies as one)
                    return Broke(Failure.HANDED, f"generation {t.generation} handed its streams over at the switch")
                if not stream.finished:
                    return Broke(Failure.DIED, broke or "vLLM's engine died (its error event)")
                # it died after the last token: the client gets the rest from here
                await resp.write(b"".join(stream.closing()))
                f.sent(time.monotonic())
            elif not up.closed and stream.stop_at_seam is not None:
                up.close()
            await resp.write_eof()
        except CLIENT_GONE:
            up.close()
            return Broke(Failure.CLIENT_GONE, "the client left")
        finally:
            t.follows(up, None)
        count_tokens(stream, f)
        if stream.error is not None or not stream.finished:
            log.warning("request_failed", request_id=f.rid, generation=t.generation, error_event=stream.error,
                        truncated=not stream.finished)
            return "failed" if stream.error is not None else "truncated"
        if ticket.counted:
            t.finished_one()
        return "ok"
