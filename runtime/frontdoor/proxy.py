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
streaming): the backend connection is closed, so vLLM aborts it; a client connection lost in the
middle of a request (a half-close, a reset) is one `client_disconnected` line, never a traceback.
Only requests that reached the engine count toward a generation's limit: a 4xx from vLLM, a
retry's failed attempt, a rejection do not.

Admission (`admission`): each client request is bounded once, after its body is read and before
it is queued (n, max_tokens, the tokens it asks for, what its client has in flight); a request
that moves to another generation never passes it again. Every request ends in one `RequestDone`
(`done`), from which the outcome counters are derived.

A request whose backend dies under it moves to another generation, up to `migration_limit`
times: one that got no byte yet is sent again whole; a stream of completions or chat that can
be resumed goes on from its last token as a continuation (`resume`, `stitch`); the others end
with one error. A move never goes back to a generation that failed it with a dead engine, and
never waits behind newly arrived requests.

It also answers a load balancer's and a kubelet's checks itself (`routes.PROBES`): readiness is
200 only while some generation takes new requests now and is not about to stop (`Target.leaving`,
set `[server] unready_lead` before a recycle leaves a gap), so a balancer moves traffic to other
boxes before requests would wait here; liveness is 200 while the supervisor's loop beats.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import structlog
from aiohttp import web

from vllm_guard.core import sse, vllm_api
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import FailReason, LatencySummary, RejectReason

from . import detok, resume, routes
from .admission import Admission, Limits, Pass, Refusal
from .conncap import Gate, connection_cap
from .done import USAGE_TAIL, Cause, Counters, Listener, Outcome, RequestDone, usage_of
from .target import Target, Ticket
from .router import Router
from .stitch import NotResumable, Stream, error_event
from ..child import tiny_model

log = structlog.get_logger("vllm_guard.proxy")

_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
}
_SSE_ERROR = b'data: {"error"'
_CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError, BrokenPipeError)
# the error's `type` in OpenAI's shape, by status
_ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               502: "backend_error", 503: "service_unavailable"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)

# A retry after a dropped connection waits this long for another generation before it may try
# the same one again (a generation that answered "engine dead" is never tried again).
RETRY_HOLDOFF_S = 5.0
MB = 1 << 20
DISCARD_MAX = 64 << 10  # a refused (404/405) request's body up to this is read and dropped, not left unread
DISCARD_WAIT_S = 2.0
RELAY_BATCH = 64  # events of one read handled between two turns of the loop (a resumable stream)
# Liveness turns 503 when the supervisor loop has not beaten for this long. Half of systemd's
# default WatchdogSec (60 s), the interval at which the loop pings WATCHDOG=1: the endpoint calls a
# frozen loop dead no later than systemd would, and a kubelet checking every 10 s with 3 failures
# restarts it about when systemd would (30 + 30 s). A healthy turn takes milliseconds (5 s is
# logged as slow), so a loaded box stays far below it.
LIVENESS_STALE_S = 30.0


class Reject(Exception):
    """No backend can take the request in time: 503 with Retry-After."""

    def __init__(self, message: str, cause: Cause) -> None:
        super().__init__(message)
        self.cause = cause


class Retry(Exception):
    """The backend failed before any byte reached the client: try the next generation.
    `dead`: it answered that its engine is dead, or refused the connection (never again)."""

    def __init__(self, message: str, dead: bool = False) -> None:
        super().__init__(message)
        self.dead = dead


class Died(Exception):
    """A resumable stream's backend died after bytes of it reached the client (`resp`)."""

    def __init__(self, message: str, resp: web.StreamResponse) -> None:
        super().__init__(message)
        self.resp = resp


class Refused(Exception):
    """Answered by the proxy itself before any backend was involved (413, 408, 503)."""

    def __init__(self, status: int, message: str, cause: RejectReason) -> None:
        super().__init__(message)
        self.status = status
        self.cause = cause


@dataclass(eq=False)
class Flight:
    """One request through the proxy: what the logs, the disconnect accounting and its
    `RequestDone` record need."""

    rid: str
    t0: float
    counted: bool
    stage: str = "reading body"
    gone: bool = False  # the client left (counted once)
    arrived: float = field(default_factory=time.time)  # wall clock, for records
    outcome: Outcome | None = None  # set once, by the path that ends it
    status: int = 0
    reason: str = ""
    cause: Cause | None = None
    first_sent: float | None = None  # monotonic: its first body bytes went to the client
    last_sent: float | None = None
    max_gap_s: float | None = None
    chunks: int = 0
    stream: bool = False
    generation: int | None = None
    replica: int | None = None
    resumed: int = 0  # continuations: times it went on at another generation
    moves: int = 0  # re-dispatches after a backend failed it (retries and continuations)
    unresumable: str | None = None  # why its stream could not go on elsewhere (for the error)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def at(self, stage: str) -> None:
        self.stage = stage

    def count(self, counted: bool) -> None:
        self.counted = counted

    def leaves(self) -> bool:
        """The client left; True the first time (it is counted once)."""
        first, self.gone = not self.gone, True
        return first

    def tokens(self, prompt: int | None, completion: int | None) -> None:
        """vLLM's usage record of the answer, when it carried one."""
        self.prompt_tokens, self.completion_tokens = prompt, completion

    def answered_by(self, generation: int, replica: int, stream: bool) -> None:
        self.generation, self.replica, self.stream = generation, replica, stream

    def not_resumable(self, why: str) -> None:
        self.unresumable = why

    def moved(self, resumed: bool) -> bool:
        """It moves to another generation (a re-send, or a continuation when `resumed`); True
        the first time it is resumed (the streams resumed are counted once)."""
        self.moves += 1
        if resumed:
            self.resumed += 1
        return resumed and self.resumed == 1

    def end(self, outcome: Outcome, status: int, reason: str = "", cause: Cause | None = None) -> None:
        """The first path to end the request decides its outcome (and, rejected or failed, its cause)."""
        if self.outcome is None:
            self.outcome, self.status, self.reason, self.cause = outcome, status, reason, cause

    def sent(self, now: float) -> None:
        """A body chunk went to the client."""
        if self.first_sent is None:
            self.first_sent = now
        elif self.last_sent is not None:
            gap = now - self.last_sent
            self.max_gap_s = gap if self.max_gap_s is None else max(self.max_gap_s, gap)
        self.last_sent = now
        self.chunks += 1

    def record(self, now: float) -> RequestDone:
        return RequestDone(
            request_id=self.rid, counted=self.counted, outcome=self.outcome or Outcome.CLIENT_DISCONNECTED,
            status=self.status, reason=self.reason, arrived=self.arrived, e2e_s=now - self.t0,
            ttft_s=None if self.first_sent is None else self.first_sent - self.t0, generation=self.generation,
            replica=self.replica, chunks=self.chunks, max_gap_s=self.max_gap_s, stream=self.stream,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, resumed=self.resumed,
            cause=self.cause)


@dataclass(eq=False)
class Move:
    """Where a request whose backend failed may go next."""

    exclude: set[Target] = field(default_factory=set)  # failed it with a dead engine: never again
    avoid: Target | None = None  # dropped its connection: not before avoid_until
    avoid_until: float = 0.0


class Proxy:
    def __init__(self, cfg: ServerConfig, on_limit: Callable[[Target], None], on_error: Callable[[Target], None]):
        self.cfg = cfg
        self.on_limit = on_limit
        self.on_error = on_error
        self.router = Router(on_limit)  # which target takes a request (runtime/frontdoor/router.py)
        self.reject_reason: str | None = None  # held or shutting down: fail fast
        self.queued = 0
        self.in_flight = 0
        self.counters = Counters()  # outcomes derived from the RequestDone records (`_done`)
        self.admission = Admission(Limits.of(cfg, os.environ))  # vLLM's keys: its args, else the runtime's env
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
        self.listeners: list[Listener] = []  # told of every request once it ended (`done`)
        self._beat = time.monotonic()  # the supervisor loop's last turn (`beat`)
        # Streams are resumed with the model's tokenizer (detok.py); loaded at start, off the loop.
        self.facts = detok.facts_of(cfg.model or str(tiny_model.default_dir()), cfg.vllm_args)
        self.tokenizer: Any = None
        self.tokenizer_why = "the guard's tokenizer is still loading"
        self._moving: list[Move] = []  # requests waiting to move: they go before new admissions
        self._tasks: list[asyncio.Task[None]] = []
        # each generation's context length, read from its /v1/models when a continuation needs it
        self._model_len: weakref.WeakKeyDictionary[Target, int] = weakref.WeakKeyDictionary()

    # -- control (called by the supervisor) -------------------------------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect)
        # handler_cancellation: a client that disconnects cancels its handler, wherever it waits.
        # lingering_time 0: an unread (refused) body is never drained, the connection is closed.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     keepalive_timeout=self.cfg.idle_timeout, lingering_time=0)
        await self._runner.setup()
        self._beat = time.monotonic()  # alive from the start: the loop begins right after
        inner = self._runner.server
        assert inner is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.gate.factory(inner), self.cfg.host, self.cfg.port,
                                                reuse_address=True, backlog=2048)
        log.info("proxy_listening", host=self.cfg.host, port=self.cfg.port, max_connections=self.gate.cap,
                 max_body_mb=self.cfg.max_body_mb, header_timeout_s=self.cfg.header_timeout,
                 idle_timeout_s=self.cfg.idle_timeout)
        self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    async def _load_tokenizer(self) -> None:
        tok, why = await asyncio.to_thread(detok.load, self.facts)
        self.tokenizer, self.tokenizer_why = tok, why
        if tok is None:
            log.warning("stream_resumption_off", tokenizer=self.facts.tokenizer, reason=why,
                        detail="streams cut by a dead backend end with an error; requests that got no byte are re-run")
        else:
            log.info("stream_resumption_on", tokenizer=self.facts.tokenizer, migration_limit=self.cfg.migration_limit)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
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
        self.router.stop(target, dead)  # the supervisor decides from here on
        await self._wake()

    async def allow_past_limit(self, target: Target, allowed: bool = True) -> None:
        """Let `target` take requests past its count limit (its successor starts beside it, or
        its recycle waits for its turn): nothing queues because of the limit."""
        self.router.allow_past_limit(target, allowed)
        await self._wake()

    def queue_mark(self) -> int:
        """The queue's high-water mark since the last call; it starts again from now."""
        mark, self.counters.max_queued = self.counters.max_queued, self.queued
        return mark

    async def wake_waiters(self) -> None:
        """The router's targets changed (e.g. one may accept again): queued requests look again."""
        await self._wake()

    async def set_reject(self, reason: str | None) -> None:
        self.reject_reason = reason
        await self._wake()

    def set_leaving(self, target: Target, leaving: bool = True) -> None:
        """`target` stops soon (or not any more): it still takes requests, but readiness no longer
        counts it and the router prefers any other target."""
        if target.leaving != leaving:
            target.mark_leaving(leaving)
            log.info("target_leaving" if leaving else "target_staying", generation=target.generation)

    def beat(self) -> None:
        """The supervisor loop turned (once per turn): what liveness reports."""
        self._beat = time.monotonic()

    # -- the guard's own checks (routes.PROBES) ----------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """May a load balancer send a new request now, and why (not)."""
        if self.reject_reason is not None:
            return False, self.reject_reason
        open_ = self.router.accepting()
        if not open_:
            return False, "no generation takes requests now (starting, recycling or backing off)"
        staying = [t for t in open_ if not t.leaving]
        if not staying:
            return False, "every generation that takes requests stops soon (a recycle follows)"
        return True, f"{len(staying)} generation(s) take requests"

    def liveness(self, now: float | None = None) -> tuple[bool, float]:
        """Whether the supervisor loop beat within LIVENESS_STALE_S, and how long ago it did."""
        age = (time.monotonic() if now is None else now) - self._beat
        return age < LIVENESS_STALE_S, age

    def _probe(self, path: str, f: Flight) -> web.Response:
        if path.rstrip("/") == routes.READY_PATH:
            ok, reason = self.readiness()
            body: dict[str, object] = {"ready": ok, "reason": reason}
        else:
            ok, age = self.liveness()
            reason = "" if ok else f"the supervisor loop has not turned for {age:.1f} s"
            body = {"alive": ok, "last_beat_s": round(age, 3), "stale_after_s": LIVENESS_STALE_S}
        status = 200 if ok else 503
        f.end(Outcome.COMPLETED if ok else Outcome.REJECTED, status, "" if ok else reason)
        return web.json_response(body, status=status, headers={"X-Request-Id": f.rid, "Cache-Control": "no-store"})

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
    def _pick(self, counted: bool, arrived: float, move: Move | None) -> Ticket | None:
        if move is None and any(self.router.could_pick(m.avoid, m.avoid_until, m.exclude) for m in self._moving):
            return None  # a request moving from a dead backend takes it first
        if move is None:
            picked = self.router.pick(counted, arrived)
        else:
            picked = self.router.pick(counted, arrived, move.avoid, move.avoid_until, move.exclude)
        if picked is None:
            return None
        self.in_flight += 1
        route = self.router.route(picked[0])
        return Ticket(picked[0], counted, picked[1], route.replica if route is not None else 0)

    async def _admit(self, f: Flight, deadline: float, move: Move | None = None) -> Ticket:
        """A target for the request, waiting (bounded) while none is open. `move`: it is moving
        from a backend that failed it; it goes before requests that did not."""
        ticket = self._pick(f.counted, f.t0, move) if self.reject_reason is None else None
        if ticket is not None:
            return ticket
        if self.reject_reason is not None:
            raise Reject(self.reject_reason, RejectReason.UNAVAILABLE)
        if self.queued >= self.cfg.queue_size and move is None:
            raise Reject(f"queue full ({self.cfg.queue_size} waiting)", FailReason.QUEUE_FULL)
        self.queued += 1
        self.counters.max_queued = max(self.counters.max_queued, self.queued)
        f.at("queued" if move is None else "waiting to move")
        if move is not None:
            self._moving.append(move)
        try:
            async with self._cond:
                while True:
                    if self.reject_reason is not None:
                        raise Reject(self.reject_reason, RejectReason.UNAVAILABLE)
                    ticket = self._pick(f.counted, f.t0, move)
                    if ticket is not None:
                        if move is not None:
                            self._moving.remove(move)
                            self._cond.notify_all()  # new requests it held back look again
                        return ticket
                    now = time.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        raise Reject("no backend became ready within the queue's max wait",
                                     FailReason.QUEUE_TIMEOUT)
                    if move is not None and move.avoid is not None and now < move.avoid_until:
                        remaining = min(remaining, move.avoid_until - now + 0.01)
                    try:
                        await asyncio.wait_for(self._cond.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.queued -= 1
            if move is not None and move in self._moving:  # it gave up (or its client left)
                self._moving.remove(move)
                self._tasks.append(asyncio.ensure_future(self._wake()))  # what it held back looks again
                self._tasks = [t for t in self._tasks if not t.done()]

    def _release(self, ticket: Ticket) -> None:
        self.router.release(ticket.target)
        self.in_flight -= 1
        if not self.in_flight:
            self._idle_since = time.monotonic()

    async def _uncount(self, ticket: Ticket) -> None:
        """The request did not reach the engine here (a 4xx, a failed attempt): undo its count,
        and take requests again if the count was what closed the generation."""
        if ticket.uncount():
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
            self._client_gone(f, how="cancelled")
            raise
        except ConnectionError as e:
            # The client's connection was lost while its body was read or the answer written (a
            # half-close, a reset; asyncio.wait_for can turn the cancel into this error). Backend
            # errors never get here (they are retries or failed streams). Answered with a response
            # that is never written, so aiohttp logs no "Error handling request" traceback.
            transport = request.transport
            if transport is not None and not transport.is_closing():
                raise
            self._client_gone(f, how=f"{type(e).__name__}: {e}")
            return web.Response(status=499)
        finally:
            if conn is not None:
                conn.ended()
            self._done(f)

    def _done(self, f: Flight) -> None:
        """Count how the request ended and tell every listener (exactly once per request)."""
        record = f.record(time.monotonic())
        self.counters.add(record)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception as e:  # noqa: BLE001 - accounting must never fail a request
                log.warning("request_listener_failed", error=f"{type(e).__name__}: {e}")

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

    def _client_gone(self, f: Flight, generation: int | None = None, how: str = "") -> None:
        """The client went away: one log line per request, never a traceback."""
        f.end(Outcome.CLIENT_DISCONNECTED, f.status)
        if f.leaves():
            self.counters.connections_lost += 1
            log.info("client_disconnected", request_id=f.rid, stage=f.stage, generation=generation,
                     **({"how": how} if how else {}))

    async def _handle(self, request: web.Request, f: Flight) -> web.StreamResponse:
        try:
            kind = routes.classify(request.method, request.path)
        except routes.NotAllowed as e:
            resp = self._refuse(f, Refusal(e.status, RejectReason.NOT_SERVED, str(e)))
            if request.can_read_body and not await self._discard(request):
                resp.force_close()  # a body left unread: the connection closes after the answer
            return resp
        if kind is routes.Kind.PROBE:
            return self._probe(request.path, f)
        f.count(kind is routes.Kind.ENGINE)
        if f.counted:
            self.counters.requests_total += 1
        try:
            body, held = await self._read_body(request)
        except Refused as e:
            resp = self._refuse(f, Refusal(e.status, e.cause, str(e)))
            resp.force_close()
            return resp
        admitted: Pass | None = None
        try:
            if f.counted:  # once per client request: a retry or continuation inside _dispatch is not
                verdict = self.admission.admit(request.path, body, request.headers.get("Authorization"),
                                               request.remote)
                if isinstance(verdict, Refusal):
                    return self._refuse(f, verdict)
                admitted = verdict
            return await self._dispatch(request, body, f)
        finally:
            if admitted is not None:
                self.admission.release(admitted)
            self.body_bytes -= held

    async def _read_body(self, request: web.Request) -> tuple[bytes, int]:
        """The whole body, at most max_body bytes, each read within idle_timeout; Refused else.
        Returns it with the bytes it holds of the body budget (the caller gives them back)."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise Refused(413, f"request body of {declared} bytes is larger than {self.max_body} "
                               f"([server] max_body_mb)", RejectReason.BODY_TOO_LARGE)
        held = declared or 0
        if self.body_bytes + held > self.body_budget:
            raise Refused(503, "the guard is holding too many request bodies: retry later",
                          RejectReason.BODY_BUFFER_FULL)
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
                    raise Refused(408, f"request body stalled for {self.cfg.idle_timeout:g} s",
                                  RejectReason.BODY_STALLED) from e
                if not chunk:
                    return bytes(buf), held
                if len(buf) + len(chunk) > self.max_body:
                    raise Refused(413, f"request body larger than {self.max_body} bytes ([server] max_body_mb)",
                                  RejectReason.BODY_TOO_LARGE)
                buf += chunk
                if len(buf) > held:  # no (or a wrong) Content-Length: grow the reservation as it comes
                    if self.body_bytes + len(buf) - held > self.body_budget:
                        raise Refused(503, "the guard is holding too many request bodies: retry later",
                                      RejectReason.BODY_BUFFER_FULL)
                    self.body_bytes += len(buf) - held
                    held = len(buf)
        except BaseException:  # refused, or the client left: give the reservation back
            self.body_bytes -= held
            raise

    async def _dispatch(self, request: web.Request, body: bytes, f: Flight) -> web.StreamResponse:
        """Send the request to a backend, and again to another one as often as a backend fails it
        (`migration_limit`): whole while nothing reached the client, else as a continuation."""
        planned = resume.plan(request.path, body, self.facts, self.tokenizer is not None) \
            if f.counted and request.method == "POST" else None
        stream: Stream | None = None
        if isinstance(planned, resume.Plan):
            stream, body = Stream(planned, self.tokenizer), planned.body
        elif isinstance(planned, str):
            f.not_resumable(planned)
        deadline = f.t0 + self.cfg.queue_max_wait
        move: Move | None = None
        resp: web.StreamResponse | None = None  # once the client has bytes: the response they went to
        while True:
            try:
                ticket = await self._admit(f, deadline, move)
            except Reject as e:
                if resp is not None and stream is not None:
                    return await self._give_up(resp, stream, f, f"it could not be resumed: {e}")
                # held or shutting down is the operator's choice; a full queue or its wait is a failure
                f.end(Outcome.REJECTED if isinstance(e.cause, RejectReason) else Outcome.FAILED, 503, str(e),
                      e.cause)
                log.warning("request_rejected", request_id=f.rid, reason=str(e), cause=e.cause.value)
                return self._answer(f.rid, 503, str(e), e.cause.value, retry_after=self.cfg.retry_after)
            t = ticket.target
            try:
                if resp is None:
                    return await self._forward(request, ticket, body, f, stream)
                assert stream is not None
                await self._continue(resp, ticket, stream, f, request.headers)
                return resp
            except Retry as e:
                await self._uncount(ticket)
                self.on_error(t)
                move = move or Move()
                if e.dead:
                    move.exclude.add(t)
                else:
                    move.avoid, move.avoid_until = t, time.monotonic() + RETRY_HOLDOFF_S
                if f.moves >= self.cfg.migration_limit:
                    log.warning("request_failed", request_id=f.rid, generation=t.generation, moves=f.moves,
                                error=str(e))
                    if resp is not None and stream is not None:
                        return await self._give_up(resp, stream, f, f"its continuation failed too: {e}")
                    f.end(Outcome.FAILED, 502, f"backend failed before answering: {e}", FailReason.BACKEND_ERROR)
                    return self._answer(f.rid, 502, f"the backend failed before answering, {f.moves + 1} times: {e}",
                                        FailReason.BACKEND_ERROR.value)
                f.moved(resumed=False)
                if resp is None:
                    self.counters.retried += 1
                log.info("request_retry", request_id=f.rid, generation=t.generation, move=f.moves, error=str(e),
                         continuation=resp is not None)
                deadline = time.monotonic() + self.cfg.queue_max_wait
            except Died as e:
                assert stream is not None
                resp = e.resp
                self.on_error(t)
                move = move or Move()
                move.exclude.add(t)
                why = stream.resumable() or (f"it moved {f.moves} times ([server] migration_limit)"
                                             if f.moves >= self.cfg.migration_limit else None)
                if why is not None:
                    return await self._give_up(resp, stream, f, f"it cannot be resumed: {why}",
                                               generation=t.generation, error=str(e))
                try:
                    stream.seam()
                except NotResumable as nr:
                    return await self._give_up(resp, stream, f, f"it cannot be resumed: {nr}",
                                               generation=t.generation, error=str(e))
                if f.moved(resumed=True):
                    self.counters.resumed += 1
                log.info("request_resuming", request_id=f.rid, generation=t.generation, move=f.moves,
                         generated=len(stream.gen), error=str(e))
                deadline = time.monotonic() + self.cfg.queue_max_wait
            finally:
                self._release(ticket)

    async def _give_up(self, resp: web.StreamResponse, stream: Stream, f: Flight, why: str,
                       generation: int | None = None, error: str = "", cut: bool = True) -> web.StreamResponse:
        """A stream that cannot go on: its client gets one error event, then [DONE]. `cut`: its
        backend died under it (counted as unresumable)."""
        if cut:
            self.counters.unresumable += 1
        msg = f"the backend failed mid-stream{f' (generation {generation})' if generation else ''} and {why}"
        f.end(Outcome.FAILED, resp.status, msg, FailReason.UNRESUMABLE if cut else FailReason.BACKEND_BROKE)
        log.warning("request_failed", request_id=f.rid, generation=generation, streaming=True, error=error,
                    reason=why)
        self._tokens_of(stream, f)
        try:
            await resp.write(error_event(msg) + sse.DONE)
            await resp.write_eof()
        except _CLIENT_GONE:
            self._client_gone(f, generation)
        return resp

    @staticmethod
    def _tokens_of(stream: Stream, f: Flight) -> None:
        if stream.prompt_ids is not None:
            f.tokens(len(stream.prompt_ids), len(stream.gen))

    def _refuse(self, f: Flight, r: Refusal) -> web.Response:
        """Answer a request the front door refused (route, body, admission): rejected, with its reason."""
        f.end(Outcome.REJECTED, r.status, r.message, r.reason)
        if r.reason is not RejectReason.NOT_SERVED:
            log.info("request_refused", request_id=f.rid, status=r.status, cause=r.reason.value, reason=r.message)
        retry = self.cfg.retry_after if r.status in (429, 503) else None
        return self._answer(f.rid, r.status, r.message, r.reason.value, r.param, retry)

    @staticmethod
    def _answer(rid: str, status: int, message: str, code: str, param: str | None = None,
                retry_after: int | None = None) -> web.Response:
        """One error in OpenAI's shape: `code` says which bound or failure, `param` which field."""
        body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "vllm_guard_error"),
                          "param": param, "code": code}}
        headers = {"X-Request-Id": rid}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        return web.json_response(body, status=status, headers=headers)

    async def _forward(self, request: web.Request, ticket: Ticket, body: bytes, f: Flight,
                       stream: Stream | None) -> web.StreamResponse:
        t = ticket.target
        assert t.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = f.rid
        f.at("waiting for the first byte")
        up = await self._send(t, request.method, request.path_qs, body, headers)
        try:
            first = await self._first(up)
            if 400 <= up.status < 500:
                await self._uncount(ticket)  # refused by the API server: never reached the engine
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            resp.headers["X-Request-Id"] = f.rid
            resp.headers["X-Vllm-Guard-Generation"] = str(t.generation)
            sse_body = up.headers.get("Content-Type", "").startswith("text/event-stream")
            f.answered_by(t.generation, ticket.replica, sse_body)
            if up.content_length is not None and not sse_body:
                resp.content_length = up.content_length
            f.at("streaming")
            await resp.prepare(request)
            ttft = time.monotonic() - f.t0
            self.ttft.append(ttft)
            if stream is not None and sse_body and up.status == 200:
                outcome = await self._relay(resp, up, first, ticket, f, stream)
            else:
                outcome = await self._stream(resp, up, first, ticket, f, sse_body)
            if outcome == "ok" and 400 <= up.status < 500:
                f.end(Outcome.REJECTED, up.status, f"vLLM answered {up.status}", RejectReason.VLLM_REFUSED)
            elif outcome == "ok":
                f.end(Outcome.COMPLETED, up.status)
            elif outcome != "client_gone":
                f.end(Outcome.FAILED, up.status, f"the backend's answer was {outcome}", FailReason.BACKEND_BROKE)
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

    async def _send(self, t: Target, method: str, path: str, body: bytes,
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        assert t.session is not None
        try:
            # Cancelled here (the client left), aiohttp closes the backend connection: vLLM aborts.
            return await t.session.request(method, t.base + path, data=body, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectorError as e:  # nothing listens there any more
            raise Retry(f"{type(e).__name__}: {e}", dead=True) from e
        except _UPSTREAM_ERRORS as e:
            raise Retry(f"{type(e).__name__}: {e}") from e

    async def _first(self, up: aiohttp.ClientResponse) -> bytes:
        """The answer's first body bytes; Retry when they say (or show) the backend failed."""
        try:
            first = await up.content.readany()
        except _UPSTREAM_ERRORS as e:
            up.close()
            raise Retry(f"{type(e).__name__} before the first byte: {e}") from e
        if self._engine_dead(up.status, first):
            up.close()
            raise Retry(f"engine dead (HTTP {up.status})", dead=True)
        if not first and up.status == 200 and up.headers.get("Content-Type", "").startswith("text/event-stream"):
            up.close()
            raise Retry("a stream that ended before its first event")
        return first

    @staticmethod
    def _engine_dead(status: int, first: bytes) -> bool:
        if status >= 500 or first.startswith(b"data: {\"error\""):
            return resume.engine_dead(first)
        return False

    async def _stream(self, resp: web.StreamResponse, up: aiohttp.ClientResponse, first: bytes, ticket: Ticket,
                      f: Flight, sse_body: bool) -> str:
        """Pass the body through; returns the outcome: ok, failed (backend broke), truncated,
        or client_gone."""
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
                    await self._stream_error(resp, t, f, sse_body, f"{type(e).__name__}: {e}")
                    return "failed"
                if not chunk:
                    break
                if sse_body and not errored and _SSE_ERROR in chunk:
                    errored = True  # vLLM's own error event (e.g. engine died): a failed request
                tail = (tail + chunk)[-USAGE_TAIL:]
                await resp.write(chunk)
                f.sent(time.monotonic())
            await resp.write_eof()
        except _CLIENT_GONE:
            up.close()
            self._client_gone(f, t.generation)
            return "client_gone"
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
                     f: Flight, stream: Stream) -> str:
        """A resumable stream, event by event, through `stream`. Returns the outcome as `_stream`
        does; raises Died (with the response) when the backend died and the stream did not end."""
        t = ticket.target
        split = sse.Splitter()
        chunk, broke = first, ""
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
                except asyncio.TimeoutError:
                    raise  # [server] request_timeout: the request ends here, it does not move
                except _UPSTREAM_ERRORS as e:
                    broke = f"{type(e).__name__}: {e}"
                    break
                if not chunk:
                    broke = "the stream ended without [DONE]"
                    break
            if stream.dead or broke:
                up.close()
                if not stream.finished:
                    raise Died(broke or "vLLM's engine died (its error event)", resp)
                # it died after the last token: the client gets the rest from here
                await resp.write(b"".join(stream.closing()))
                f.sent(time.monotonic())
            elif not up.closed and stream.stop_at_seam is not None:
                up.close()
            await resp.write_eof()
        except _CLIENT_GONE:
            up.close()
            self._client_gone(f, t.generation)
            return "client_gone"
        except asyncio.TimeoutError as e:
            await self._give_up(resp, stream, f, "it ran past [server] request_timeout", t.generation, str(e),
                                cut=False)
            return "client_gone" if f.gone else "failed"
        self._tokens_of(stream, f)
        if stream.error is not None or not stream.finished:
            log.warning("request_failed", request_id=f.rid, generation=t.generation, error_event=stream.error,
                        truncated=not stream.finished)
            return "failed" if stream.error is not None else "truncated"
        if ticket.counted:
            t.finished_one()
        return "ok"

    async def _continue(self, resp: web.StreamResponse, ticket: Ticket, stream: Stream, f: Flight,
                        client_headers: Any) -> None:
        """Send the continuation of a stream whose backend died to `ticket`'s target, and relay it
        into the same client response. It carries the client's headers (its API key)."""
        t = ticket.target
        headers = {k: v for k, v in client_headers.items() if k.lower() not in _HOP}
        headers.update({"Content-Type": "application/json", "X-Request-Id": f.rid})
        left = stream.left(self._model_len.get(t))
        if left is None:
            n = await self._max_model_len(t, headers)
            if n is not None:
                self._model_len[t] = n
            left = stream.left(n)
        if left is None or left <= 0:
            await self._give_up(resp, stream, f, f"{left} tokens were left to generate", t.generation)
            return
        self.counters.resumes += 1
        f.at("resuming")
        up = await self._send(t, "POST", resume.COMPLETIONS, stream.continuation(left), headers)
        try:
            first = await self._first(up)
            if up.status != 200 or not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                detail = first[:300].decode("utf-8", "replace")
                await self._give_up(resp, stream, f, f"generation {t.generation} refused its continuation "
                                                     f"(HTTP {up.status}: {detail})", t.generation)
                return
            f.answered_by(t.generation, ticket.replica, True)
            f.at("streaming")
            outcome = await self._relay(resp, up, first, ticket, f, stream)
            if outcome == "ok":
                f.end(Outcome.COMPLETED, resp.status)
            elif outcome != "client_gone":
                f.end(Outcome.FAILED, resp.status, f"the continuation's answer was {outcome}", FailReason.BACKEND_BROKE)
            if self.cfg.access_log:
                log.info("request", request_id=f.rid, generation=t.generation, method="POST", path=resume.COMPLETIONS,
                         status=up.status, outcome=outcome, resumed=f.resumed,
                         e2e_ms=round((time.monotonic() - f.t0) * 1000, 2))
        except BaseException:
            up.close()
            raise
        finally:
            up.release()

    async def _max_model_len(self, t: Target, headers: dict[str, str]) -> int | None:
        """The model's context length, from the target's /v1/models (a chat with no max_tokens
        goes on for what the context leaves)."""
        assert t.session is not None
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            async with t.session.get(t.base + "/v1/models", headers=auth) as r:
                models = await r.json()
            return int(models["data"][0]["max_model_len"])
        except (*_UPSTREAM_ERRORS, ValueError, KeyError, IndexError, TypeError) as e:
            raise Retry(f"its /v1/models did not answer: {type(e).__name__}: {e}") from e

    async def _stream_error(self, resp: web.StreamResponse, t: Target, f: Flight, sse_body: bool, error: str) -> None:
        """The backend broke mid-stream: the client gets a final SSE error event, never a hang."""
        f.end(Outcome.FAILED, resp.status, f"the backend broke mid-stream: {error}",
              FailReason.UNRESUMABLE if f.unresumable else FailReason.BACKEND_BROKE)
        if f.unresumable:
            self.counters.unresumable += 1
        log.warning("request_failed", request_id=f.rid, generation=t.generation, error=error, streaming=True)
        self.on_error(t)
        if sse_body:
            why = f" (it could not be resumed: {f.unresumable})" if f.unresumable else ""
            event = {"error": {"message": f"backend generation {t.generation} failed: {error}{why}",
                               "type": "backend_error", "param": None,
                               "code": (FailReason.UNRESUMABLE if f.unresumable else FailReason.BACKEND_BROKE).value}}
            try:
                await resp.write(sse.event(json.dumps(event).encode()) + sse.DONE)
                await resp.write_eof()
            except _CLIENT_GONE:
                pass


async def _no_expect(_: web.Request) -> None:
    """`Expect: 100-continue` is answered by the handler, after the route and size checks, so a
    refused body is never sent."""
    return None
