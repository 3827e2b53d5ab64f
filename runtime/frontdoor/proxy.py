"""The streaming reverse proxy on the public port: the supervisor's handle on the front door, the
guard's own checks, and each request's way from the socket to `dispatch`.

Why a proxy and not a handed-over listening socket: recycling with zero failed requests needs a
place where a request can wait while no backend serves, be retried when a backend died before
answering, and be counted against `max_requests` exactly. The proxy holds back the response
headers until the backend's first body bytes arrive, so "nothing has reached the client yet"
is a fact it knows, not a guess. SSE is passed through chunk by chunk.

A request meets, in order:
- `routes` and `bodies`: only vLLM's public inference API is forwarded; a body is refused (413)
  before it is read when it is declared too large, and bodies buffered at once stay under a
  budget; connections are capped and slow ones dropped (`conncap`);
- `admission`: each client request is bounded once, after its body is read and before it is
  queued (n, max_tokens, the tokens it asks for, what its client has in flight); a request that
  moves to another generation never passes it again;
- `dispatch`: where it goes (`waiting`, `router`) and what happens when its generation fails
  it (`policy`: retry, resume, fail), the tries themselves being `upstream`'s socket work.
Every request ends in one `RequestDone` (`done`), from which the outcome counters are derived.
A client that leaves cancels its request at whatever stage it is (queued, waiting for the first
byte, streaming): the backend connection is closed, so vLLM aborts it; a client connection lost
in the middle of a request (a half-close, a reset) is one `client_disconnected` line, never a
traceback. Only requests that reached the engine count toward a generation's limit: a 4xx from
vLLM, a retry's failed attempt, a rejection do not.

It also answers a load balancer's and a kubelet's checks itself (`routes.PROBES`): readiness is
200 only while some generation takes new requests now and is not about to stop (`Target.leaving`,
set `[server] unready_lead` before a recycle leaves a gap), so a balancer moves traffic to other
boxes before requests would wait here; liveness is 200 while the supervisor's loop beats.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any, Callable

import structlog
from aiohttp import web

from vllm_guard.core import latency
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import LatencySummary, RejectReason

from . import detok, listen, routes
from .admission import Admission, Limits, Pass, Refusal
from .answers import answer
from .bodies import Bodies, Refused, discard
from .conncap import Gate, connection_cap
from .dispatch import Dispatch
from .done import Counters, Listener, Outcome
from .flight import Flight, client_gone
from .policy import RetryPolicy
from .router import Router
from .target import Target
from .upstream import Upstream
from .waiting import WaitQueue
from ..child import tiny_model

__all__ = ["LIVENESS_STALE_S", "Proxy", "Target"]

log = structlog.get_logger("vllm_guard.proxy")

MB = 1 << 20
# Liveness turns 503 when the supervisor loop has not beaten for this long. Half of systemd's
# default WatchdogSec (60 s), the interval at which the loop pings WATCHDOG=1: the endpoint calls a
# frozen loop dead no later than systemd would, and a kubelet checking every 10 s with 3 failures
# restarts it about when systemd would (30 + 30 s). A healthy turn takes milliseconds (5 s is
# logged as slow), so a loaded box stays far below it.
LIVENESS_STALE_S = 30.0


class Proxy:
    def __init__(self, cfg: ServerConfig, on_limit: Callable[[Target], None], on_error: Callable[[Target], None],
                 on_drained: Callable[[Target], None] | None = None):
        self.cfg = cfg
        self.on_limit = on_limit
        self.on_error = on_error
        self.router = Router(on_limit, on_drained)  # which target takes a request (runtime/frontdoor/router.py)
        self.policy = RetryPolicy.of(cfg)  # what happens when a try fails (runtime/frontdoor/policy.py)
        self.counters = Counters()  # outcomes derived from the RequestDone records (`_done`)
        self.admission = Admission(Limits.of(cfg, os.environ))  # vLLM's keys: its args, else the runtime's env
        self.bodies = Bodies(int(cfg.max_body_mb * MB), int(cfg.body_buffer_mb * MB), cfg.idle_timeout)
        self.queue = WaitQueue(self.router, self.counters, cfg.queue_size)
        self.upstream = Upstream(self.policy, self.counters, self.queue)
        self.dispatch = Dispatch(cfg, self.policy, self.queue, self.upstream, self.counters, on_error)
        self.gate = Gate(connection_cap(cfg.max_connections), cfg.header_timeout, cfg.retry_after,
                         cap_of=lambda: connection_cap(cfg.max_connections))
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self.listeners: list[Listener] = []  # told of every request once it ended (`done`)
        self._beat = time.monotonic()  # the supervisor loop's last turn (`beat`)
        # Streams are resumed with the model's tokenizer (detok.py); loaded at start, off the loop.
        self.facts = detok.facts_of(cfg.model or str(tiny_model.default_dir()), cfg.vllm_args)
        self.tokenizer: Any = None
        self.tokenizer_why = "the guard's tokenizer is still loading"
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False  # handing over: every answer closes its connection

    # -- what the status reads ---------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests waiting for a target now."""
        return self.queue.queued

    @property
    def in_flight(self) -> int:
        """Requests at a target now."""
        return self.queue.in_flight

    @property
    def reject_reason(self) -> str | None:
        """Held or shutting down: why new requests are turned away (None: they are not)."""
        return self.queue.reject_reason

    @property
    def body_bytes(self) -> int:
        """Bytes of request bodies held now (queued and in flight)."""
        return self.bodies.held

    # -- control (called by the supervisor) -------------------------------------------------
    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen on [server] host/port, or on `sock`, the listening socket systemd holds
        (`listen.inherited`): then the port outlives this runtime."""
        app = web.Application(client_max_size=self.bodies.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect)
        app.on_response_prepare.append(self._on_prepare)
        # handler_cancellation: a client that disconnects cancels its handler, wherever it waits.
        # lingering_time 0: an unread (refused) body is never drained, the connection is closed.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     keepalive_timeout=self.cfg.idle_timeout, lingering_time=0)
        await self._runner.setup()
        self._beat = time.monotonic()  # alive from the start: the loop begins right after
        inner = self._runner.server
        assert inner is not None
        loop = asyncio.get_running_loop()
        if sock is None:
            self._server = await loop.create_server(self.gate.factory(inner), self.cfg.host, self.cfg.port,
                                                    reuse_address=True, backlog=2048)
            host, port = self.cfg.host, self.cfg.port
        else:
            self._server = await loop.create_server(self.gate.factory(inner), sock=sock, backlog=2048)
            host, port = listen.address(sock)
        log.info("proxy_listening", host=host, port=port, socket="systemd" if sock is not None else "own",
                 max_connections=self.gate.cap,
                 max_body_mb=self.cfg.max_body_mb, header_timeout_s=self.cfg.header_timeout,
                 idle_timeout_s=self.cfg.idle_timeout)
        self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    def configure(self, cfg: ServerConfig) -> None:
        """A reload's `[server]`: the retry policy, admission's bounds, the body budget, the
        queue's size and what dispatch reads take the new values now; the listener's own (host,
        port, connection cap, header and idle timeouts, body limit) need a restart
        (`runtime/reload.py` refuses them). A new model or tokenizer is loaded again, off the loop."""
        self.cfg = self.dispatch.cfg = cfg
        self.policy = self.dispatch.policy = self.upstream.policy = RetryPolicy.of(cfg)
        self.admission.limits = Limits.of(cfg, os.environ)
        self.bodies.budget = int(cfg.body_buffer_mb * MB)
        self.queue.queue_size = cfg.queue_size
        self.gate.retry_after = cfg.retry_after
        facts = detok.facts_of(cfg.model or str(tiny_model.default_dir()), cfg.vllm_args)
        if facts != self.facts:
            self.facts, self.tokenizer, self.tokenizer_why = facts, None, "the guard's tokenizer is loading again"
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    async def _load_tokenizer(self) -> None:
        tok, why = await asyncio.to_thread(detok.load, self.facts)
        self.tokenizer, self.tokenizer_why = tok, why
        if tok is None:
            log.warning("stream_resumption_off", tokenizer=self.facts.tokenizer, reason=why,
                        detail="streams cut by a dead backend end with an error; requests that got no byte are re-run")
        else:
            log.info("stream_resumption_on", tokenizer=self.facts.tokenizer, migration_limit=self.policy.num_retries)

    def stop_accepting(self) -> None:
        """A hand-over to the next runtime: take no new connection (the kernel keeps them in the
        backlog of the socket systemd holds, for the next runtime). A connection already open is
        still served, each answer with `Connection: close`, so the client's next request opens a
        connection that the next runtime accepts; connections still idle at the very end are
        closed with the proxy."""
        self._closing = True
        if self._server is not None:
            self._server.close()

    async def _on_prepare(self, _: web.Request, resp: web.StreamResponse) -> None:
        if self._closing:
            resp.force_close()
            resp.headers["Connection"] = "close"

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.queue.close()
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
        await self.queue.wake()

    async def add_target(self, target: Target, replica: int = 0) -> None:
        """Dispatch to `target` too (another replica, or the successor of a generation)."""
        self.router.add(target, replica)
        await self.queue.wake()

    async def stop_dispatch(self, target: Target, dead: bool = False, hand_over: bool = False) -> None:
        """No new requests to `target`; `hand_over`: its followed streams go on at the
        generation now live (`Target.hand_over`)."""
        self.router.stop(target, dead)  # the supervisor decides from here on
        if hand_over:
            n = target.hand_over()
            log.info("streams_handed_over", generation=target.generation, streams=n,
                     left_to_finish=target.in_flight - n)
        await self.queue.wake()

    async def allow_past_limit(self, target: Target, allowed: bool = True) -> None:
        """Let `target` take requests past its count limit (its successor starts beside it, or
        its recycle waits for its turn): nothing queues because of the limit."""
        self.router.allow_past_limit(target, allowed)
        await self.queue.wake()

    def queue_mark(self) -> int:
        """The queue's high-water mark since the last call; it starts again from now."""
        return self.queue.mark()

    async def wake_waiters(self) -> None:
        """The router's targets changed (e.g. one may accept again): queued requests look again."""
        await self.queue.wake()

    async def set_reject(self, reason: str | None) -> None:
        await self.queue.set_reject(reason)

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

    def idle_for(self) -> float:
        """Seconds since the last request left, 0 while any is in flight or queued."""
        return self.queue.idle_for()

    def ttft_summary(self) -> LatencySummary:
        """Edge TTFT of the recent requests (the last 4096), by the one quantile rule."""
        return latency.summary(self.upstream.ttft)

    # -- the request path --------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        f = Flight(rid=routes.request_id(request.headers.get("X-Request-Id")), t0=time.monotonic(), counted=False)
        conn = self.gate.of(request.transport)
        if conn is not None:
            conn.started()
        try:
            return await self._handle(request, f)
        except asyncio.CancelledError:  # the client disconnected (aiohttp cancels the handler)
            client_gone(f, self.counters, how="cancelled")
            raise
        except ConnectionError as e:
            # The client's connection was lost while its body was read or the answer written (a
            # half-close, a reset; asyncio.wait_for can turn the cancel into this error). Backend
            # errors never get here (they are retries or failed streams). Answered with a response
            # that is never written, so aiohttp logs no "Error handling request" traceback.
            transport = request.transport
            if transport is not None and not transport.is_closing():
                raise
            client_gone(f, self.counters, how=f"{type(e).__name__}: {e}")
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

    async def _handle(self, request: web.Request, f: Flight) -> web.StreamResponse:
        try:
            kind = routes.classify(request.method, request.path)
        except routes.NotAllowed as e:
            resp = self._refuse(f, Refusal(e.status, RejectReason.NOT_SERVED, str(e)))
            if request.can_read_body and not await discard(request):
                resp.force_close()  # a body left unread: the connection closes after the answer
            return resp
        if kind is routes.Kind.PROBE:
            return self._probe(request.path, f)
        f.count(kind is routes.Kind.ENGINE)
        if f.counted:
            self.counters.requests_total += 1
        try:
            body, held = await self.bodies.read(request)
        except Refused as e:
            resp = self._refuse(f, Refusal(e.status, e.cause, str(e)))
            resp.force_close()
            return resp
        admitted: Pass | None = None
        try:
            if f.counted:  # once per client request: a retry or continuation inside dispatch is not
                verdict = self.admission.admit(request.path, body, request.headers.get("Authorization"),
                                               request.remote)
                if isinstance(verdict, Refusal):
                    return self._refuse(f, verdict)
                admitted = verdict
            return await self.dispatch.run(request, body, f, self.facts, self.tokenizer)
        finally:
            if admitted is not None:
                self.admission.release(admitted)
            self.bodies.give_back(held)

    def _refuse(self, f: Flight, r: Refusal) -> web.Response:
        """Answer a request the front door refused (route, body, admission): rejected, with its reason."""
        f.end(Outcome.REJECTED, r.status, r.message, r.reason)
        if r.reason is not RejectReason.NOT_SERVED:
            log.info("request_refused", request_id=f.rid, status=r.status, cause=r.reason.value, reason=r.message)
        retry = self.cfg.retry_after if r.status in (429, 503) else None
        return answer(f.rid, r.status, r.message, r.reason.value, r.param, retry)


async def _no_expect(_: web.Request) -> None:
    """`Expect: 100-continue` is answered by the handler, after the route and size checks, so a
    refused body is never sent."""
    return None
