"""The report's view of the runtime's latency histograms (`core.latency`): the same buckets and
the same quantile rule, held as numpy arrays so that a month of minutes (43 200 per replica)
merges into hours and totals in milliseconds, not one dict update per bucket.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from vllm_guard.core.latency import N_BUCKETS, Histogram, quantile, quantiles


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
        """The ledger's JSON form (`core.latency.Histogram.from_json`); ValueError when it is not one."""
        return cls.of(Histogram.from_json(text))

    @property
    def n(self) -> int:
        return int(self.cnt.sum()) + self.inf

    @property
    def counts(self) -> dict[int, int]:
        return {int(i): int(c) for i, c in zip(self.idx, self.cnt)}

    def quantile(self, q: float) -> float | None:
        """`core.latency.quantile`: the one rule."""
        return quantile(self.idx, self.cnt, q, self.inf)


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


def each_quantile(hists: Sequence[Hist], q: float) -> np.ndarray:
    """The `q` quantile of each histogram at once (NaN: empty; inf: among its failed)."""
    if not hists:
        return np.zeros(0)
    m, ids = matrix(hists)
    return quantiles(ids, m, q, np.array([h.inf for h in hists], dtype=np.float64))
