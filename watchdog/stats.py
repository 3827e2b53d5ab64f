"""Pure statistics for the detectors: robust slopes, forecasts, shares. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

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
    res = stats.theilslopes(ya, xa, alpha)
    return Slope(float(res.slope), float(res.low_slope), float(res.high_slope), len(xa))


def time_to_exhaust(headroom: float, rate: float) -> float | None:
    """Time (in the rate's time unit) until `headroom` is used up at `rate`; None if not growing."""
    if rate <= 0:
        return None
    return max(headroom, 0.0) / rate


def share(flags: Sequence[bool]) -> float:
    """Fraction of True in a window (0 for an empty window)."""
    return float(sum(flags)) / len(flags) if flags else 0.0
