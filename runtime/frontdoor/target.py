"""One generation as the front door sees it (`Target`): where to send, what was sent, whether it
takes more; and one admitted attempt of a request at it (`Ticket`).

Every change to a target's counts and flags is one of its own methods, called by the router
(which decides where a request goes) and the proxy (which sends it): nobody else assigns to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from vllm_guard.core import vllm_api


CONNECT_TIMEOUT_S = 10.0  # a generation that does not accept a connection in this long failed the try


def limit_reached(requests: int, limit: int | None) -> bool:
    return limit is not None and requests >= limit


def counts_toward_limit(arrived_at: float, ready_at: float | None) -> bool:
    """A request counts toward a generation's limit only if it arrived after the generation was
    ready; one that waited through the recycle or start is that generation's inherited backlog."""
    return ready_at is not None and arrived_at >= ready_at


@dataclass(eq=False)
class Target:
    generation: int
    url: str  # http://host:port, or core.vllm_api.unix_url(socket) for a backend on a Unix socket
    limit: int | None = None  # requests arriving after ready this generation may take; None: no limit
    accepting: bool = True
    dead: bool = False
    leaving: bool = False  # it stops soon (a cold or gated recycle): readiness no longer counts it
    limit_closed: bool = False  # stopped accepting because the limit was reached (reopens if a count is undone)
    dispatched: int = 0  # counted requests sent to this generation
    inherited: int = 0  # of those: waiting before it was ready (its backlog; not toward the limit)
    completed: int = 0
    in_flight: int = 0
    ready_at: float | None = None  # monotonic; set when it opens
    session: aiohttp.ClientSession | None = None
    base: str = ""  # what request paths are appended to
    last_activity: float = field(default_factory=time.monotonic)
    first_dispatch: float | None = None  # monotonic: its first request (the end of its start's anatomy)
    handing_over: bool = False  # its followed streams go on at the next generation (`hand_over`)
    # the streams the proxy follows here now, each with what says why it cannot go on elsewhere
    followed: dict[aiohttp.ClientResponse, Callable[[], str | None]] = field(default_factory=dict)
    cut: set[aiohttp.ClientResponse] = field(default_factory=set)  # the streams `hand_over` cut (until they end)

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
            connector=connector, timeout=aiohttp.ClientTimeout(total=request_timeout, connect=CONNECT_TIMEOUT_S),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # -- what the router and the proxy change ------------------------------------------------
    def close_dispatch(self, dead: bool) -> None:
        """No new requests (draining, failed, replaced); the supervisor decides from here on."""
        self.accepting, self.limit_closed = False, False
        self.dead = self.dead or dead

    def reopen(self) -> None:
        """Take requests again (its limit is soft now, or a count that closed it was undone)."""
        if not self.dead:
            self.accepting, self.limit_closed = True, False

    def took(self, counted: bool, inherited: bool, enforce_limit: bool) -> bool:
        """A request was sent here; True when that reached its count limit and closed it."""
        closed = False
        if self.first_dispatch is None:
            self.first_dispatch = time.monotonic()
        if counted:
            self.dispatched += 1
            if inherited:
                self.inherited += 1
            elif enforce_limit and limit_reached(self.toward_limit, self.limit):
                self.accepting, self.limit_closed, closed = False, True, True
        self.in_flight += 1
        return closed

    def released(self) -> None:
        """A request sent here ended (whatever its outcome)."""
        self.in_flight -= 1
        self.last_activity = time.monotonic()

    def uncounted(self, inherited: bool) -> bool:
        """A counted request did not reach the engine here: its count is undone. True when the
        target opened again because of it."""
        self.dispatched -= 1
        if inherited:
            self.inherited -= 1
        if self.limit_closed and not limit_reached(self.toward_limit, self.limit):
            self.reopen()
            return True
        return False

    def mark_leaving(self, leaving: bool) -> None:
        self.leaving = leaving

    def finished_one(self) -> None:
        self.completed += 1

    def follows(self, up: aiohttp.ClientResponse, why_not: Callable[[], str | None] | None) -> None:
        """A stream the proxy follows began here (`why_not`: its `Stream.resumable`) or ended
        (None). One that begins once this generation handed over is cut at once."""
        if why_not is None:
            self.followed.pop(up, None)
            self.cut.discard(up)
        elif self.handing_over and why_not() is None:
            self.cut.add(up)
            up.close()
        else:
            self.followed[up] = why_not

    def hand_over(self) -> int:
        """The next generation serves now: cut the streams followed here that can go on
        elsewhere, so that they go on there from their last token (the proxy's resume) instead
        of computing here beside it: two CUDA contexts computing at once slow each other's every
        step. vLLM aborts what it generated for them; the rest finish here. Returns how many
        were cut."""
        self.handing_over = True
        cut = [up for up, why_not in self.followed.items() if why_not() is None]
        for up in cut:
            self.followed.pop(up, None)
            self.cut.add(up)
            up.close()
        return len(cut)


@dataclass(eq=False)
class Ticket:
    """One admitted attempt of a request at a target; `counted` until the count is undone."""

    target: Target
    counted: bool
    inherited: bool
    replica: int = 0

    def uncount(self) -> bool:
        """Undo this attempt's count (once); True when its target opened again."""
        if not self.counted:
            return False
        self.counted = False
        return self.target.uncounted(self.inherited)
