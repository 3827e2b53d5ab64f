"""The streaming reverse proxy on the public port: admission, queueing, retry and accounting.

Why a proxy and not a handed-over listening socket: recycling with zero failed requests needs a
place where a request can wait while no backend serves, be retried when a backend died before
answering, and be counted against `max_requests` exactly. The proxy holds back the response
headers until the backend's first body bytes arrive, so "nothing has reached the client yet"
is a fact it knows, not a guess. SSE is passed through chunk by chunk.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import structlog
from aiohttp import web

from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import LatencySummary

from .router import Router

log = structlog.get_logger("vllm_guard.proxy")

_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
}
# Bodies of a backend whose engine died; a request that got only this has reached no client.
_SSE_ERROR = b'data: {"error"'
_ENGINE_DEAD_MARKERS = (b"EngineDeadError", b"EngineCore encountered an issue", b"Engine loop has died")


MAX_ATTEMPTS = 10  # tries of a request whose backend died before answering


class Reject(Exception):
    """No backend can take the request in time: 503 with Retry-After."""


class Retry(Exception):
    """The backend failed before any byte reached the client: try the next generation."""


@dataclass(eq=False)
class Target:
    """One generation as the proxy sees it: where to send and what was sent."""

    generation: int
    url: str
    limit: int | None = None  # requests arriving after ready this generation may take; None: no limit
    accepting: bool = True
    dead: bool = False
    dispatched: int = 0  # counted requests sent to this generation
    inherited: int = 0  # of those: waiting before it was ready (its backlog; not toward the limit)
    completed: int = 0
    in_flight: int = 0
    ready_at: float | None = None  # monotonic; set when it opens
    session: aiohttp.ClientSession | None = None
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def toward_limit(self) -> int:
        return self.dispatched - self.inherited

    def open(self, request_timeout: float) -> None:
        self.ready_at = time.monotonic()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=request_timeout, connect=10),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


@dataclass
class Counters:
    requests_total: int = 0  # counted (POST) requests received
    completed: int = 0
    failed_requests: int = 0
    rejected: int = 0  # subset of failed: 503 from the queue
    retried: int = 0
    client_disconnects: int = 0
    max_queued: int = 0  # high-water mark, reset by the supervisor at each recycle


class Proxy:
    def __init__(self, cfg: ServerConfig, on_limit: Callable[[Target], None], on_error: Callable[[Target], None]):
        self.cfg = cfg
        self.on_limit = on_limit
        self.on_error = on_error
        self.router = Router(on_limit)  # which target takes a request (runtime/router.py)
        self.reject_reason: str | None = None  # held or shutting down: fail fast
        self.queued = 0
        self.in_flight = 0
        self.counters = Counters()
        self.ttft: collections.deque[float] = collections.deque(maxlen=4096)  # edge TTFT (s), recent
        self._cond = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._idle_since = time.monotonic()

    # -- control (called by the supervisor) -------------------------------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, reuse_address=True, backlog=2048)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def set_target(self, target: Target | None) -> None:
        """Dispatch to `target` only from now on (None: queue everything)."""
        self.router.replace(target)
        await self._wake()

    async def add_target(self, target: Target, replica: int = 0) -> None:
        """Dispatch to `target` too (another replica, or the successor of a generation)."""
        self.router.add(target, replica)
        await self._wake()

    async def stop_dispatch(self, target: Target, dead: bool = False) -> None:
        self.router.stop(target, dead)
        await self._wake()

    async def wake_waiters(self) -> None:
        """The router's targets changed (e.g. one may accept again): queued requests look again."""
        await self._wake()

    async def set_reject(self, reason: str | None) -> None:
        self.reject_reason = reason
        await self._wake()

    async def _wake(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def idle_for(self) -> float:
        """Seconds since the last request left, 0 while any is in flight or queued."""
        if self.in_flight or self.queued:
            return 0.0
        return time.monotonic() - self._idle_since

    def ttft_summary(self) -> LatencySummary:
        """Edge TTFT of the recent requests (the last 4096)."""
        if not self.ttft:
            return LatencySummary()
        xs = sorted(self.ttft)

        def q(f: float) -> float:
            return round(xs[min(len(xs) - 1, int(f * len(xs)))], 6)

        return LatencySummary(samples=len(xs), p50_s=q(0.50), p99_s=q(0.99))

    # -- admission ---------------------------------------------------------------------------
    def _pick(self, counted: bool, arrived: float) -> Target | None:
        t = self.router.pick(counted, arrived)
        if t is not None:
            self.in_flight += 1
        return t

    async def _admit(self, counted: bool, arrived: float, deadline: float) -> Target:
        t = self._pick(counted, arrived) if self.reject_reason is None else None
        if t is not None:
            return t
        if self.reject_reason is not None:
            raise Reject(self.reject_reason)
        if self.queued >= self.cfg.queue_size:
            raise Reject(f"queue full ({self.cfg.queue_size} waiting)")
        self.queued += 1
        self.counters.max_queued = max(self.counters.max_queued, self.queued)
        try:
            async with self._cond:
                while True:
                    if self.reject_reason is not None:
                        raise Reject(self.reject_reason)
                    t = self._pick(counted, arrived)
                    if t is not None:
                        return t
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Reject("no backend became ready within the queue's max wait")
                    try:
                        await asyncio.wait_for(self._cond.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.queued -= 1

    def _release(self, t: Target) -> None:
        self.router.release(t)
        self.in_flight -= 1
        if not self.in_flight:
            self._idle_since = time.monotonic()

    # -- the request path --------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        counted = request.method == "POST"
        if counted:
            self.counters.requests_total += 1
        body = await request.read()
        deadline = t0 + self.cfg.queue_max_wait
        attempt = 0
        while True:
            try:
                t = await self._admit(counted, t0, deadline)
            except Reject as e:
                return self._reject(rid, str(e), counted)
            try:
                return await self._forward(request, t, body, rid, t0, counted)
            except Retry as e:
                attempt += 1
                self.counters.retried += 1
                log.info("request_retry", request_id=rid, generation=t.generation, attempt=attempt, error=str(e))
                self.on_error(t)
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    return self._fail(rid, 502, f"backend failed {attempt} times: {e}", counted)
                await self._wait_for_new_target(t, 1.0)
            finally:
                self._release(t)

    async def _wait_for_new_target(self, old: Target, timeout: float) -> None:
        end = time.monotonic() + timeout
        async with self._cond:
            while self.router.sole(old) and time.monotonic() < end:
                try:
                    await asyncio.wait_for(self._cond.wait(), end - time.monotonic())
                except asyncio.TimeoutError:
                    break

    def _reject(self, rid: str, reason: str, counted: bool) -> web.Response:
        self.counters.rejected += 1
        log.warning("request_rejected", request_id=rid, reason=reason)
        resp = self._fail(rid, 503, reason, counted)
        resp.headers["Retry-After"] = str(self.cfg.retry_after)
        return resp

    def _fail(self, rid: str, status: int, message: str, counted: bool) -> web.Response:
        if counted:
            self.counters.failed_requests += 1
        body = {"error": {"message": message, "type": "vllm_guard", "code": status}}
        return web.json_response(body, status=status, headers={"X-Request-Id": rid})

    async def _forward(
        self, request: web.Request, t: Target, body: bytes, rid: str, t0: float, counted: bool
    ) -> web.StreamResponse:
        assert t.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = rid
        try:
            up = await t.session.request(
                request.method, t.url + request.path_qs, data=body, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise Retry(f"{type(e).__name__}: {e}") from e
        async with up:
            try:
                first = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise Retry(f"{type(e).__name__} before the first byte: {e}") from e
            if self._engine_dead(up.status, first):
                raise Retry(f"engine dead (HTTP {up.status})")
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            resp.headers["X-Request-Id"] = rid
            resp.headers["X-Vllm-Guard-Generation"] = str(t.generation)
            sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
            if up.content_length is not None and not sse:
                resp.content_length = up.content_length
            await resp.prepare(request)
            ttft = time.monotonic() - t0
            self.ttft.append(ttft)
            outcome = await self._stream(resp, up, first, t, rid, sse, counted)
            if self.cfg.access_log:
                log.info("request", request_id=rid, generation=t.generation, method=request.method,
                         path=request.path, status=up.status, outcome=outcome, ttft_ms=round(ttft * 1000, 2),
                         e2e_ms=round((time.monotonic() - t0) * 1000, 2))
            return resp

    @staticmethod
    def _engine_dead(status: int, first: bytes) -> bool:
        if status >= 500 or first.startswith(b"data: {\"error\""):
            return any(m in first for m in _ENGINE_DEAD_MARKERS)
        return False

    async def _stream(
        self, resp: web.StreamResponse, up: aiohttp.ClientResponse, first: bytes, t: Target,
        rid: str, sse: bool, counted: bool,
    ) -> str:
        """Pass the body through; returns the outcome: ok, failed (backend broke) or truncated."""
        tail = first[-64:]
        errored = sse and _SSE_ERROR in first
        try:
            if first:
                await resp.write(first)
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    await self._stream_error(resp, t, rid, sse, counted, f"{type(e).__name__}: {e}")
                    return "failed"
                if not chunk:
                    break
                if sse and not errored and _SSE_ERROR in chunk:
                    errored = True  # vLLM's own error event (e.g. engine died): a failed request
                tail = (tail + chunk)[-64:]
                await resp.write(chunk)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
            self.counters.client_disconnects += 1
            log.info("client_disconnected", request_id=rid, generation=t.generation)
            raise
        truncated = sse and b"[DONE]" not in tail
        if up.status >= 500 or truncated or errored:
            if counted:
                self.counters.failed_requests += 1
            log.warning("request_failed", request_id=rid, generation=t.generation, status=up.status,
                        truncated=truncated, error_event=errored)
            return "truncated" if truncated else "failed"
        if counted:
            self.counters.completed += 1
            t.completed += 1
        return "ok"

    async def _stream_error(
        self, resp: web.StreamResponse, t: Target, rid: str, sse: bool, counted: bool, error: str
    ) -> None:
        """The backend broke mid-stream: the client gets a final SSE error event, never a hang."""
        if counted:
            self.counters.failed_requests += 1
        log.warning("request_failed", request_id=rid, generation=t.generation, error=error, streaming=True)
        self.on_error(t)
        if sse:
            event = {"error": {"message": f"backend generation {t.generation} failed: {error}",
                               "type": "vllm_guard_backend_failure", "code": 502}}
            try:
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await resp.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                pass
