"""Where a request goes: the seam between the proxy and the supervisor.

The proxy's wait queue asks `pick()` for a target when a request is admitted, and the proxy calls
`release()` when the request ends; it knows nothing else about generations or replicas. Each
replica's driver `add`s a generation's target once it is ready and `stop`s it when it drains,
fails or is replaced. Every
decision about which target takes a request lives here:

- least outstanding requests among the targets that accept; ties go to the one picked least
  recently (sequential requests spread evenly over replicas);
- a target that just failed a request (refused connection, dead engine) is passed over for a
  moment, so the proxy's retry goes to another replica rather than back into the failure
  (least-outstanding alone would favour it: a dead backend answers fastest);
- a target about to stop (`leaving`: its recycle leaves a gap soon) is picked only when no other
  target is open, so another replica takes the requests while a load balancer moves away;
- a generation's count limit (`max_requests`): it stops accepting at the limit (its requests
  then wait for the next generation) unless it may go on past it (`allow_past_limit`): while its
  successor starts beside it, or while its recycle waits for another replica, the limit is soft
  and nothing queues because of it.

A request that moves after a generation failed it carries a `Move`: the generations it never goes
back to and the one it avoids for a while (`policy.decide` says which). `choose` is a pure
function of the routes and `now`; the rest is bookkeeping.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from .target import Target, counts_toward_limit

AVOID_AFTER_FAILURE_S = 1.0


@dataclass(eq=False)
class Route:
    """One target as the router sees it."""

    target: Target
    replica: int = 0
    past_limit: bool = False  # may accept past its count limit
    avoid_until: float = 0.0  # monotonic: a request just failed here
    seq: int = 0  # when it was last picked (router-wide order)

    @property
    def open(self) -> bool:
        return self.target.accepting and not self.target.dead

    def allow(self, past_limit: bool) -> None:
        self.past_limit = past_limit

    def picked(self, seq: int) -> None:
        self.seq = seq

    def avoid(self, until: float) -> None:
        self.avoid_until = until


@dataclass(eq=False)
class Move:
    """Where a request whose backend failed may go next (what `policy.decide` said of each
    generation that failed it)."""

    exclude: set[Target] = field(default_factory=set)  # never again for this request
    avoid: Target | None = None  # the last one that failed it otherwise: not before avoid_until
    avoid_until: float = 0.0

    def failed_at(self, target: Target, never_again: bool, until: float) -> None:
        if never_again:
            self.exclude.add(target)
        else:
            self.avoid, self.avoid_until = target, until


def choose(routes: Sequence[Route], now: float) -> Route | None:
    """The route for the next request: least outstanding among the open routes that did not just
    fail (all of them if every one did) and are not leaving (unless all are), ties to the least
    recently picked; None if none is open."""
    live = [r for r in routes if r.open]
    if not live:
        return None
    fresh = [r for r in live if r.avoid_until <= now] or live
    fresh = [r for r in fresh if not r.target.leaving] or fresh
    return min(fresh, key=lambda r: (r.target.in_flight, r.seq, r.replica))


class Router:
    def __init__(self, on_limit: Callable[[Target], None],
                 on_drained: Callable[[Target], None] | None = None) -> None:
        self.on_limit = on_limit
        # a closed target's last request ended: its drain is over now, not at the next loop turn
        # (a gated recycle's drain is time without a serving generation)
        self.on_drained = on_drained
        self.routes: list[Route] = []
        # False while held: no recycle can follow, so a generation never stops at its limit
        self.enforce_limit = True
        self._seq = itertools.count(1)

    # -- the supervisor's side -----------------------------------------------------------------
    def add(self, target: Target, replica: int = 0) -> Route:
        """Send requests to `target` too (it is ready)."""
        route = self.route(target) or Route(target, replica)
        if route not in self.routes:
            self.routes.append(route)
        return route

    def replace(self, target: Target | None) -> None:
        """Send requests to `target` only (None: to nobody; they wait)."""
        self.routes = [] if target is None else [self.route(target) or Route(target)]

    def stop(self, target: Target, dead: bool = False) -> None:
        """No new requests to `target` (draining, failed, replaced); its in-flight ones finish."""
        target.close_dispatch(dead)
        self.routes = [r for r in self.routes if r.target is not target]

    def allow_past_limit(self, target: Target, allowed: bool = True) -> None:
        """Let `target` accept past its count limit (it is re-opened if the limit closed it)."""
        route = self.route(target)
        if route is None:
            return
        route.allow(allowed)
        if allowed:
            target.reopen()

    def failed(self, target: Target, now: float | None = None) -> None:
        """A request to `target` failed before reaching the client: pass it over for a moment."""
        route = self.route(target)
        if route is not None:
            route.avoid((time.monotonic() if now is None else now) + AVOID_AFTER_FAILURE_S)

    def route(self, target: Target) -> Route | None:
        return next((r for r in self.routes if r.target is target), None)

    def accepting(self) -> list[Target]:
        return [r.target for r in self.routes if r.open]

    # -- the proxy's side ----------------------------------------------------------------------
    def _open_to(self, avoid: Target | None, avoid_until: float, exclude: Collection[Target],
                 now: float) -> list[Route]:
        return [r for r in self.routes
                if not (r.target is avoid and now < avoid_until) and r.target not in exclude]

    def could_pick(self, avoid: Target | None = None, avoid_until: float = 0.0,
                   exclude: Collection[Target] = ()) -> bool:
        """Whether `pick` with these would find a target now (nothing changes)."""
        now = time.monotonic()
        return choose(self._open_to(avoid, avoid_until, exclude, now), now) is not None

    def could_move(self, move: Move) -> bool:
        """Whether a request moving with `move` would find a target now."""
        return self.could_pick(move.avoid, move.avoid_until, move.exclude)

    def pick(self, counted: bool, arrived: float, avoid: Target | None = None,
             avoid_until: float = 0.0, exclude: Collection[Target] = ()) -> tuple[Target, bool] | None:
        """The target for a request that arrived at `arrived` (monotonic), and whether it counts
        as the target's backlog (inherited); None: it waits. `avoid` (a retry's failed target) is
        not picked before `avoid_until`, even when it is the only one; `exclude` never (targets
        that failed the request with a dead engine)."""
        now = time.monotonic()
        route = choose(self._open_to(avoid, avoid_until, exclude, now), now)
        if route is None:
            return None
        t = route.target
        inherited = counted and not counts_toward_limit(arrived, t.ready_at)
        if t.took(counted, inherited, self.enforce_limit and not route.past_limit):
            self.on_limit(t)
        route.picked(next(self._seq))
        return t, inherited

    def release(self, target: Target) -> None:
        """A request to `target` ended (whatever its outcome)."""
        target.released()
        if target.in_flight == 0 and not target.accepting and self.on_drained is not None:
            self.on_drained(target)
