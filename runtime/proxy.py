"""The streaming reverse proxy on the public port: admission, queueing, retry and accounting.

Why a proxy and not a handed-over listening socket: recycling with zero failed requests needs a
place where a request can wait while no backend serves, be retried when a backend died before
answering, and be counted against `max_requests` exactly. The proxy holds back the response
headers until the backend's first body bytes arrive, so "nothing has reached the client yet"
is a fact it knows, not a guess. SSE is passed through chunk by chunk.

Bounded, because the port is public: only vLLM's public inference API is forwarded (`routes`);
a body is refused (413) before it is read when it is declared too large, and bodies buffered at
once stay under a budget; connections are capped and slow ones dropped (`gate`). A client that
leaves cancels its request at whatever stage it is (queued, waiting for the first byte,
streaming): the backend connection is closed, so vLLM aborts it. A request is retried once, and
only before any byte reached its client. Only requests that reached the engine count toward a
generation's limit: a 4xx from vLLM, a retry's failed attempt, a rejection do not.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import structlog
from aiohttp import web

from vllm_guard.core import vllm_api
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import LatencySummary

from . import routes
from .gate import Gate, connection_cap
from .router import Router
from .triggers import limit_reached

log = structlog.get_logger("vllm_guard.proxy")

_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
}
# Bodies of a backend whose engine died; a request that got only this has reached no client.
_SSE_ERROR = b'data: {"error"'
_ENGINE_DEAD_MARKERS = (b"EngineDeadError", b"EngineCore encountered an issue", b"Engine loop has died")
_CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError, BrokenPipeError)

MAX_ATTEMPTS = 2  # a request whose backend failed before answering is tried once more, never again
RETRY_HOLDOFF_S = 5.0  # the retry waits this long for another generation before trying the same one
MB = 1 << 20
DISCARD_MAX = 64 << 10  # a refused (404/405) request's body up to this is read and dropped, not left unread
DISCARD_WAIT_S = 2.0


class Reject(Exception):
    """No backend can take the request in time: 503 with Retry-After."""


class Retry(Exception):
    """The backend failed before any byte reached the client: try the next generation."""


class Refused(Exception):
    """Answered by the proxy itself before any backend was involved (413, 408, 503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Target:
    """One generation as the proxy sees it: where to send and what was sent."""

    generation: int
    url: str  # http://host:port, or core.vllm_api.unix_url(socket) for a backend on a Unix socket
    limit: int | None = None  # requests arriving after ready this generation may take; None: no limit
    accepting: bool = True
    dead: bool = False
    limit_closed: bool = False  # stopped accepting because the limit was reached (reopens if a count is undone)
    dispatched: int = 0  # counted requests sent to this generation
    inherited: int = 0  # of those: waiting before it was ready (its backlog; not toward the limit)
    completed: int = 0
    in_flight: int = 0
    ready_at: float | None = None  # monotonic; set when it opens
    session: aiohttp.ClientSession | None = None
    base: str = ""  # what request paths are appended to
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def toward_limit(self) -> int:
        return self.dispatched - self.inherited

    def open(self, request_timeout: float) -> None:
        self.ready_at = time.monotonic()
        sock = vllm_api.unix_socket_of(self.url)
        connector: aiohttp.BaseConnector = (aiohttp.UnixConnector(path=sock, limit=0) if sock
                                            else aiohttp.TCPConnector(limit=0, force_close=False))
        self.base = "http://localhost" if sock else self.url
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=request_timeout, connect=10),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


@dataclass(eq=False)
class Ticket:
    """One admitted attempt of a request at a target; `counted` until the count is undone."""

    target: Target
    counted: bool
    inherited: bool


@dataclass(eq=False)
class Flight:
    """One request through the proxy: what the logs and the disconnect accounting need."""

    rid: str
    t0: float
    counted: bool
    stage: str = "reading body"
    gone: bool = False  # the client left (counted once)


@dataclass
class Counters:
    requests_total: int = 0  # engine requests received (the only ones that can count)
    completed: int = 0
    failed_requests: int = 0
    rejected: int = 0  # subset of failed: 503 from the queue
    retried: int = 0
    client_disconnects: int = 0
    not_forwarded: int = 0  # answered by the proxy itself: not in the API (404/405), too large (413), too slow (408)
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
        self.max_body = int(cfg.max_body_mb * MB)
        self.body_budget = int(cfg.body_buffer_mb * MB)
        self.body_bytes = 0  # request bodies buffered now (queued and in flight)
        self.gate = Gate(connection_cap(cfg.max_connections), cfg.header_timeout, cfg.retry_after,
                         cap_of=lambda: connection_cap(cfg.max_connections))
        self._cond = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._idle_since = time.monotonic()

    # -- control (called by the supervisor) -------------------------------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect)
        # handler_cancellation: a client that disconnects cancels its handler, wherever it waits.
        # lingering_time 0: an unread (refused) body is never drained, the connection is closed.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     keepalive_timeout=self.cfg.idle_timeout, lingering_time=0)
        await self._runner.setup()
        inner = self._runner.server
        assert inner is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.gate.factory(inner), self.cfg.host, self.cfg.port,
                                                reuse_address=True, backlog=2048)
        log.info("proxy_listening", host=self.cfg.host, port=self.cfg.port, max_connections=self.gate.cap,
                 max_body_mb=self.cfg.max_body_mb, header_timeout_s=self.cfg.header_timeout,
                 idle_timeout_s=self.cfg.idle_timeout)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.gate.close_all()

    @property
    def enforce_limit(self) -> bool:
        """False while held: no recycle can follow, so a generation never stops at its limit."""
        return self.router.enforce_limit

    @enforce_limit.setter
    def enforce_limit(self, value: bool) -> None:
        self.router.enforce_limit = value

    async def set_target(self, target: Target | None) -> None:
        """Dispatch to `target` only from now on (None: queue everything)."""
        self.router.replace(target)
        await self._wake()

    async def add_target(self, target: Target, replica: int = 0) -> None:
        """Dispatch to `target` too (another replica, or the successor of a generation)."""
        self.router.add(target, replica)
        await self._wake()

    async def stop_dispatch(self, target: Target, dead: bool = False) -> None:
        target.limit_closed = False  # the supervisor decides from here on
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
    def _pick(self, counted: bool, arrived: float, avoid: Target | None, avoid_until: float) -> Ticket | None:
        picked = self.router.pick(counted, arrived, avoid, avoid_until)
        if picked is None:
            return None
        self.in_flight += 1
        return Ticket(picked[0], counted, picked[1])

    async def _admit(self, f: Flight, deadline: float, avoid: Target | None = None,
                     avoid_until: float = 0.0) -> Ticket:
        ticket = self._pick(f.counted, f.t0, avoid, avoid_until) if self.reject_reason is None else None
        if ticket is not None:
            return ticket
        if self.reject_reason is not None:
            raise Reject(self.reject_reason)
        if self.queued >= self.cfg.queue_size:
            raise Reject(f"queue full ({self.cfg.queue_size} waiting)")
        self.queued += 1
        self.counters.max_queued = max(self.counters.max_queued, self.queued)
        f.stage = "queued"
        try:
            async with self._cond:
                while True:
                    if self.reject_reason is not None:
                        raise Reject(self.reject_reason)
                    ticket = self._pick(f.counted, f.t0, avoid, avoid_until)
                    if ticket is not None:
                        return ticket
                    now = time.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        raise Reject("no backend became ready within the queue's max wait")
                    if avoid is not None and now < avoid_until:
                        remaining = min(remaining, avoid_until - now + 0.01)
                    try:
                        await asyncio.wait_for(self._cond.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.queued -= 1

    def _release(self, ticket: Ticket) -> None:
        self.router.release(ticket.target)
        self.in_flight -= 1
        if not self.in_flight:
            self._idle_since = time.monotonic()

    async def _uncount(self, ticket: Ticket) -> None:
        """The request did not reach the engine here (a 4xx, a failed attempt): undo its count,
        and take requests again if the count was what closed the generation."""
        if not ticket.counted:
            return
        ticket.counted = False
        t = ticket.target
        t.dispatched -= 1
        if ticket.inherited:
            t.inherited -= 1
        if t.limit_closed and not limit_reached(t.toward_limit, t.limit):
            t.limit_closed = False
            t.accepting = True
            await self._wake()

    # -- the request path --------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        f = Flight(rid=routes.request_id(request.headers.get("X-Request-Id")), t0=time.monotonic(), counted=False)
        conn = self.gate.of(request.transport)
        if conn is not None:
            conn.started()
        try:
            return await self._handle(request, f)
        except asyncio.CancelledError:  # the client disconnected (aiohttp cancels the handler)
            self._client_gone(f)
            raise
        finally:
            if conn is not None:
                conn.ended()

    async def _discard(self, request: web.Request) -> bool:
        """Read and drop a refused request's body when it is small and comes at once, so the
        client, still sending it, reads the answer instead of a reset. False: left unread."""
        if (request.content_length or 0) > DISCARD_MAX:
            return False
        seen = 0
        try:
            while seen <= DISCARD_MAX:
                chunk = await asyncio.wait_for(request.content.readany(), DISCARD_WAIT_S)
                if not chunk:
                    return True
                seen += len(chunk)
        except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError):
            pass
        return False

    def _client_gone(self, f: Flight, generation: int | None = None) -> None:
        if not f.gone:
            f.gone = True
            self.counters.client_disconnects += 1
            log.info("client_disconnected", request_id=f.rid, stage=f.stage, generation=generation)

    async def _handle(self, request: web.Request, f: Flight) -> web.StreamResponse:
        try:
            kind = routes.classify(request.method, request.path)
        except routes.NotAllowed as e:
            self.counters.not_forwarded += 1
            resp = self._answer(f.rid, e.status, str(e))
            if request.can_read_body and not await self._discard(request):
                resp.force_close()  # a body left unread: the connection closes after the answer
            return resp
        f.counted = kind is routes.Kind.ENGINE
        if f.counted:
            self.counters.requests_total += 1
        try:
            body, held = await self._read_body(request)
        except Refused as e:
            self.counters.not_forwarded += 1
            resp = self._fail(f.rid, e.status, str(e), f.counted)
            if e.status == 503:
                resp.headers["Retry-After"] = str(self.cfg.retry_after)
            resp.force_close()
            return resp
        try:
            return await self._dispatch(request, body, f)
        finally:
            self.body_bytes -= held

    async def _read_body(self, request: web.Request) -> tuple[bytes, int]:
        """The whole body, at most max_body bytes, each read within idle_timeout; Refused else.
        Returns it with the bytes it holds of the body budget (the caller gives them back)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise Refused(413, f"request body of {declared} bytes is larger than {self.max_body} "
                               f"([server] max_body_mb)")
        held = declared or 0
        if self.body_bytes + held > self.body_budget:
            raise Refused(503, "the guard is holding too many request bodies: retry later")
        self.body_bytes += held
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(request.content.readany(), self.cfg.idle_timeout)
                except asyncio.TimeoutError as e:
                    raise Refused(408, f"request body stalled for {self.cfg.idle_timeout:g} s") from e
                if not chunk:
                    return bytes(buf), held
                if len(buf) + len(chunk) > self.max_body:
                    raise Refused(413, f"request body larger than {self.max_body} bytes ([server] max_body_mb)")
                buf += chunk
                if len(buf) > held:  # no (or a wrong) Content-Length: grow the reservation as it comes
                    if self.body_bytes + len(buf) - held > self.body_budget:
                        raise Refused(503, "the guard is holding too many request bodies: retry later")
                    self.body_bytes += len(buf) - held
                    held = len(buf)
        except BaseException:  # refused, or the client left: give the reservation back
            self.body_bytes -= held
            raise

    async def _dispatch(self, request: web.Request, body: bytes, f: Flight) -> web.StreamResponse:
        deadline = f.t0 + self.cfg.queue_max_wait
        avoid: Target | None = None
        avoid_until = 0.0
        attempt = 0
        while True:
            attempt += 1
            try:
                ticket = await self._admit(f, deadline, avoid, avoid_until)
            except Reject as e:
                return self._reject(f.rid, str(e), f.counted)
            t = ticket.target
            try:
                return await self._forward(request, ticket, body, f)
            except Retry as e:
                await self._uncount(ticket)
                self.on_error(t)
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    log.warning("request_failed", request_id=f.rid, generation=t.generation, attempts=attempt,
                                error=str(e))
                    return self._fail(f.rid, 502, f"the backend failed before answering, {attempt} times: {e}",
                                      f.counted)
                self.counters.retried += 1
                log.info("request_retry", request_id=f.rid, generation=t.generation, attempt=attempt, error=str(e))
                avoid, avoid_until = t, time.monotonic() + RETRY_HOLDOFF_S
            finally:
                self._release(ticket)

    def _reject(self, rid: str, reason: str, counted: bool) -> web.Response:
        self.counters.rejected += 1
        log.warning("request_rejected", request_id=rid, reason=reason)
        resp = self._fail(rid, 503, reason, counted)
        resp.headers["Retry-After"] = str(self.cfg.retry_after)
        return resp

    def _fail(self, rid: str, status: int, message: str, counted: bool) -> web.Response:
        if counted:
            self.counters.failed_requests += 1
        return self._answer(rid, status, message)

    @staticmethod
    def _answer(rid: str, status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "vllm_guard", "code": status}}
        return web.json_response(body, status=status, headers={"X-Request-Id": rid})

    async def _forward(self, request: web.Request, ticket: Ticket, body: bytes, f: Flight) -> web.StreamResponse:
        t = ticket.target
        assert t.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = f.rid
        f.stage = "waiting for the first byte"
        try:
            # Cancelled here (the client left), aiohttp closes the backend connection: vLLM aborts.
            up = await t.session.request(request.method, t.base + request.path_qs, data=body, headers=headers,
                                         allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise Retry(f"{type(e).__name__}: {e}") from e
        try:
            try:
                first = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise Retry(f"{type(e).__name__} before the first byte: {e}") from e
            if self._engine_dead(up.status, first):
                raise Retry(f"engine dead (HTTP {up.status})")
            if 400 <= up.status < 500:
                await self._uncount(ticket)  # refused by the API server: never reached the engine
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            resp.headers["X-Request-Id"] = f.rid
            resp.headers["X-Vllm-Guard-Generation"] = str(t.generation)
            sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
            if up.content_length is not None and not sse:
                resp.content_length = up.content_length
            f.stage = "streaming"
            await resp.prepare(request)
            ttft = time.monotonic() - f.t0
            self.ttft.append(ttft)
            outcome = await self._stream(resp, up, first, ticket, f, sse)
            if self.cfg.access_log:
                log.info("request", request_id=f.rid, generation=t.generation, method=request.method,
                         path=request.path, status=up.status, outcome=outcome, ttft_ms=round(ttft * 1000, 2),
                         e2e_ms=round((time.monotonic() - f.t0) * 1000, 2))
            return resp
        except BaseException:
            up.close()  # anything unfinished: drop the backend connection, so vLLM stops the request
            raise
        finally:
            up.release()

    @staticmethod
    def _engine_dead(status: int, first: bytes) -> bool:
        if status >= 500 or first.startswith(b"data: {\"error\""):
            return any(m in first for m in _ENGINE_DEAD_MARKERS)
        return False

    async def _stream(self, resp: web.StreamResponse, up: aiohttp.ClientResponse, first: bytes, ticket: Ticket,
                      f: Flight, sse: bool) -> str:
        """Pass the body through; returns the outcome: ok, failed (backend broke), truncated,
        or client_gone."""
        t = ticket.target
        tail = first[-64:]
        errored = sse and _SSE_ERROR in first
        try:
            if first:
                await resp.write(first)
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    await self._stream_error(resp, t, f, sse, f"{type(e).__name__}: {e}")
                    return "failed"
                if not chunk:
                    break
                if sse and not errored and _SSE_ERROR in chunk:
                    errored = True  # vLLM's own error event (e.g. engine died): a failed request
                tail = (tail + chunk)[-64:]
                await resp.write(chunk)
            await resp.write_eof()
        except _CLIENT_GONE:
            up.close()
            self._client_gone(f, t.generation)
            return "client_gone"
        truncated = sse and b"[DONE]" not in tail
        if up.status >= 500 or truncated or errored:
            if f.counted:
                self.counters.failed_requests += 1
            log.warning("request_failed", request_id=f.rid, generation=t.generation, status=up.status,
                        truncated=truncated, error_event=errored)
            return "truncated" if truncated else "failed"
        if ticket.counted:
            self.counters.completed += 1
            t.completed += 1
        return "ok"

    async def _stream_error(self, resp: web.StreamResponse, t: Target, f: Flight, sse: bool, error: str) -> None:
        """The backend broke mid-stream: the client gets a final SSE error event, never a hang."""
        if f.counted:
            self.counters.failed_requests += 1
        log.warning("request_failed", request_id=f.rid, generation=t.generation, error=error, streaming=True)
        self.on_error(t)
        if sse:
            event = {"error": {"message": f"backend generation {t.generation} failed: {error}",
                               "type": "vllm_guard_backend_failure", "code": 502}}
            try:
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await resp.write_eof()
            except _CLIENT_GONE:
                pass


async def _no_expect(_: web.Request) -> None:
    """`Expect: 100-continue` is answered by the handler, after the route and size checks, so a
    refused body is never sent."""
    return None
