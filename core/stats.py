"""Pure statistics for the detectors and the report: robust slopes, forecasts, shares. No I/O.

One Theil-Sen for the whole project. `theil_sen_groups` is the stratified estimator of the
seasonal Kendall test (Hirsch, Slack & Smith 1982): the median of the pairwise slopes *within*
each group (a generation: a recycle starts fresh processes, so memory falls back at each
boundary and pairs across it say nothing of a leak), with Sen's (1968, eq. 2.6) confidence
interval from the summed variances of the per-group Kendall statistics, tie-corrected. With one
group it is exactly scipy.stats.theilslopes (tests/test_watchdog_units.py checks it), written
in numpy because importing scipy.stats alone adds ~69 MB of RSS, which would put the watchdog
over its 100 MB budget.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_POINTS = 300  # per group: Theil-Sen is O(n^2), longer series are thinned evenly (the slope barely moves)


@dataclass(frozen=True)
class Slope:
    slope: float  # units of y per unit of x
    low: float  # confidence interval of the slope
    high: float
    n: int  # points used (after thinning)
    groups: int = 1

    def scaled(self, k: float) -> Slope:
        """The same slope in other units (x per 100 requests, per hour): k > 0."""
        return Slope(self.slope * k, self.low * k, self.high * k, self.n, self.groups)


Group = tuple[Sequence[float], Sequence[float]]  # (x, y) of one group


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= MAX_POINTS:
        return x, y
    idx = np.linspace(0, len(x) - 1, MAX_POINTS).round().astype(int)
    return x[idx], y[idx]


def theil_sen_groups(groups: Sequence[Group], alpha: float = 0.95) -> Slope | None:
    """Stratified Theil-Sen slope of y against x over groups, with its `alpha` interval; None
    when no group has three points with x varying."""
    slopes: list[np.ndarray] = []
    sigsq = 0.0
    points = used = 0
    for gx, gy in groups:
        xa, ya = _thin(np.asarray(gx, dtype=float), np.asarray(gy, dtype=float))
        if len(xa) < 3 or np.ptp(xa) == 0:
            continue
        dx = xa[:, np.newaxis] - xa
        dy = ya[:, np.newaxis] - ya
        pos = dx > 0
        slopes.append(dy[pos] / dx[pos])
        n = len(xa)
        sigsq += (n * (n - 1) * (2 * n + 5) - _ties(xa) - _ties(ya)) / 18.0
        points += n
        used += 1
    if not slopes:
        return None
    s = np.sort(np.concatenate(slopes))
    med = float(np.median(s))
    a = 1.0 - alpha if alpha > 0.5 else alpha
    z = statistics.NormalDist().inv_cdf(a / 2.0)
    nt = len(s)
    sigma = float(np.sqrt(max(sigsq, 0.0)))
    hi = min(int(np.round((nt - z * sigma) / 2.0)), nt - 1)
    lo = max(int(np.round((nt + z * sigma) / 2.0)) - 1, 0)
    return Slope(med, float(s[lo]), float(s[hi]), points, used)


def theil_sen(x: Sequence[float], y: Sequence[float], alpha: float = 0.95) -> Slope | None:
    """Theil-Sen slope of y against x with its confidence interval; None if x does not vary."""
    return theil_sen_groups([(x, y)], alpha)


def _ties(v: np.ndarray) -> float:
    _, counts = np.unique(v, return_counts=True)
    k = counts[counts > 1].astype(float)
    return float(np.sum(k * (k - 1) * (2 * k + 5)))


def time_to_exhaust(headroom: float, rate: float) -> float | None:
    """Time (in the rate's time unit) until `headroom` is used up at `rate`; None if not growing."""
    if rate <= 0:
        return None
    return max(headroom, 0.0) / rate


def share(flags: Sequence[bool]) -> float:
    """Fraction of True in a window (0 for an empty window)."""
    return float(sum(flags)) / len(flags) if flags else 0.0
