"""The arrival schedule, presets and [soak] config: pure functions, checked on their numbers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from vllm_guard.runtime.config import ConfigError
from vllm_guard.soak.arrivals import BLOCK, Schedule, prompt_ids
from vllm_guard.soak.hist import LogHistogram
from vllm_guard.soak.scenarios import PRESETS, scenario, validate_section


def _take(s: Schedule, start: int, n: int) -> list[float]:
    return [t for _, t in itertools.islice(s.offsets(start), n)]


@pytest.mark.parametrize("start", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
def test_resume_reproduces_the_same_offsets(start: int) -> None:
    s = Schedule(rate=20.0, burstiness=0.5, seed=7)
    full = _take(s, 0, start + 50)
    assert _take(s, start, 50) == full[start:]
    assert prompt_ids(7, start, 16) == prompt_ids(7, start, 16) != prompt_ids(7, start + 1, 16)


def test_fixed_span_puts_the_nth_request_at_n_over_rate() -> None:
    for seed in range(3):
        s = Schedule(rate=4.0, seed=seed, span_requests=60)
        t = _take(s, 0, 60)
        assert t[-1] == pytest.approx(15.0) and _take(s, 30, 30) == t[30:]
        raw = _take(Schedule(rate=4.0, seed=seed), 0, 60)
        assert np.allclose(np.diff(t) / np.diff(raw), t[-1] / raw[-1])
    with pytest.raises(ValueError):
        Schedule(rate=4.0, mode="burst", span_requests=10)


def test_poisson_and_gamma_rates_and_burstiness() -> None:
    for burst, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        t = np.array(_take(Schedule(rate=50.0, burstiness=burst, seed=1), 0, 20000))
        gaps = np.diff(t)
        assert 20000 / t[-1] == pytest.approx(50.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma: CV = 1/sqrt(shape)


def test_burst_mode_keeps_the_mean_rate_inside_on_windows() -> None:
    t = np.array(_take(Schedule(rate=10.0, seed=2, mode="burst", burst_period_s=20.0, burst_duty=0.25), 0, 4000))
    assert np.all(np.mod(t, 20.0) < 5.0)
    assert 4000 / t[-1] == pytest.approx(10.0, rel=0.05)


def test_closed_loop_schedule_is_immediate_and_bad_values_refused() -> None:
    assert _take(Schedule(rate=math.inf), 0, 5) == [0.0] * 5
    for kw in ({"rate": 0.0}, {"rate": 1.0, "burstiness": 0.0}, {"rate": 1.0, "mode": "wave"}):
        with pytest.raises(ValueError):
            Schedule(**kw)


def test_presets_scale_to_the_context_with_a_note() -> None:
    for name, (p, o, c) in PRESETS.items():
        big = scenario(name, 200_000)
        assert (big.prompt_tokens, big.output_tokens, big.concurrency, big.note) == (p, o, c, "")
        small = scenario(name, 1024)
        assert small.prompt_tokens + small.output_tokens <= 1024 - 8
        k = min(1.0, (1024 - 8) / (p + o))
        assert abs(small.prompt_tokens - k * p) <= 1 and abs(small.output_tokens - k * o) <= 1
        assert ("max_model_len 1024" in small.note) == (p + o > 1016)
    assert scenario("custom", 512, 100, 20, 3).concurrency == 3
    with pytest.raises(ConfigError):
        scenario("S9", 512)


def test_soak_section_names_the_bad_key_and_value() -> None:
    assert validate_section({"rate": 5, "duration": "24h", "scenario": "S4"}) == {
        "rate": 5.0, "duration": "24h", "scenario": "S4"}
    with pytest.raises(ConfigError, match=r"\[soak\] rat has value 5"):
        validate_section({"rat": 5})
    with pytest.raises(ConfigError, match=r"\[soak\] concurrency has value 'x'"):
        validate_section({"concurrency": "x"})
    with pytest.raises(ConfigError, match=r"\[soak\] duration has value 'soon'"):
        validate_section({"duration": "soon"})


def test_histogram_quantiles_within_one_percent() -> None:
    x = np.random.default_rng(3).lognormal(-4, 1.5, 50000)
    h = LogHistogram()
    for v in x:
        h.add(float(v))
    for q in (0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(np.quantile(x, q), rel=0.015)
    assert LogHistogram().quantile(0.5) is None
