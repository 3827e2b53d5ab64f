"""The report's view of the runtime's latency histograms (`core.latency`): the same buckets and
quantile rule, held as numpy arrays so that a month of minutes (43 200 per replica) merges into
hours and totals in milliseconds, not one dict update per bucket.
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Sequence

import numpy as np

from vllm_guard.core.latency import N_BUCKETS, Histogram, within


class Hist:
    """Sparse counts: sorted bucket ids and their counts; `inf` requests that met no bound."""

    __slots__ = ("idx", "cnt", "inf")

    def __init__(self, idx: np.ndarray | None = None, cnt: np.ndarray | None = None, inf: int = 0) -> None:
        self.idx = np.zeros(0, dtype=np.int64) if idx is None else idx
        self.cnt = np.zeros(0, dtype=np.int64) if cnt is None else cnt
        self.inf = inf

    @classmethod
    def of(cls, h: Histogram) -> Hist:
        if not h.counts:
            return cls(inf=h.inf)
        keys = sorted(h.counts)
        return cls(np.array(keys, dtype=np.int64), np.array([h.counts[k] for k in keys], dtype=np.int64), h.inf)

    @classmethod
    def from_json(cls, text: str | None) -> Hist:
        """The ledger's JSON form; ValueError when it is not one."""
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a latency histogram is a JSON object of bucket -> count")
        if not data:
            return cls()
        try:
            idx = np.fromiter((int(k) for k in data), dtype=np.int64, count=len(data))
            cnt = np.fromiter(data.values(), dtype=np.int64, count=len(data))
        except (TypeError, ValueError) as e:
            raise ValueError(f"buckets and counts must be whole numbers ({e})") from e
        if idx.min() < 0 or idx.max() >= N_BUCKETS or cnt.min() < 0:
            raise ValueError("a bucket or a count out of range")
        order = np.argsort(idx)
        return cls(idx[order], cnt[order])

    @property
    def n(self) -> int:
        return int(self.cnt.sum()) + self.inf

    @property
    def counts(self) -> dict[int, int]:
        return {int(i): int(c) for i, c in zip(self.idx, self.cnt)}

    def quantile(self, q: float) -> float | None:
        """As `core.latency.Histogram.quantile` (interpolated inside the bucket)."""
        n = self.n
        if n == 0:
            return None
        rank = min(max(q * n, 0.5), n)
        c = np.cumsum(self.cnt)
        if not len(c) or c[-1] < rank:
            return math.inf
        k = int(np.searchsorted(c, rank, side="left"))
        before = float(c[k - 1]) if k else 0.0
        return within(int(self.idx[k]), (rank - before) / float(self.cnt[k]))


def merged(hists: Iterable[Hist], inf: int = 0) -> Hist:
    """The sum of many histograms (one bincount)."""
    hs = list(hists)
    if not hs:
        return Hist(inf=inf)
    idx = np.concatenate([h.idx for h in hs])
    cnt = np.concatenate([h.cnt for h in hs])
    extra = inf + sum(h.inf for h in hs)
    if not len(idx):
        return Hist(inf=extra)
    dense = np.bincount(idx, weights=cnt, minlength=N_BUCKETS)
    nz = np.flatnonzero(dense)
    return Hist(nz.astype(np.int64), dense[nz].round().astype(np.int64), extra)


def matrix(hists: Sequence[Hist]) -> tuple[np.ndarray, np.ndarray]:
    """Per-histogram counts over the buckets any of them uses: (len x buckets, bucket ids)."""
    ids = np.unique(np.concatenate([h.idx for h in hists])) if hists else np.zeros(0, dtype=np.int64)
    m = np.zeros((len(hists), len(ids)))
    for r, h in enumerate(hists):
        m[r, np.searchsorted(ids, h.idx)] = h.cnt
    return m, ids
