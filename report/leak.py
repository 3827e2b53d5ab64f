"""Memory-leak slopes per process, computed within generations (pure maths, no I/O).

A recycle starts fresh processes, so memory falls back at each generation boundary; a slope
fitted across generations would see a saw-tooth and under-read the leak. Each generation is
fitted on its own with `scipy.stats.theilslopes` (robust to the allocator's steps), and the
generations are combined with the stratified Theil-Sen estimator of the seasonal Kendall test
(Hirsch, Slack & Smith 1982): the median of all *within-generation* pairwise slopes, with the
confidence interval from the summed variances of the per-group Kendall statistics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.stats import norm, theilslopes

MAX_POINTS_PER_GROUP = 300  # thinned evenly beyond this: pairs grow as n^2


@dataclass(frozen=True)
class Slope:
    slope: float | None
    low: float | None
    high: float | None
    n_points: int
    n_groups: int

    def scaled(self, k: float) -> "Slope":
        f = (lambda v: None if v is None else v * k)
        return Slope(f(self.slope), f(self.low), f(self.high), self.n_points, self.n_groups)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Series:
    """Samples of one process role in one generation: x = requests or hours, y = MB."""

    generation: int
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)


def _thin(x: np.ndarray, y: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= limit:
        return x, y
    idx = np.linspace(0, len(x) - 1, limit).round().astype(int)
    return x[idx], y[idx]


def group_slope(x: Sequence[float], y: Sequence[float], confidence: float = 0.90) -> Slope:
    """Theil-Sen slope of one generation with its interval (scipy)."""
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if len(xa) < 3 or np.ptp(xa) == 0:
        return Slope(None, None, None, len(xa), 1)
    res = theilslopes(ya, xa, alpha=confidence)
    return Slope(float(res.slope), float(res.low_slope), float(res.high_slope), len(xa), 1)


def stratified_slope(groups: Sequence[Series], confidence: float = 0.90) -> Slope:
    """Median of within-group pairwise slopes with the seasonal-Kendall (Sen) interval."""
    slopes: list[np.ndarray] = []
    var_s = 0.0
    n_points = n_groups = 0
    for g in groups:
        xa, ya = _thin(np.asarray(g.x, float), np.asarray(g.y, float), MAX_POINTS_PER_GROUP)
        n = len(xa)
        if n < 2:
            continue
        i, j = np.triu_indices(n, k=1)
        dx = xa[j] - xa[i]
        keep = dx != 0
        if not keep.any():
            continue
        slopes.append((ya[j] - ya[i])[keep] / dx[keep])
        var_s += n * (n - 1) * (2 * n + 5) / 18.0
        n_points += n
        n_groups += 1
    if not slopes:
        return Slope(None, None, None, n_points, n_groups)
    s = np.sort(np.concatenate(slopes))
    m = len(s)
    z = norm.ppf(0.5 + confidence / 2.0)
    c = z * np.sqrt(var_s)
    lo_rank = int(np.clip(np.floor((m - c) / 2.0), 0, m - 1))
    hi_rank = int(np.clip(np.ceil((m + c) / 2.0), 0, m - 1))
    return Slope(float(np.median(s)), float(s[lo_rank]), float(s[hi_rank]), n_points, n_groups)


def time_to_limit_h(headroom_mb: float | None, slope_mb_per_h: float | None) -> float | None:
    """Hours until `headroom_mb` is used up at the given growth; None if not growing."""
    if headroom_mb is None or slope_mb_per_h is None or slope_mb_per_h <= 0:
        return None
    return headroom_mb / slope_mb_per_h
