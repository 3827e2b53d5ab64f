"""The arrival schedule, presets, stored parameters and [soak] config: pure functions, checked on
their numbers."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from vllm_guard.core.config import SoakConfig, from_data
from vllm_guard.core.errors import ConfigError, ProtocolError
from vllm_guard.loadgen.arrivals import BLOCK, Schedule, prompt_ids
from vllm_guard.loadgen.params import SoakParams
from vllm_guard.loadgen.scenarios import PRESETS, scenario


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
    """[soak] is core.config.SoakConfig: the one coercion, durations in seconds."""
    soak = from_data({"soak": {"rate": 5, "duration": "24h", "scenario": "S4"}}).soak
    assert (soak.rate, soak.duration, soak.scenario, soak.seed) == (5.0, 86400.0, "S4", None)
    assert isinstance(soak, SoakConfig)
    with pytest.raises(ConfigError, match=r"\[soak\] rat is not a known key"):
        from_data({"soak": {"rat": 5}})
    with pytest.raises(ConfigError, match=r"\[soak\] concurrency has value 'x'"):
        from_data({"soak": {"concurrency": "x"}})
    with pytest.raises(ConfigError, match=r"\[soak\] duration has value 'soon'"):
        from_data({"soak": {"duration": "soon"}})


def _params(**kw: object) -> SoakParams:
    base: dict[str, object] = dict(
        url="http://x", model="m", max_model_len=512, scenario="S1", prompt_tokens=16, output_tokens=8,
        concurrency=None, rate=math.inf, burstiness=1.0, mode="steady", burst_period_s=60.0, burst_duty=0.25,
        seed=3, duration_s=60.0, timeout_s=600.0, max_requests=None, state_dir=None)
    return SoakParams(**{**base, **kw})  # type: ignore[arg-type]


def test_stored_parameters_round_trip_and_refuse_another_version() -> None:
    """--resume reads runs.params back: a closed loop's inf rate survives JSON; a run written with
    a key this version does not know (or without one it needs) is refused, not guessed."""
    p = _params(tokenizer="/m", span_requests=10)
    assert SoakParams.from_json(p.to_json()) == p and SoakParams.from_json(p.to_json()).closed_loop
    old = json.loads(_params().to_json())
    del old["span_requests"], old["tokenizer"], old["sample_interval_s"]  # an older soak's run: defaults
    assert SoakParams.from_json(json.dumps(old)).span_requests == 0
    with pytest.raises(ProtocolError, match="lacks seed"):
        SoakParams.from_json(json.dumps({k: v for k, v in old.items() if k != "seed"}))
    with pytest.raises(ProtocolError, match="unknown rate_hz"):
        SoakParams.from_json(json.dumps({**old, "rate_hz": 4}))
