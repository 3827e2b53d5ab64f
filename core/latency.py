"""Mergeable latency histograms: the runtime writes one per minute, the report adds them up.

Buckets grow by 2 % from 0.1 ms to 2 h (bucket i holds [LO * G^(i-1), LO * G^i); bucket 0 what
is below LO), so a histogram of any number of requests takes at most ~1 000 counts, two of them
add by adding counts, and any quantile is known within 1 % (interpolated inside its bucket).
Stored sparse, as JSON `{"bucket": count}`, in the ledger (`core.ledger`, `edge_minutes`).
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Mapping

LO, HI, GROWTH = 1e-4, 7200.0, 1.02
_LOG_G = math.log(GROWTH)
N_BUCKETS = int(math.ceil(math.log(HI / LO) / _LOG_G)) + 2


def bucket(seconds: float) -> int:
    if not seconds > LO:  # also NaN
        return 0
    return min(N_BUCKETS - 1, 1 + int(math.log(seconds / LO) / _LOG_G))


def middle(i: int) -> float:
    """The value a bucket stands for (its geometric middle; LO for bucket 0)."""
    return LO if i <= 0 else LO * GROWTH ** (i - 0.5)


def within(i: int, f: float) -> float:
    """The value at share `f` (0..1) of bucket i's counts, geometric inside the bucket."""
    return LO if i <= 0 else LO * GROWTH ** (i - 1 + min(max(f, 0.0), 1.0))


class Histogram:
    """Sparse counts per bucket; `inf` counts requests that met no bound (failed)."""

    __slots__ = ("counts", "inf")

    def __init__(self, counts: Mapping[int, int] | None = None, inf: int = 0) -> None:
        self.counts: dict[int, int] = dict(counts or {})
        self.inf = inf

    @property
    def n(self) -> int:
        return sum(self.counts.values()) + self.inf

    def add(self, seconds: float) -> None:
        i = bucket(seconds)
        self.counts[i] = self.counts.get(i, 0) + 1

    def merge(self, other: Histogram) -> Histogram:
        for i, c in other.counts.items():
            self.counts[i] = self.counts.get(i, 0) + c
        self.inf += other.inf
        return self

    def quantile(self, q: float) -> float | None:
        """The `q` quantile (0..1), interpolated inside its bucket (so it moves smoothly with the
        data, not in 2 % steps); inf when it falls among the `inf` counts, None when empty."""
        n = self.n
        if n == 0:
            return None
        rank = min(max(q * n, 0.5), n)
        seen = 0
        for i in sorted(self.counts):
            c = self.counts[i]
            if c and seen + c >= rank:
                return within(i, (rank - seen) / c)
            seen += c
        return math.inf

    def to_json(self) -> str:
        return json.dumps({str(i): c for i, c in sorted(self.counts.items())}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> Histogram:
        """ValueError for text that is not such a histogram."""
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a latency histogram is a JSON object of bucket -> count")
        out = {}
        for k, v in data.items():
            i = int(k)
            if not isinstance(v, int) or v < 0 or not 0 <= i < N_BUCKETS:
                raise ValueError(f"bucket {k!r}: count {v!r} is not a count of a known bucket")
            out[i] = v
        return cls(out)


def merged(hists: Iterable[Histogram]) -> Histogram:
    out = Histogram()
    for h in hists:
        out.merge(h)
    return out
