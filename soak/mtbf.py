"""MTBF, MTTR and availability from up time and unplanned failures (pure maths, no I/O).

Exponential model, time-truncated test (MIL-HDBK-781 / GUIDE.md §3): the point estimate is
T / r; the one-sided lower bound is 2T / chi2(1 - alpha; 2r + 2); the two-sided interval is
[2T / chi2(1 - alpha/2; 2r + 2), 2T / chi2(alpha/2; 2r)]. With r = 0 only the lower bound
exists (there is no failure to put an upper bound on the mean).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scipy.stats import chi2


@dataclass(frozen=True)
class MTBF:
    up_hours: float
    failures: int
    confidence: float
    mtbf_h: float | None  # None when r = 0 (unbounded point estimate)
    lower_one_sided_h: float
    two_sided_low_h: float | None
    two_sided_high_h: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mtbf(up_hours: float, failures: int, confidence: float = 0.90) -> MTBF:
    """MTBF with chi-square bounds at `confidence` (0.90 -> 90 % lower bound and 90 % interval)."""
    if up_hours < 0 or failures < 0:
        raise ValueError(f"up_hours={up_hours}, failures={failures}: must not be negative")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence has value {confidence!r}: must be in (0, 1)")
    alpha = 1.0 - confidence
    t2 = 2.0 * up_hours
    lower = float(t2 / chi2.ppf(1.0 - alpha, 2 * failures + 2))
    if failures == 0:
        return MTBF(up_hours, 0, confidence, None, lower, None, None)
    lo = float(t2 / chi2.ppf(1.0 - alpha / 2.0, 2 * failures + 2))
    hi = float(t2 / chi2.ppf(alpha / 2.0, 2 * failures))
    return MTBF(up_hours, failures, confidence, up_hours / failures, lower, lo, hi)


def availability(up_s: float, down_s: float) -> float | None:
    """Share of wall time in service; None when nothing was observed."""
    total = up_s + down_s
    return None if total <= 0 else up_s / total
