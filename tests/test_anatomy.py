"""Where a start goes: vLLM's phases read from the lines it logs, the runtime's own milestones,
in the order a start goes through them. On literal log lines of vLLM 0.32.0 (CPU) and 0.25.1 (GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_guard.runtime.child.anatomy import Anatomy

LOG = """\
(EngineCore pid=7) INFO 12-01 17:24:15 [cpu_model_runner.py:68] Starting to load model /tmp/tiny...
(EngineCore pid=7) INFO 12-01 17:24:16 [default_loader.py:502] Loading weights took 0.02 seconds
(EngineCore pid=7) INFO 12-01 17:24:21 [backends.py:399] Compiling a graph for compile range (1, 2048) takes 4.10 s
(EngineCore pid=7) INFO 12-01 17:24:22 [kv_cache_utils.py:2329] Maximum concurrency for 512 tokens per request: 64.00x
(EngineCore pid=7) INFO 12-01 17:24:24 [gpu_model_runner.py:6582] Graph capturing finished in 2 secs, took 0.50 GiB
(EngineCore pid=7) INFO 12-01 17:24:24 [core.py:403] init engine (profile, create kv cache, warmup model) took 7.51 s
(APIServer pid=6) INFO:     Application startup complete.
"""


def test_vllms_phases_are_noted_when_their_lines_appear_and_ordered_with_the_runtimes() -> None:
    a = Anatomy(spawned=100.0)
    a.mark("parked", 130.0)
    a.mark("gate_opened", 140.0)
    lines = LOG.splitlines(keepends=True)
    for i, line in enumerate(lines):  # each line seen 1 s after the last
        a.feed(line, 141.0 + i)
    a.mark("health_ok", 149.0)
    a.mark("ready", 149.5)
    a.mark("ready", 160.0)  # the first time counts
    assert a.phases() == [("spawned", 0.0), ("parked", 30.0), ("gate_opened", 40.0), ("model_load_started", 41.0),
                          ("weights_loaded", 42.0), ("compiled", 43.0), ("kv_allocated", 44.0),
                          ("graphs_captured", 45.0), ("engine_up", 46.0), ("api_up", 47.0), ("health_ok", 49.0),
                          ("ready", 49.5)]
    assert a.after("gate_opened")[-1] == ("ready", 9.5)  # the part of the start after the gate


def test_lines_that_say_nothing_of_a_phase_change_nothing() -> None:
    a = Anatomy(spawned=0.0)
    a.feed("(EngineCore pid=7) INFO [ompmultiprocessing.py:185] local_rank=0, core ids=[0]\n", 5.0)
    assert a.phases() == [("spawned", 0.0)] and a.after("gate_opened") == []


def test_health_is_asked_often_once_the_engine_is_up_and_seldom_before() -> None:
    """After the gate, /health polled once a second cost up to a second of the recycle's gap
    (`api_up` to `health_ok` 0.2-0.8 s on the H200): once vLLM logs its engine up, ask often."""
    from vllm_guard.runtime.replica.monitors import HEALTH_EVERY_S, HEALTH_SOON_S, health_every_s
    a = Anatomy(spawned=0.0)
    assert health_every_s(None) == HEALTH_EVERY_S
    for i, line in enumerate(LOG.splitlines(keepends=True)[:5]):  # up to the CUDA graphs
        a.feed(line, 1.0 + i)
        assert health_every_s(a) == HEALTH_EVERY_S
    a.feed(LOG.splitlines(keepends=True)[5], 7.0)  # "init engine ... took"
    assert health_every_s(a) == HEALTH_SOON_S <= 0.1


def test_lines_the_tail_has_not_read_when_the_generation_is_ready_are_noted_at_the_answer(tmp_path: Path) -> None:
    """The log tail ends at ready; with /health asked every 50 ms the answer can come before
    the tail read 'Application startup complete' (the phase was lost from status and ledger)."""
    from vllm_guard.runtime.replica.monitors import catch_up
    log = tmp_path / "generation-2.log"
    log.write_text(LOG)
    a = Anatomy(spawned=0.0)
    for i, line in enumerate(LOG.splitlines(keepends=True)[:6]):  # the tail got up to the engine
        a.feed(line, 1.0 + i)
    catch_up(a, log, answered=9.0)
    assert a.at["engine_up"] == 6.0 and a.at["api_up"] == 9.0  # seen before: unchanged; new: at the answer
    catch_up(a, tmp_path / "gone.log", answered=10.0)  # no log: nothing changes
    assert a.at["api_up"] == 9.0


def test_a_health_wait_under_way_ends_once_the_engine_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait between two /health polls began at the slow pace; vLLM logs its engine up in the
    middle of it: the wait ends within a fast step, not at the end of the slow one (made an hour
    here, so that only the phase can end it)."""
    import asyncio

    from vllm_guard.runtime.replica import monitors
    monkeypatch.setattr(monitors, "HEALTH_EVERY_S", 3600.0)
    a = Anatomy(spawned=0.0)

    async def main() -> None:
        waiting = asyncio.create_task(monitors.until_health_due(a))
        await asyncio.sleep(2 * monitors.HEALTH_SOON_S)
        assert not waiting.done()  # still at the slow pace: nothing logged yet
        a.feed(LOG.splitlines(keepends=True)[5], 7.0)  # "init engine ... took"
        await asyncio.wait_for(waiting, timeout=60)  # an hour otherwise

    asyncio.run(main())
