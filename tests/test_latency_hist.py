"""The runtime's mergeable latency histograms (core.latency) and the report's array view of them
(report.hist): quantiles within 1 % of the exact ones, a merge is the histogram of the union,
the JSON form round-trips and a bad one is refused."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_guard.core.latency import Histogram, merged
from vllm_guard.report.hist import Hist
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
