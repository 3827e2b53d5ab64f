"""The wait for a target: a request takes one from the router at once, or waits (bounded) in the
queue until one opens.

While no generation takes requests (starting, recycling, backing off), requests wait here, at
most `queue_size` of them and each at most its deadline; held or shutting down, they are turned
away at once. A request moving from a generation that failed it (`Move`) waits too, never behind
requests that arrived after it: while one could take a target, new requests do not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .done import Counters
from .flight import Flight
from .policy import Failure
from .router import Move, Router
from .target import Ticket


@dataclass(frozen=True)
class NoTarget:
    """No generation took the request: why (`failure`, one of `policy.NO_TARGET`), in words."""

    failure: Failure
    message: str


class _Turned(Exception):
    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.no = NoTarget(failure, message)


class WaitQueue:
    def __init__(self, router: Router, counters: Counters, queue_size: int) -> None:
        self.router = router
        self.counters = counters  # its high-water mark goes to `max_queued`
        self.queue_size = queue_size
        self.reject_reason: str | None = None  # held or shutting down: fail fast
        self.queued = 0
        self.in_flight = 0
        self._cond = asyncio.Condition()
        self._idle_since = time.monotonic()
        self._moving: list[Move] = []  # requests waiting to move: they go before new admissions
        self._tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def wake(self) -> None:
        """The targets changed: waiting requests look again."""
        async with self._cond:
            self._cond.notify_all()

    async def set_reject(self, reason: str | None) -> None:
        self.reject_reason = reason
        await self.wake()

    def mark(self) -> int:
        """The queue's high-water mark since the last call; it starts again from now."""
        mark, self.counters.max_queued = self.counters.max_queued, self.queued
        return mark

    def idle_for(self) -> float:
        """Seconds since the last request left, 0 while any is in flight or queued."""
        if self.in_flight or self.queued:
            return 0.0
        return time.monotonic() - self._idle_since

    # -- a request's side --------------------------------------------------------------------
    async def take(self, f: Flight, deadline: float, move: Move | None = None) -> Ticket | NoTarget:
        """A target for the request, waiting (bounded) while none is open. `move`: it is moving
        from a backend that failed it; it goes before requests that did not."""
        try:
            return await self._take(f, deadline, move)
        except _Turned as e:
            return e.no

    def release(self, ticket: Ticket) -> None:
        """The request's try at `ticket` ended (whatever its outcome)."""
        self.router.release(ticket.target)
        self.in_flight -= 1
        if not self.in_flight:
            self._idle_since = time.monotonic()

    async def uncount(self, ticket: Ticket) -> None:
        """The request did not reach the engine there (a 4xx, a failed try): undo its count,
        and take requests again if the count was what closed the generation."""
        if ticket.uncount():
            await self.wake()

    def _pick(self, counted: bool, arrived: float, move: Move | None) -> Ticket | None:
        if move is None and any(self.router.could_move(m) for m in self._moving):
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

    async def _take(self, f: Flight, deadline: float, move: Move | None) -> Ticket:
        ticket = self._pick(f.counted, f.t0, move) if self.reject_reason is None else None
        if ticket is not None:
            return ticket
        if self.reject_reason is not None:
            raise _Turned(Failure.UNAVAILABLE, self.reject_reason)
        if self.queued >= self.queue_size and move is None:
            raise _Turned(Failure.QUEUE_FULL, f"queue full ({self.queue_size} waiting)")
        self.queued += 1
        self.counters.max_queued = max(self.counters.max_queued, self.queued)
        f.at("queued" if move is None else "waiting to move")
        if move is not None:
            self._moving.append(move)
        try:
            async with self._cond:
                while True:
                    if self.reject_reason is not None:
                        raise _Turned(Failure.UNAVAILABLE, self.reject_reason)
                    ticket = self._pick(f.counted, f.t0, move)
                    if ticket is not None:
                        if move is not None:
                            self._moving.remove(move)
                            self._cond.notify_all()  # new requests it held back look again
                        return ticket
                    now = time.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        raise _Turned(Failure.QUEUE_TIMEOUT, "no backend became ready within the queue's max wait")
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
                self._tasks.append(asyncio.ensure_future(self.wake()))  # what it held back looks again
                self._tasks = [t for t in self._tasks if not t.done()]
