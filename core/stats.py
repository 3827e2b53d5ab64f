"""Pure statistics for the detectors: robust slopes, forecasts, shares. No I/O here.

`theil_sen` is scipy.stats.theilslopes' algorithm (median of pairwise slopes, Sen 1968 eq. 2.6
confidence interval with tie corrections) in numpy: importing scipy.stats alone adds ~69 MB of
RSS, which would put the watchdog over its 100 MB budget. tests/test_watchdog_units.py checks
it against scipy.stats.theilslopes on the same data.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_POINTS = 300  # Theil-Sen is O(n^2): thin longer series evenly (the slope barely moves)


@dataclass(frozen=True)
class Slope:
    slope: float  # units of y per unit of x
    low: float  # confidence interval of the slope
    high: float
    n: int


def theil_sen(x: Sequence[float], y: Sequence[float], alpha: float = 0.95) -> Slope | None:
    """Theil-Sen slope of y against x with its confidence interval; None if x does not vary."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 3 or np.ptp(xa) == 0:
        return None
    if len(xa) > MAX_POINTS:
        idx = np.linspace(0, len(xa) - 1, MAX_POINTS).round().astype(int)
        xa, ya = xa[idx], ya[idx]
    dx = xa[:, np.newaxis] - xa
    dy = ya[:, np.newaxis] - ya
    pos = dx > 0
    slopes = np.sort(dy[pos] / dx[pos])
    med = float(np.median(slopes))
    a = 1.0 - alpha if alpha > 0.5 else alpha
    z = statistics.NormalDist().inv_cdf(a / 2.0)
    n, nt = len(ya), len(slopes)
    sigsq = (n * (n - 1) * (2 * n + 5) - _ties(xa) - _ties(ya)) / 18.0
    sigma = float(np.sqrt(sigsq))
    hi = min(int(np.round((nt - z * sigma) / 2.0)), nt - 1)
    lo = max(int(np.round((nt + z * sigma) / 2.0)) - 1, 0)
    return Slope(med, float(slopes[lo]), float(slopes[hi]), len(xa))


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
