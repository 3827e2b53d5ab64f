"""Latency histograms and the one quantile rule every latency figure follows.

Buckets grow by 2 % from 0.1 ms to 2 h (bucket i holds [LO * G^(i-1), LO * G^i), `EDGES`;
bucket 0 what is below LO), so a histogram of any number of requests takes at most ~1 000
counts, two of them add by adding counts, and any quantile is known within 1 %. Stored sparse,
as JSON `{"bucket": count}`, in the ledger (`core.ledger`, `edge_minutes`): the layout is part
of every ledger written, so it never changes.

The quantile rule (`quantiles`): rank q * n (at least 0.5), found in its bucket and interpolated
geometrically inside it. The runtime's minutes and its status TTFT (`summary`), the soak's
progress line and summary, and the report's traffic, SLA, compare and soak figures all read
their p50/p99 here, so the same requests give the same figure everywhere (a ledger keeps only
histograms, so an exact order statistic could not be everyone's rule).
"""

from __future__ import annotations

import bisect
import json
import math
from typing import Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .protocol import LatencySummary

LO, HI, GROWTH = 1e-4, 7200.0, 1.02
N_BUCKETS = int(math.ceil(math.log(HI / LO) / math.log(GROWTH))) + 2
EDGES = LO * GROWTH ** np.arange(N_BUCKETS - 1)  # bucket i holds [EDGES[i-1], EDGES[i])
_EDGES = EDGES.tolist()


def bucket(seconds: float) -> int:
    """The bucket of one latency (NaN: bucket 0, as if below LO)."""
    return 0 if math.isnan(seconds) else bisect.bisect_right(_EDGES, seconds)


def buckets(seconds: ArrayLike) -> NDArray[np.int64]:
    """`bucket` of many latencies at once (the same edges, searched the same way)."""
    x = np.asarray(seconds, dtype=np.float64)
    return np.where(np.isnan(x), 0, np.searchsorted(EDGES, x, side="right")).astype(np.int64)


def within(i: ArrayLike, f: ArrayLike) -> NDArray[np.float64]:
    """The value at share `f` (0..1) of bucket i's counts, geometric inside the bucket (LO for
    bucket 0)."""
    i, f = np.asarray(i, dtype=np.float64), np.clip(np.asarray(f, dtype=np.float64), 0.0, 1.0)
    return np.where(i > 0, LO * GROWTH ** (i - 1 + f), LO)


def quantiles(ids: ArrayLike, counts: ArrayLike, q: float, inf: ArrayLike = 0) -> NDArray[np.float64]:
    """The `q` quantile (0..1) of each row of `counts` (counts over the sorted bucket `ids`; a 1-d
    `counts` is one row), `inf` more requests per row that met no bound: rank q * n (at least 0.5,
    at most n) interpolated inside its bucket, so it moves smoothly with the data, not in 2 %
    steps. inf where the rank falls among the `inf` counts, NaN for an empty row. The one rule."""
    idx = np.asarray(ids, dtype=np.int64)
    cnt = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    rows = np.arange(cnt.shape[0])
    c = np.cumsum(cnt, axis=1)
    seen = c[:, -1] if cnt.shape[1] else np.zeros(len(rows))
    n = seen + np.asarray(inf, dtype=np.float64)
    rank = np.minimum(np.maximum(q * n, 0.5), n)
    found = (n > 0) & (seen >= rank)
    out = np.where(n > 0, np.inf, np.nan)
    if found.any():
        k = np.argmax(c >= rank[:, None], axis=1)
        before = np.where(k > 0, c[rows, np.maximum(k - 1, 0)], 0.0)
        share = (rank - before) / np.where(found, cnt[rows, k], 1.0)
        out = np.where(found, within(idx[k], share), out)
    return out


def quantile(ids: ArrayLike, counts: ArrayLike, q: float, inf: int = 0) -> float | None:
    """`quantiles` of one histogram; None when it is empty."""
    v = float(quantiles(ids, counts, q, inf)[0])
    return None if math.isnan(v) else v


class Histogram:
    """Sparse counts per bucket; `inf` counts requests that met no bound (failed)."""

    __slots__ = ("counts", "inf")

    def __init__(self, counts: Mapping[int, int] | None = None, inf: int = 0) -> None:
        self.counts: dict[int, int] = dict(counts or {})
        self.inf = inf

    @classmethod
    def of(cls, seconds: ArrayLike) -> Histogram:
        """The histogram of many latencies at once."""
        ids, cnt = np.unique(buckets(seconds), return_counts=True)
        return cls({int(i): int(c) for i, c in zip(ids, cnt)})

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
        """The `q` quantile (`quantiles`); inf among the `inf` counts, None when empty."""
        keys = sorted(self.counts)
        return quantile(keys, [self.counts[k] for k in keys], q, self.inf)

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


def summary(seconds: ArrayLike) -> LatencySummary:
    """p50 and p99 of recent latencies as status shows them (seconds, to the µs), by the one rule."""
    x = np.asarray(seconds, dtype=np.float64)
    if x.size == 0:
        return LatencySummary()
    h = Histogram.of(x)
    p50, p99 = h.quantile(0.50), h.quantile(0.99)
    return LatencySummary(samples=int(x.size), p50_s=None if p50 is None else round(p50, 6),
                          p99_s=None if p99 is None else round(p99, 6))
