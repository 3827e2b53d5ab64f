"""The one leak rule: when memory growth is a leak, and what it forecasts.

The watchdog (which acts on it), the report (which states it) and the runtime's growth trigger
(which takes its baseline after the same warm-up) follow these definitions:

- **Warm-up**: a process's first `WARMUP_REQUESTS` requests (of its generation) settle
  allocator pools, caches and compiled graphs: growth there is not a leak, so points before it
  are left out (`warmed_up`). `[recycle] memory_warmup_requests` and `[watchdog]
  warmup_requests` default to it.
- **Leak shown** (`judge`): the robust slope of memory against requests (stratified Theil-Sen
  within generations, MB per 100 requests) has an interval whose low end clears the noise floor
  over the whole window *and* over each half of it: a leak is steady, a step (an allocator pool,
  a new batch shape) sits in one half and leaves the other flat. Too few points or requests
  spanned: not shown yet.
- **Time to OOM**: headroom / growth per hour, given only when the leak is shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .stats import Slope

WARMUP_REQUESTS = 100
NOISE_FLOOR_MB_PER_100 = 4.0  # slopes whose interval stays below this are noise (allocator, rounding)
MIN_REQUESTS = 200  # requests spanned (summed over generations) before a verdict
MIN_POINTS = 20
CONFIDENCE = 0.95  # of the slope's interval: the watchdog recycles on it


def warmed_up(requests: float | None, warmup: int = WARMUP_REQUESTS) -> bool:
    """Whether a memory point taken after `requests` requests (of its generation, or since its
    process was first seen) counts toward a leak. Unknown counts count (nothing to drop on)."""
    return requests is None or requests >= warmup


@dataclass(frozen=True)
class Series:
    """One process's memory in one generation, in time order: t in seconds, x in requests."""

    t: Sequence[float]
    x: Sequence[float]
    y: Sequence[float]  # MB


@dataclass(frozen=True)
class LeakVerdict:
    per_100: Slope | None  # MB per 100 requests over the whole window
    halves: tuple[Slope | None, Slope | None]  # MB per 100 requests, first and second half in time
    per_hour: Slope | None  # MB per hour (same method, x = hours)
    points: int
    requests: float  # requests spanned, summed over generations
    generations: int
    floor: float
    enough: bool  # enough points and requests for a verdict
    shown: bool  # a leak: whole window and both halves clear the floor

    def time_to_oom_h(self, headroom_mb: float | None) -> float | None:
        """Hours until `headroom_mb` is used up; only for a shown leak that grows in time."""
        if not self.shown or headroom_mb is None or self.per_hour is None or self.per_hour.slope <= 0:
            return None
        return max(headroom_mb, 0.0) / self.per_hour.slope

    def why_not(self) -> str:
        """`no leak shown yet (N requests, interval [lo, hi] MB/100 requests, floor F)`."""
        if self.shown:
            return ""
        iv = ("no slope" if self.per_100 is None
              else f"interval [{self.per_100.low:.3g}, {self.per_100.high:.3g}] MB/100 requests")
        if not self.enough:
            return (f"no leak shown yet ({self.requests:.0f} requests, {self.points} points: too few, need "
                    f"{MIN_REQUESTS} requests and {MIN_POINTS} points; {iv})")
        half = next((i for i, h in enumerate(self.halves) if h is None or h.low <= self.floor), None)
        where = ("" if self.per_100 is not None and self.per_100.low <= self.floor or half is None
                 else f"; the {('first', 'second')[half]} half does not clear it")
        return f"no leak shown yet ({self.requests:.0f} requests, {iv}, floor {self.floor:g}{where})"


def _span(series: Sequence[Series]) -> float:
    return float(sum(max(s.x) - min(s.x) for s in series if len(s.x)))


def judge(series: Sequence[Series], floor: float = NOISE_FLOOR_MB_PER_100, min_requests: float = MIN_REQUESTS,
          min_points: int = MIN_POINTS, confidence: float = CONFIDENCE) -> LeakVerdict:
    """The leak rule over one process's series (one per generation), warm-up already left out."""
    from .stats import theil_sen_groups

    points = sum(len(s.y) for s in series)
    requests = _span(series)
    per_req = theil_sen_groups([(s.x, s.y) for s in series], confidence)
    per_h = theil_sen_groups([([t / 3600.0 for t in s.t], s.y) for s in series], confidence)
    first, second = _halves(series)
    halves = (theil_sen_groups([(s.x, s.y) for s in first], confidence),
              theil_sen_groups([(s.x, s.y) for s in second], confidence))
    p100 = per_req.scaled(100.0) if per_req is not None else None
    h100 = tuple(h.scaled(100.0) if h is not None else None for h in halves)
    enough = points >= min_points and requests >= min_requests and p100 is not None
    shown = enough and p100 is not None and p100.low > floor and all(h is not None and h.low > floor for h in h100)
    return LeakVerdict(p100, (h100[0], h100[1]), per_h, points, requests,
                       sum(1 for s in series if len(s.y)), floor, enough, shown)


def _halves(series: Sequence[Series]) -> tuple[list[Series], list[Series]]:
    """The points split in two at the median time, each half still grouped by generation."""
    ts = sorted(t for s in series for t in s.t)
    if not ts:
        return [], []
    cut = ts[len(ts) // 2]
    first: list[Series] = []
    second: list[Series] = []
    for s in series:
        lo = [i for i, t in enumerate(s.t) if t < cut]
        hi = [i for i, t in enumerate(s.t) if t >= cut]
        for idx, out in ((lo, first), (hi, second)):
            if idx:
                out.append(Series([s.t[i] for i in idx], [s.x[i] for i in idx], [s.y[i] for i in idx]))
    return first, second
