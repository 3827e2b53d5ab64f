"""A log-bucketed histogram: quantiles of millions of latencies in constant memory.

Buckets grow by 1 % from 10 us to 1 h, so any quantile is known within 1 % relative error.
The live progress line and the end-of-run summary use it; the report reads the ledger instead.
"""

from __future__ import annotations

import math

import numpy as np

_LO, _HI, _GROWTH = 1e-5, 3600.0, 1.01
_N = int(math.ceil(math.log(_HI / _LO) / math.log(_GROWTH))) + 2


class LogHistogram:
    def __init__(self) -> None:
        self.counts = np.zeros(_N, dtype=np.int64)
        self.n = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        if seconds <= _LO:
            i = 0
        else:
            i = min(_N - 1, 1 + int(math.log(seconds / _LO) / math.log(_GROWTH)))
        self.counts[i] += 1
        self.n += 1
        self.total += seconds

    def quantile(self, q: float) -> float | None:
        """Upper edge of the bucket holding quantile `q` (seconds), None when empty."""
        if self.n == 0:
            return None
        rank = max(1, math.ceil(q * self.n))
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        return _LO * _GROWTH ** max(0, i)

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None
