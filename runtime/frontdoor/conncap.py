"""Client connections of the public port: a cap, a header timeout, idle ones evicted first.

aiohttp alone accepts connections until the process runs out of descriptors — and then the
admin socket, the ledger and the next vLLM child fail with it — and lets a connection that
never completes its request headers stay until the keep-alive timeout. The gate wraps aiohttp's
protocol, one `Conn` per connection:

- at most `cap` connections; the cap comes from the descriptor limit unless set lower, because
  a proxied request holds two descriptors (client and backend) and the rest of the runtime
  needs some too (`RESERVE`); the limit is read again at each new connection, so one lowered
  on the running process takes effect;
- at the cap, the connection idle longest (no request in progress: a kept-alive client, or one
  still sending headers) is closed to make room; if every connection has a request in
  progress, the newcomer gets a 503 with Retry-After and is closed;
- a new connection that has not completed its request headers within `header_timeout` is
  closed (slowloris). Its timer stops at the empty line that ends the header block, when the
  bytes come in, not when aiohttp's handler starts a few loop turns later. A starved runtime
  (its loop not scheduled for 10 s and more on a loaded 2-core box) must not cut a client that
  sent in time: when the loop runs again, uvloop runs the due timer before it polls, so the
  request is still unread in the socket. A timer that finds bytes waiting unread (FIONREAD), or
  that fires late, gives the connection another `GRACE_S` instead of closing it; the next check
  finds them read, and the headers either complete or not. aiohttp's keep-alive timeout
  (`[server] idle_timeout`) closes kept-alive connections that go quiet, or that start a request
  and never finish its headers.

The proxy tells the gate when a request starts and ends on a connection (`request_started`,
`request_ended`); the end of a header block is all the HTTP known here.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import resource
import struct
import termios
import time
from typing import Any, Callable, cast

import structlog

log = structlog.get_logger("vllm_guard.proxy")

RESERVE_MIN = 64  # descriptors kept for everything but client connections and their upstreams
LATE_S = 0.5  # a header timer this late means the loop was not running when it was due
GRACE_S = 1.0  # what a header timer that finds the loop was not running gives the connection again
HEADERS_END = b"\r\n\r\n"


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the client sent that the loop has not read yet (0 when unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", raw)[0])


def reserve(soft_limit: int) -> int:
    return max(RESERVE_MIN, soft_limit // 8)


def connection_cap(configured: int, soft_limit: int | None = None) -> int:
    """`[server] max_connections`, never above what the descriptor limit allows (0: that)."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            soft_limit = 1 << 20
    auto = max(8, (soft_limit - reserve(soft_limit)) // 2)
    return min(configured, auto) if configured else auto


def busy_response(retry_after: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: {retry_after}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class Conn(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, our bookkeeping around it."""

    def __init__(self, gate: Gate, inner: Callable[[], asyncio.Protocol]) -> None:
        self.gate = gate
        self._make_inner = inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests in progress
        self.served = 0
        self.since = time.monotonic()  # connected, or its last request ended
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the header timer should fire (the loop's clock)
        self._tail = b""  # the last bytes seen while the header block is incomplete

    # asyncio.Protocol, delegated to aiohttp's handler once admitted
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, only alike: no isinstance)
        self.transport = cast(asyncio.Transport, transport)
        if not self.gate.admit(self):
            return
        self.inner = self._make_inner()
        self._arm(self.gate.header_timeout)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:  # the header block of the first request is still incomplete
            seen = self._tail + data
            if HEADERS_END in seen:
                self._cancel_timer()  # complete: the handler starts a few loop turns from now
            else:
                self._tail = seen[-(len(HEADERS_END) - 1):]
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.gate.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # bookkeeping
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + delay
        self._timer = loop.call_later(delay, self._header_timeout)

    def _header_timeout(self) -> None:
        self._timer = None
        if self.busy or self.served or self.transport is None:
            return
        late = asyncio.get_running_loop().time() - self._due
        if late > LATE_S:  # the loop was not running when the timer was due: its time again
            self._arm(min(late, self.gate.header_timeout))
            return
        if unread_bytes(self.transport):  # sent, but the loop has not read it yet: look again
            self._arm(GRACE_S)
            return
        self.gate.header_timeouts += 1
        log.info("connection_header_timeout", timeout_s=self.gate.header_timeout)
        self.close()

    def started(self) -> None:
        self._cancel_timer()
        self.busy += 1

    def ended(self) -> None:
        self.busy -= 1
        self.served += 1
        self.since = time.monotonic()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Gate:
    """`cap_of`, when given, is asked again at each new connection: a descriptor limit lowered
    on the running process (`prlimit --pid`) lowers the cap with it."""

    def __init__(self, cap: int, header_timeout: float, retry_after: int,
                 cap_of: Callable[[], int] | None = None) -> None:
        self.cap = cap
        self.cap_of = cap_of
        self.header_timeout = header_timeout
        self.retry_after = retry_after
        self.conns: dict[Any, Conn] = {}  # transport -> connection
        self.refused = 0
        self.evicted = 0
        self.header_timeouts = 0

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], Conn]:
        return lambda: Conn(self, inner)

    def admit(self, c: Conn) -> bool:
        assert c.transport is not None
        if self.cap_of is not None:
            self.cap = self.cap_of()
        while len(self.conns) > self.cap and self._evict_one():  # the cap was lowered meanwhile
            pass
        if len(self.conns) >= self.cap and not self._evict_one():
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("connection_refused", open=len(self.conns), cap=self.cap, refused=self.refused)
            c.transport.write(busy_response(self.retry_after, f"too many connections (at most {self.cap}): "
                                                              "retry later"))
            c.transport.close()
            return False
        self.conns[c.transport] = c
        return True

    def _evict_one(self) -> bool:
        idle = [c for c in self.conns.values() if c.busy == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.since)
        self.conns.pop(victim.transport, None)
        self.evicted += 1
        victim.close()
        return True

    def forget(self, c: Conn) -> None:
        if self.conns.get(c.transport) is c:
            del self.conns[c.transport]

    def of(self, transport: Any) -> Conn | None:
        return self.conns.get(transport)

    def close_all(self) -> None:
        for c in list(self.conns.values()):
            c.close()
