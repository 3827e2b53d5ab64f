"""The runtime's mergeable latency histograms (core.latency) and the report's array view of them
(report.hist): quantiles within 1 % of the exact ones, a merge is the histogram of the union,
the JSON form round-trips and a bad one is refused, one value and many land in the same bucket,
and a ledger written before reads the same."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_guard.core import latency
from vllm_guard.core.latency import Histogram, merged
from vllm_guard.report.hist import Hist, each_quantile
from vllm_guard.report.hist import merged as merged_arrays


def test_quantiles_are_within_one_percent_and_merges_add() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(np.log(0.04), 0.6, 20_000), rng.lognormal(np.log(0.3), 0.4, 5_000)
    ha, hb = Histogram(), Histogram()
    for v in a:
        ha.add(float(v))
    for v in b:
        hb.add(float(v))
    both = merged([ha, hb])
    exact = np.concatenate([a, b])
    for q in (0.5, 0.9, 0.99):
        got = both.quantile(q)
        assert got == pytest.approx(float(np.quantile(exact, q)), rel=0.01), q
        assert Hist.of(both).quantile(q) == pytest.approx(got, rel=1e-9)  # the report reads it the same way
        assert merged_arrays([Hist.of(ha), Hist.of(hb)]).quantile(q) == pytest.approx(got, rel=1e-9)
    assert both.n == 25_000 and Histogram.from_json(both.to_json()).counts == both.counts
    assert Hist.from_json(both.to_json()).counts == both.counts


def test_failed_requests_count_as_infinitely_slow_and_bad_json_is_refused() -> None:
    h = Histogram()
    for _ in range(98):
        h.add(0.1)
    h.inf = 2
    assert h.quantile(0.5) == pytest.approx(0.1, rel=0.02) and h.quantile(0.99) == float("inf")
    assert Histogram().quantile(0.5) is None
    for bad in ('[1, 2]', '{"x": 1}', '{"5": -1}', '{"99999": 1}'):
        with pytest.raises(ValueError):
            Histogram.from_json(bad)
        with pytest.raises(ValueError):
            Hist.from_json(bad)


def test_many_histograms_at_once_follow_the_same_rule() -> None:
    """`report.hist.each_quantile` (the per-minute plot, the bootstrap) is the one rule applied to
    each histogram: an empty one is NaN, one whose quantile falls among its failed is inf."""
    rng = np.random.default_rng(4)
    hs = [Hist.of(Histogram.of(rng.lognormal(np.log(0.05), 0.5, int(n)))) for n in rng.integers(1, 80, 30)]
    hs += [Hist(), Hist(inf=3), Hist.of(Histogram({300: 2}, inf=5))]
    for q in (0.5, 0.99):
        got = each_quantile(hs, q)
        want = [h.quantile(q) for h in hs]
        assert [None if np.isnan(g) else float(g) for g in got] == want


def test_one_bucket_rule_for_one_value_and_for_many() -> None:
    """`bucket` (the runtime and soak, one request at a time) and `buckets` (the report, arrays)
    search the same edges; the stored layout is the old one (bucket i holds [LO G^(i-1), LO G^i))."""
    x = np.concatenate([latency.EDGES, np.nextafter(latency.EDGES, 0), [0.0, -1.0, math.inf, math.nan, 1e9],
                        np.random.default_rng(1).lognormal(-3, 2, 5000)])
    assert [latency.bucket(float(v)) for v in x] == latency.buckets(x).tolist()
    for i in (1, 2, 200, latency.N_BUCKETS - 2):
        lo = latency.LO * latency.GROWTH ** (i - 1)
        assert latency.bucket(lo * 1.001) == i and latency.bucket(lo * latency.GROWTH * 0.999) == i
    assert latency.bucket(latency.HI * 10) == latency.N_BUCKETS - 1 and latency.bucket(5e-5) == 0


def test_a_ledger_written_before_keeps_its_quantiles() -> None:
    """A minute as an older runtime stored it (bucket ids of the same layout) reads as before:
    50 requests at 42 ms (bucket 306) and 50 at 210 ms (bucket 387)."""
    h = latency.Histogram.from_json('{"306":50,"387":50}')
    assert latency.bucket(0.042) == 306 and latency.bucket(0.21) == 387
    assert h.quantile(0.25) == pytest.approx(latency.LO * latency.GROWTH ** 305.5, rel=1e-12)
    assert h.quantile(0.5) == pytest.approx(latency.LO * latency.GROWTH ** 306, rel=1e-12)
    assert h.quantile(0.99) == pytest.approx(latency.LO * latency.GROWTH ** (386 + 49 / 50), rel=1e-12)
