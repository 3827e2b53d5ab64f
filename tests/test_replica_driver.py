"""Every recycle and failure path of a replica, start to end, in milliseconds: the real driver
and the real `decide` over a simulated box (tests/replica_world.py: generations that boot, park,
crash and die on command; the real books on a real SQLite ledger).

The real-vLLM proof of the same paths is tests/test_strategies_real.py (overlap and gated in
`make test`) and tests/test_strategies.py (replicas, in the long tier)."""

from __future__ import annotations

import signal
import sqlite3
from dataclasses import replace
from pathlib import Path

from replica_world import GIB, Plan, World, run, tweak

from vllm_guard.core import plugin as plugin_contract
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.ledger import EndClass
from vllm_guard.runtime.replica.machine import State
from vllm_guard.runtime.replica.strategy import MemoryFit
from vllm_guard.runtime.replica.triggers import Growth
from vllm_guard.runtime.replica.view import HoldCmd, RecycleCmd, ReleaseCmd, RestartCmd, StopCmd

S = State


def cfg(**server: object) -> GuardConfig:
    c = tweak(GuardConfig(), "server", unready_lead=0.0, standby="off")  # the standby's own scenarios turn it on
    for k, v in server.items():
        section, _, key = k.partition("__")
        c = tweak(c, section, **{key: v})
    return c


async def serving(w: World, replica: int = 0) -> None:
    await w.run_until(lambda: w.drivers[replica].state is S.SERVING)


def rows(w: World, sql: str) -> list[tuple[object, ...]]:
    w.ledger.close()
    db = sqlite3.connect(w.tmp / "ledger.sqlite")
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


# -- each strategy, start to end ----------------------------------------------------------------
def test_a_cold_recycle_drains_stops_and_starts_the_next(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        d = await w.command(RecycleCmd("test", strategy="cold"))
        assert d.reply.accepted and "draining generation 1" in d.reply.detail
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.states()[-5:] == [S.SERVING, S.DRAINING, S.STOPPING, S.STARTING, S.SERVING]
        old = w.gen(1)
        assert old.ended and old.backend.signals == [signal.SIGTERM] and old.end_reason == ("test", EndClass.SCHEDULED)

    w = run(tmp_path, scenario, cfg())
    (rec,) = rows(w, "SELECT strategy, drained_at, stopped_at, ready_at, downtime_s FROM recycles")
    assert rec[0] == "cold" and all(rec[1:4]) and rec[4] > 0


def test_overlap_switches_with_no_gap_and_the_old_one_retires_behind(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        d = await w.command(RecycleCmd("test"))  # auto: two generations fit in the world's memory
        assert d.reply.accepted and "overlap" in d.reply.detail
        assert w.drivers[0].state is S.OVERLAP_STARTING and 1 in w.routes and 1 in w.past_limit
        assert w.gen(2).backend.cpus == (12, 13, 14, 15) and not w.gen(1).backend.cpus  # it starts beside 1
        await w.run_until(lambda: w.drivers[0].current.number == 2)
        assert w.unpinned == [(2, "it serves", False)]  # all CPUs from the moment it serves
        assert w.drivers[0].state is S.SERVING and set(w.routes) == {2}  # the switch: never a moment with none
        assert w.handed_over == [1]  # its streams go on at generation 2: one generation computes
        assert [g.number for g in w.drivers[0].retiring] == [1]
        await w.run_until(lambda: not w.drivers[0].retiring)
        assert w.gen(1).ended and w.gen(1).backend.signals == [signal.SIGTERM]
        assert w.states() == [S.STARTING, S.SERVING, S.OVERLAP_STARTING, S.SERVING]

    w = run(tmp_path, scenario, cfg(server__start_cpus="auto"))
    (rec,) = rows(w, "SELECT strategy, downtime_s FROM recycles")
    assert rec == ("overlap", 0.0)


def test_a_recycle_asked_for_before_the_first_memory_reading_waits_for_it_not_cold(tmp_path: Path) -> None:
    """`auto` chooses from memory readings: asked the moment a generation serves, before its
    first reading, it would go cold (a gap in service: the demo's forced recycle did). It waits
    in `waiting_turn`, serving, then overlaps once the reading says two fit."""
    async def scenario(w: World) -> None:
        w.reading_after_s = 3.0
        await serving(w)
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted and "no memory reading yet" in d.reply.detail, d.reply.detail
        assert w.drivers[0].state is S.WAITING_TURN and set(w.routes) == {1} and w.number == 1
        await w.run_until(lambda: w.drivers[0].current.number == 2)
        assert w.gen(2).backend.cpus == () and w.unpinned == []  # start_cpus is off by default: all CPUs
        assert w.states() == [S.STARTING, S.SERVING, S.WAITING_TURN, S.OVERLAP_STARTING, S.SERVING]

    w = run(tmp_path, scenario, cfg())
    assert rows(w, "SELECT strategy, downtime_s FROM recycles") == [("overlap", 0.0)]


def test_without_any_memory_reading_a_recycle_waits_at_most_so_long(tmp_path: Path) -> None:
    """No reading ever (the monitor cannot read): after READING_WAIT_S the recycle goes on,
    cold, as `auto` must without readings."""
    from vllm_guard.runtime.replica.steps import READING_WAIT_S

    async def scenario(w: World) -> None:
        w.reading_after_s = 1e9
        await serving(w)
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted and w.drivers[0].state is S.WAITING_TURN
        waited = await w.run_until(lambda: w.drivers[0].state is not S.WAITING_TURN)
        assert READING_WAIT_S - 2 <= waited <= READING_WAIT_S + 2 and w.drivers[0].state is S.DRAINING

    w = run(tmp_path, scenario, cfg())
    assert [r[0] for r in rows(w, "SELECT strategy FROM recycles")] == ["cold"]


def test_gated_parks_then_opens_the_gate_only_once_the_old_one_is_gone(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.nvml = True
        await serving(w)
        w.has_room = False  # NVML shows the old generation's memory still held
        d = await w.command(RecycleCmd("test", strategy="gated"))
        assert d.reply.accepted and "gate" in d.reply.detail
        await w.run_until(lambda: w.drivers[0].state is S.OPENING_GATE)
        assert len(w.room_watched) == 1 and not w.room_unwatched  # watched from the moment it waits for room
        assert w.gen(1).ended and not w.gen(2).gate_report.state == "opened"
        for _ in range(3):
            await w.step()
        assert w.drivers[0].state is S.OPENING_GATE  # no room yet: the gate stays shut
        assert w.gen(2).backend.cpus == (12, 13, 14, 15) and w.unpinned == []  # parked as it started: beside 1
        w.has_room = True
        await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.unpinned == [(2, "its gate opens", False)]  # all CPUs before its start after the gate
        assert w.drivers[0].current.number == 2
        assert w.states()[-6:] == [S.GATED_PARKING, S.DRAINING, S.STOPPING, S.OPENING_GATE, S.PAST_GATE, S.SERVING]
        assert len(w.room_unwatched) == 1  # and no longer once its gate opened
        assert w.handed_over == []  # no generation was live to take the old one's streams: they finished there

    w = run(tmp_path, scenario, cfg(server__start_cpus="auto"))
    (rec,) = rows(w, "SELECT strategy, ready_at FROM recycles")
    assert rec[0] == "gated" and rec[1]


def test_a_cold_or_gated_stop_of_the_only_replica_is_announced_first(tmp_path: Path) -> None:
    c = cfg()
    c = tweak(c, "server", unready_lead=10.0)

    async def scenario(w: World) -> None:
        await serving(w)
        await w.command(RecycleCmd("test", strategy="cold"))
        assert w.drivers[0].state is S.UNREADY and w.leaving == {1} and 1 in w.routes  # still serving
        took = await w.run_until(lambda: w.drivers[0].state is S.DRAINING)
        assert took >= 10.0

    run(tmp_path, scenario, c)


# -- successors that fail, or are late ------------------------------------------------------------
def test_a_successor_that_dies_is_its_own_failure_and_the_recycle_goes_on_cold(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(exit_at_s=2.0))
        await w.command(RecycleCmd("test", strategy="overlap"))
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 3)
        assert w.gen(1).end_reason[1] is EndClass.SCHEDULED  # the serving one did not fail
        assert [(f.generation, f.kind) for f in w.books.failures] == [(2, "start_failed")]
        assert "RuntimeError: simulated" in list(w.books.failures)[0].detail  # vLLM's root cause, from its log

    w = run(tmp_path, scenario, cfg())
    assert rows(w, "SELECT strategy FROM recycles") == [("cold",)]


def test_an_overlap_successor_still_starting_when_the_old_one_crashes_stops_pacing_and_takes_over(
        tmp_path: Path) -> None:
    """An overlap's successor paces its engine start for the generation serving beside it; when
    that one crashes first, the successor is told once to go at full speed and takes over."""
    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(ready_s=30.0))
        await w.command(RecycleCmd("test", strategy="overlap"))
        await w.run_until(lambda: w.number >= 2)
        assert w.gen(2).paced and not w.gen(1).paced and w.unpaced == []
        w.gen(1).backend.rc = 1
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.unpaced == [2] and w.books.failures.total == 1
        assert w.unpinned == [(2, "nothing serves beside its start any more", False)]

    run(tmp_path, scenario, cfg(server__start_cpus="auto"))


def test_an_unpaced_successor_started_on_a_few_cpus_gets_them_all_once_the_old_one_crashes(tmp_path: Path) -> None:
    """Without pacing (`[patches] pace_beside = 0`) a successor still starts on the CPUs a start
    beside a serving generation gets; when that generation dies it gets them all at once, not
    only once it serves: its start is the whole outage now."""
    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(ready_s=30.0))
        await w.command(RecycleCmd("test", strategy="overlap"))
        await w.run_until(lambda: w.number >= 2)
        assert not w.gen(2).paced and w.gen(2).backend.cpus == (12, 13, 14, 15)
        w.gen(1).backend.rc = 1
        await w.run_until(lambda: w.drivers[0].state is S.STARTING)
        assert w.unpinned == [(2, "nothing serves beside its start any more", False)] and w.unpaced == []
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.unpinned == [(2, "nothing serves beside its start any more", False)]

    run(tmp_path, scenario, cfg(patches__pace_beside=0.0, server__start_cpus="auto"))


def test_a_successor_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(ready_s=10_000))
        await w.command(RecycleCmd("test", strategy="overlap"))
        await w.run_until(lambda: w.drivers[0].current.number == 3, limit_s=2000)
        assert [f.kind for f in w.books.failures] == ["start_timeout"]

    c = cfg()
    c = tweak(c, "server", startup_timeout=100.0)
    c = tweak(c, "recycle", max_requests_overrun=100.0)  # not late by count: only the start timeout applies
    run(tmp_path, scenario, c)


def test_a_successor_that_never_reaches_its_gate_fails_and_one_that_cannot_park_is_learned(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(park_s=10_000))
        await w.command(RecycleCmd("test", strategy="gated"))
        await w.run_until(lambda: w.drivers[0].current.number == 3, limit_s=2000)
        assert [f.kind for f in w.books.failures] == ["start_failed"]
        assert "did not reach its startup gate" in list(w.books.failures)[0].detail
        await serving(w)
        w.plans.append(Plan(gate="skipped"))
        await w.command(RecycleCmd("test", strategy="gated"))
        await w.run_until(lambda: w.drivers[0].current.number == 5)
        assert w.learned_gate == "simulated: cannot park" and len(list(w.books.failures)) == 1  # not a failure
        w.fit = MemoryFit(host_available_mb=3.5 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)
        await serving(w)
        d = await w.command(RecycleCmd("auto"))  # two do not fit; parking is learned to be impossible
        assert "draining" in d.reply.detail

    c = cfg()
    c = tweak(c, "server", gate_timeout=60.0)
    run(tmp_path, scenario, c)


def test_a_late_overlap_successor_takes_over_after_the_old_one_drains(tmp_path: Path) -> None:
    """With no memory reading of the serving generation, the request limit's overrun bounds the
    wait: used up while the successor starts, the old generation drains anyway; the successor is
    not thrown away, it takes over once ready."""
    c = cfg()
    c = tweak(c, "recycle", max_requests=100)
    c = tweak(c, "recycle", max_requests_overrun=0.5)
    c = tweak(c, "server", recycle_strategy="overlap")  # (auto would wait for a reading first)

    async def scenario(w: World) -> None:
        w.reading_after_s = 10_000.0  # nothing measured
        await serving(w)
        w.plans.append(Plan(ready_s=60.0))
        t = w.drivers[0].current.target
        t.dispatched = 100  # the limit: the recycle begins
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING
        t.dispatched = 149
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING
        t.dispatched = 150  # 100 + 50 %: late
        await w.step()
        assert w.drivers[0].state is S.DRAINING and w.drivers[0].successor.number == 2
        await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.drivers[0].current.number == 2 and not w.books.failures.total
        assert w.states()[-5:] == [S.OVERLAP_STARTING, S.DRAINING, S.STOPPING, S.STARTING, S.SERVING]

    run(tmp_path, scenario, c)


def test_a_slow_successor_is_waited_for_past_any_count_while_memory_is_not_urgent(tmp_path: Path) -> None:
    """The H200 sequence: `--max-requests 300` at 10 req/s, the successor's start took longer than
    the overrun's 150 requests, and the old generation stopped first (1.2 s without a serving
    generation). With memory readings that show no growth toward a limit, the old generation
    serves on past any count and the switch leaves no gap."""
    c = cfg()
    c = tweak(c, "recycle", max_requests=300)
    c = tweak(c, "recycle", max_requests_overrun=0.5)

    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(beside_ready_s=40.0, ready_s=40.0))
        t = w.drivers[0].current.target
        t.dispatched = 300
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING
        for _ in range(38):  # 10 req/s: 380 more, far past 300 * 1.5
            t.dispatched += 10
            await w.step()
            assert w.drivers[0].state is S.OVERLAP_STARTING, t.dispatched
        await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.drivers[0].current.number == 2
        (rec,) = list(w.books.recycles)
        assert rec.strategy == "overlap" and rec.downtime_s == 0.0, rec

    run(tmp_path, scenario, c)


def test_a_request_limit_recycle_with_a_forecast_waits_half_of_it(tmp_path: Path) -> None:
    c = cfg()
    c = tweak(c, "recycle", max_requests=100)

    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(ready_s=500.0))
        g = w.drivers[0].current
        g.note_memory(g.memory, Growth(rss_mb=100.0), w.fit, to_limit_s=60.0)  # out of memory in a minute
        g.target.dispatched = 100
        began = w.now
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING
        await w.run_until(lambda: w.drivers[0].state is S.DRAINING)
        assert 0.5 * 60.0 - 1.0 <= w.now - began <= 0.5 * 60.0 + 1.0

    run(tmp_path, scenario, c)


def test_a_memory_triggered_recycle_stops_waiting_before_its_forecast_limit(tmp_path: Path) -> None:
    c = cfg()
    c = tweak(c, "recycle", max_host_rss_growth_mb=500.0)

    async def scenario(w: World) -> None:
        await serving(w)
        w.plans.append(Plan(ready_s=500.0))
        g = w.drivers[0].current
        g.note_memory(g.memory, Growth(rss_mb=600.0), w.fit, to_limit_s=40.0)  # OOM in 40 s at this rate
        began = w.now
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING
        await w.run_until(lambda: w.drivers[0].state is S.DRAINING)
        assert w.now - began <= 0.5 * 40.0 + 1.0, "the old generation was kept past half its forecast"
        assert any("handed over" in (r.strategy_reason or "") for r in w.books.recycles)

    run(tmp_path, scenario, c)


# -- failures ----------------------------------------------------------------------------------
def test_a_crash_kills_backs_off_and_starts_again(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        w.gen(1).backend.rc = 0  # vLLM's API server exits 0 when its engine dies
        await w.step()
        assert w.drivers[0].state is S.FAILING and w.gen(1).backend.signals == [signal.SIGKILL]
        await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.states()[-4:] == [S.FAILING, S.BACKOFF, S.STARTING, S.SERVING]
        (f,) = list(w.books.failures)
        assert (f.kind, f.generation, f.restored_at is not None) == ("crash", 1, True)

    run(tmp_path, scenario, cfg())


def test_a_crash_while_a_gated_successor_is_parked_opens_its_gate_instead_of_a_cold_start(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        await w.command(RecycleCmd("test", strategy="gated"))
        await w.run_until(lambda: w.gen(2).gate_report is not None)
        w.gen(1).backend.rc = 1
        await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.drivers[0].current.number == 2 and w.number == 2  # no third start
        assert S.BACKOFF not in w.states() and w.states()[-3:] == [S.OPENING_GATE, S.PAST_GATE, S.SERVING]

    run(tmp_path, scenario, cfg())


def test_a_hang_is_a_failure_of_its_own_kind(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        w.gen(1).note_hang("probe failed (timeout) and no token moved in 30 s")
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert [f.kind for f in w.books.failures] == ["hang"]

    run(tmp_path, scenario, cfg())


def test_max_failures_in_the_window_gives_up(tmp_path: Path) -> None:
    c = cfg()
    c = tweak(c, "server", max_failures=2)

    async def scenario(w: World) -> None:
        # two different causes: the window decides, not the rule of the same cause twice
        w.plans += [Plan(exit_at_s=1.0, log="RuntimeError: one\n"), Plan(exit_at_s=1.0, log="OSError: two\n")]
        await w.run_until(lambda: w.drivers[0].state is S.EXITING)
        assert w.gave_up == 1 and [f.kind for f in w.books.failures] == ["start_failed", "start_failed"]
        assert w.start_failed == []

    run(tmp_path, scenario, c)


SIGILL_LOG = """\
(EngineCore_DP0 pid=7) INFO 12-05 10:00:01 [core.py:1] Initializing a V1 LLM engine (v0.32.0)
Fatal Python error: Illegal instruction

Current thread 0x00007f52a2665b80 (most recent call first):
  File "/v/lib/python3.11/site-packages/vllm/_custom_ops.py", line 3927 in cpu_attention_with_kv_cache
  File "/v/lib/python3.11/site-packages/vllm/v1/attention/backends/cpu_attn.py", line 310 in forward
(EngineCore_DP0 pid=7) ERROR 12-05 10:00:09 [multiproc_executor.py:1] Worker proc VllmWorker-0 died unexpectedly (exit code: -4)
"""


def test_the_same_start_failure_twice_ends_the_runtime_with_its_line(tmp_path: Path) -> None:
    """A worker killed by SIGILL in the same frame twice: no third start, however far the
    failure window's limit is; the one line names the process, the signal, the phase, the frame."""
    c = cfg()
    c = tweak(c, "server", max_failures=10)

    async def scenario(w: World) -> None:
        w.plans += [Plan(exit_at_s=1.0, log=SIGILL_LOG), Plan(exit_at_s=1.0, log=SIGILL_LOG)]
        await w.run_until(lambda: w.drivers[0].state is S.EXITING)
        assert w.number == 2 and w.gave_up == 0
        (line,) = w.start_failed
        assert line == ('generation 2 died before serving: worker killed by SIGILL in phase "starting vLLM": '
                        'Fatal Python error: Illegal instruction at vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache')
        assert [f.detail for f in w.books.failures] == [line.replace("generation 2", "generation 1"), line]

    run(tmp_path, scenario, c)


def test_a_start_that_served_forgets_the_last_death(tmp_path: Path) -> None:
    """SIGILL, then a generation that serves, then SIGILL again: not twice in a row."""
    c = cfg()
    c = tweak(c, "server", max_failures=10)

    async def scenario(w: World) -> None:
        w.plans += [Plan(exit_at_s=1.0, log=SIGILL_LOG), Plan()]
        await serving(w)
        w.plans += [Plan(exit_at_s=1.0, log=SIGILL_LOG)]
        await w.command(RestartCmd("test"))
        await w.run_until(lambda: w.number == 4 and w.drivers[0].state is S.SERVING)
        assert w.start_failed == []

    run(tmp_path, scenario, c)


# -- commands ----------------------------------------------------------------------------------
def test_restart_hold_release_and_stop(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        d = await w.command(RestartCmd("stuck"))
        assert d.reply.accepted and w.drivers[0].state is S.FAILING
        w.hold = "maintenance"
        d = await w.command(HoldCmd("maintenance"))
        await w.run_until(lambda: w.drivers[0].state is S.HELD)
        assert w.number == 1  # nothing started while held
        d = await w.command(RecycleCmd("x"))
        assert not d.reply.accepted and "held" in d.reply.detail
        w.hold = None
        await w.command(ReleaseCmd())
        await serving(w)
        w.shutting_down = True
        await w.command(StopCmd())
        await w.run_until(lambda: w.drivers[0].state is S.EXITING)
        assert w.gen(2).end_reason == ("shutdown", EndClass.SCHEDULED) and w.gen(2).ended

    run(tmp_path, scenario, cfg())


def test_a_hold_stops_a_successor_and_the_serving_generation_keeps_serving(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        await w.command(RecycleCmd("test", strategy="overlap"))
        w.hold = "xid 79"
        await w.command(HoldCmd("xid 79"))
        assert w.drivers[0].state is S.SERVING and w.drivers[0].successor is None
        await w.run_until(lambda: w.gen(2).ended)
        assert 1 in w.routes and w.gen(2).backend.signals == [signal.SIGKILL]

    run(tmp_path, scenario, cfg())


def test_a_hold_makes_the_limit_soft_and_fails_requests_once_nothing_runs(tmp_path: Path) -> None:
    """The proxy's side of a hold is decide's: no generation stops at its count limit while held;
    requests fail fast only once every replica is held (one that serves keeps serving); a
    release takes them again; a stop refuses them."""
    async def scenario(w: World) -> None:
        await serving(w, 0)
        await serving(w, 1)
        w.hold = "xid 79"
        for i in (0, 1):
            await w.command(HoldCmd("xid 79"), i)
        assert not w.enforce_limit and w.rejecting is None  # both still serve
        w.gen(1).backend.rc = 1
        await w.run_until(lambda: w.drivers[0].state is S.HELD)
        assert w.rejecting is None, "replica 1 still serves"
        w.drivers[1].current.backend.rc = 1
        await w.run_until(lambda: w.drivers[1].state is S.HELD)
        assert w.rejecting == "held: xid 79"
        w.hold = None
        for i in (0, 1):
            await w.command(ReleaseCmd(), i)
        assert w.enforce_limit and w.rejecting is None
        await w.run_until(lambda: all(d.state is S.SERVING for d in w.drivers))
        w.shutting_down = True
        await w.command(StopCmd())
        assert w.rejecting == "vllm-guard is shutting down"

    run(tmp_path, scenario, cfg(), replicas=2)


def test_a_recycle_ended_by_a_hold_is_over_in_the_books(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w)
        await w.command(RecycleCmd("test", strategy="overlap"))
        assert w.books.recycle_of(0) is not None
        w.hold = "maintenance"
        await w.command(HoldCmd("maintenance"))
        assert w.books.recycle_of(0) is None and w.drivers[0].state is S.SERVING

    run(tmp_path, scenario, cfg())


def test_a_second_sigterm_shortens_the_ladder(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.term_s = 1000.0  # a vLLM that ignores SIGTERM
        await serving(w)
        w.gen(1).target.in_flight = 1  # a request that never ends
        w.shutting_down = True
        await w.command(StopCmd())
        assert w.drivers[0].state is S.DRAINING
        await w.command(StopCmd(second=True))
        assert w.drivers[0].state is S.STOPPING
        await w.command(StopCmd(second=True))
        assert w.gen(1).backend.signals == [signal.SIGTERM, signal.SIGKILL]
        await w.run_until(lambda: w.drivers[0].state is S.EXITING)

    run(tmp_path, scenario, cfg())


# -- rolling replicas --------------------------------------------------------------------------
def test_rolling_replicas_recycle_one_at_a_time_and_never_while_one_is_down(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        await serving(w, 0)
        await serving(w, 1)
        for i in (0, 1):
            d = await w.command(RecycleCmd("test", strategy="cold"), i)
            assert d.reply.accepted
        assert w.drivers[0].state is S.DRAINING and w.drivers[1].state is S.WAITING_TURN
        at_once = 0
        while not (w.drivers[0].state is S.SERVING and w.drivers[1].state is S.SERVING
                   and w.drivers[1].current.number > 2):
            await w.step()
            busy = sum(1 for d in w.drivers if d.machine.recycle is not None)
            at_once = max(at_once, busy)
        assert at_once == 1
        # replica 0 down (crashed): replica 1's recycle waits until it is back
        w.drivers[0].current.backend.rc = 1
        await w.step()
        d = await w.command(RecycleCmd("test", strategy="cold"), 1)
        assert w.drivers[1].state is S.WAITING_TURN and "replica 0 is" in d.reply.detail
        await w.run_until(lambda: w.drivers[1].state is S.DRAINING)
        assert w.drivers[0].state is S.SERVING

    run(tmp_path, scenario, cfg(), replicas=2)


def test_an_inherited_backlog_does_not_trigger_the_next_recycle(tmp_path: Path) -> None:
    c = cfg()
    c = tweak(c, "recycle", max_requests=50)

    async def scenario(w: World) -> None:
        await serving(w)
        t = w.drivers[0].current.target
        t.dispatched, t.inherited = 50, 50  # 50 requests that waited through its start
        for _ in range(3):
            await w.step()
        assert w.drivers[0].state is S.SERVING
        t.dispatched = 100  # and 50 of its own
        await w.step()
        assert w.drivers[0].state is not S.SERVING

    run(tmp_path, scenario, c)


# -- the parked standby --------------------------------------------------------------------------
def standby_cfg() -> GuardConfig:
    c = cfg()
    c = tweak(c, "server", standby="auto")
    return c


def test_a_standby_parks_once_the_generation_serves_and_a_crash_opens_its_gate(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.nvml = True
        await w.run_until(lambda: w.drivers[0].state is S.STANDBY)
        await w.run_until(lambda: w.gen(2).gate_report is not None and w.gen(2).gate_report.state == "parked")
        assert w.drivers[0].current.number == 1 and set(w.routes) == {1}  # the standby takes nothing
        w.gen(1).backend.rc = 1  # a crash
        crashed = w.now
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.number == 2, "a cold start instead of the standby"
        assert w.states()[-4:] == [S.FAILING, S.OPENING_GATE, S.PAST_GATE, S.SERVING]
        (f,) = list(w.books.failures)
        assert f.kind == "crash" and f.restored_at is not None
        assert w.now - crashed <= 2.0 + 2.0 + 2.0  # kill + memory gone + the part after the gate (after_gate_s)
        await w.run_until(lambda: w.drivers[0].state is S.STANDBY and w.number == 3)  # and a new standby

    run(tmp_path, scenario, standby_cfg())


def test_a_recycle_uses_the_parked_standby_instead_of_a_new_start(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.fit = MemoryFit(host_available_mb=3.5 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)  # two do not fit
        await w.run_until(lambda: w.gen(2).gate_report is not None if w.number >= 2 else False)
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted and w.drivers[0].state is S.DRAINING  # parked already: straight to the drain
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert S.OPENING_GATE in w.states() and w.number in (2, 3)  # no start but the next standby
        (rec,) = list(w.books.recycles)
        assert rec.strategy == "gated" and "standby" in (rec.strategy_reason or "")

    run(tmp_path, scenario, standby_cfg())


KV_FIT = MemoryFit(host_available_mb=20 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB, gpu_free_mb=3.5 * GIB,
                   gpu_total_mb=24 * GIB, gpu_footprint_mb=1.3 * GIB, vllm_free_mb=60 * GIB, vllm_needs_mb=12 * GIB)


def test_a_standby_on_the_held_kv_cache_parks_ready_and_a_recycle_and_a_crash_open_it_at_once(tmp_path: Path) -> None:
    """With a holder on a GPU, generation 1 maps the held KV cache; its standby starts whole (late
    gate: weights and KV cache mapped, graphs captured) and parks ready. A recycle drains and
    stops the old one and opens the standby's gate without waiting for GPU room (it holds its
    memory already), telling it the held KV cache; so does a crash. Only the part after the gate
    is left (`after_gate_s`)."""
    async def scenario(w: World) -> None:
        w.nvml, w.kv_holder, w.fit, w.has_room = True, True, KV_FIT, False  # vLLM's start check never passes now
        w.plans = [Plan(), Plan(park_s=5.0, after_gate_s=0.5), Plan(park_s=5.0, after_gate_s=0.5), Plan(park_s=5.0)]
        await w.run_until(lambda: w.number >= 2 and w.gen(2).gate_report is not None)
        assert w.spawned[:2] == [(1, False, "held"), (2, True, "held")], w.spawned
        assert w.gen(2).gate_report.state == "parked" and set(w.routes) == {1}
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted
        t0 = w.now
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.now - t0 < 10, "the late gate waited for GPU room (memory_release_timeout is 60 s)"
        assert plugin_contract.gate_kv(w.gen(2).gate) == "held"
        (rec,) = list(w.books.recycles)
        assert rec.strategy == "gated" and "standby" in (rec.strategy_reason or "")
        await w.run_until(lambda: w.number >= 3 and w.gen(3).gate_report is not None)
        assert w.spawned[2] == (3, True, "held")  # the next standby parks ready too
        w.gen(2).backend.rc = 1  # a crash
        crashed = w.now
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 3)
        assert w.now - crashed < 10, "the crash's standby waited for GPU room"
        assert plugin_contract.gate_kv(w.gen(3).gate) == "held"
        assert w.books.failures.total == 1

    run(tmp_path, scenario, standby_cfg())


def test_on_a_card_where_two_fit_the_standby_parks_ready_on_its_own_kv_cache_and_opens_beside(
        tmp_path: Path) -> None:
    """With a holder on a large card the serving generation maps the held KV cache, and two whole
    generations fit: the standby starts whole on a KV cache of its own and parks ready; a recycle
    opens it beside the serving one (an overlap: 0 s), and the next standby takes the held KV
    cache, now free; a crash opens it at once. Parked ready on the serving one's KV cache it could
    only have taken over once the old generation was gone (1.6 s on an H100)."""
    async def scenario(w: World) -> None:
        w.nvml, w.kv_holder, w.fit = True, True, replace(KV_FIT, gpu_free_mb=40 * GIB)
        w.plans = [Plan(), Plan(park_s=5.0, after_gate_s=0.5), Plan(park_s=5.0, after_gate_s=0.5), Plan(park_s=5.0)]
        await w.run_until(lambda: w.number >= 2 and w.gen(2).gate_report is not None)
        assert w.spawned[:2] == [(1, False, "held"), (2, True, "own")], w.spawned
        w.fit = KV_FIT  # the parked standby's memory shows as used now: it needs no more
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert S.OVERLAP_STARTING in w.states() and S.DRAINING not in w.states()[:-1], w.states()
        await w.run_until(lambda: w.number >= 3 and w.gen(3).gate_report is not None)
        assert w.spawned[2][:2] == (3, True), w.spawned  # ready too: on its own KV cache while 1 still maps the held one
        w.gen(2).backend.rc = 1  # a crash
        crashed = w.now
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 3)
        assert w.now - crashed < 10, "the crash's standby waited"
        assert w.books.failures.total == 1
        # each standby paced its start beside the serving generation, and had finished it when needed
        assert w.gen(2).paced and w.gen(3).paced and not w.gen(1).paced and w.unpaced == []

    w = run(tmp_path, scenario, standby_cfg())
    assert rows(w, "SELECT strategy, downtime_s FROM recycles") == [("overlap", 0.0)]


def test_a_standby_still_starting_when_the_serving_generation_dies_stops_pacing_at_once(tmp_path: Path) -> None:
    """A standby that parks once ready paces its engine start for the generation serving beside it
    (`patches/pace.py`). When that one dies first, nothing serves beside the standby any more: the
    runtime tells it once to go at full speed, while it still starts, and takes it when it is ready."""
    async def scenario(w: World) -> None:
        w.nvml, w.kv_holder, w.fit, w.has_room = True, True, KV_FIT, False
        w.plans = [Plan(), Plan(park_s=30.0, after_gate_s=0.5), Plan(park_s=5.0)]
        await w.run_until(lambda: w.number >= 2)
        assert w.spawned[1] == (2, True, "held") and w.gen(2).paced and not w.gen(1).paced
        w.gen(1).backend.rc = 1  # a crash, long before the standby parks
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert w.unpaced == [2] and w.gen(2).unpaced
        assert w.books.failures.total == 1

    run(tmp_path, scenario, standby_cfg())


def test_a_late_standby_beside_a_leak_is_used_early_or_given_up(tmp_path: Path) -> None:
    """A late standby holds the room the serving generation would leak into. Parked, it is used
    once the serving one's memory forecast falls under a minute (a preventive recycle onto it);
    still starting, it is set aside as soon as the forecast shows growth, and the next standby
    parks before CUDA. The GPU leak outlives its generation: the next one's standby parks before
    CUDA at once, before that generation's own forecast exists."""
    async def scenario(w: World) -> None:
        w.nvml, w.kv_holder, w.fit, w.has_room = True, True, KV_FIT, False
        w.plans = [Plan(), Plan(park_s=5.0, after_gate_s=0.5), Plan(park_s=30.0), Plan(park_s=5.0, after_gate_s=0.5),
                   Plan(park_s=5.0)]
        await w.run_until(lambda: w.number >= 2 and w.gen(2).gate_report is not None)
        assert w.spawned[1] == (2, True, "held")
        w.gen(1).to_limit_s, w.gen(1).gpu_mb_s = 30.0, 0.0  # its host memory leaks: out of memory in 30 s
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        (rec,) = list(w.books.recycles)
        assert rec.reason == "gpu_memory_forecast" and rec.strategy == "gated", rec
        assert w.gen(1).end_reason[1] is EndClass.PREVENTIVE
        await w.run_until(lambda: w.number >= 3)
        assert w.spawned[2] == (3, True, "held"), "no forecast yet: the next standby starts late"
        w.gen(2).to_limit_s, w.gen(2).gpu_mb_s = 120.0, 30.0  # its GPU memory leaks: no room for a late start
        await w.run_until(lambda: w.number >= 4)
        assert w.gen(3).ended or w.gen(3).backend.rc is not None, "the late standby was not set aside"
        assert w.spawned[3] == (4, False, "held"), "the next standby did not park before CUDA"
        await w.run_until(lambda: w.gen(4).gate_report is not None)
        await w.command(RecycleCmd("test"))
        await w.run_until(lambda: w.number >= 5)
        assert w.gen(4).gpu_mb_s is None, "generation 4 has a forecast of its own already"
        assert w.spawned[4] == (5, False, "held"), "at generation 2's rate the next standby has no room to start whole"
        assert w.drivers[0].gpu_rates == {1: 0.0, 2: 30.0} and w.drivers[0].gpu_mb_s == 15.0, \
            "the prior: the median of the generations' own last rates"
        assert not w.books.failures.total

    run(tmp_path, scenario, standby_cfg())


def test_without_a_held_kv_cache_the_standby_parks_before_cuda_as_ever(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.nvml, w.fit = True, KV_FIT  # no holder on a GPU: nothing held
        await w.run_until(lambda: w.number >= 2 and w.gen(2).gate_report is not None)
        assert w.spawned[:2] == [(1, False, ""), (2, False, "")], w.spawned
        await w.command(RecycleCmd("test"))
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 2)
        assert plugin_contract.gate_kv(w.gen(2).gate) is None, "a KV cache said to an engine that maps none"

    run(tmp_path, scenario, standby_cfg())


def test_a_cold_recycle_asked_for_sets_the_parked_standby_aside_and_starts_from_scratch(tmp_path: Path) -> None:
    """`recycle --strategy cold` is obeyed with a standby parked: the standby is stopped, the old
    generation drains and stops, and the next one starts cold (it had become a gated recycle)."""
    async def scenario(w: World) -> None:
        await w.run_until(lambda: w.number >= 2 and w.gen(2).gate_report is not None)
        assert w.gen(2).gate_report.state == "parked"
        d = await w.command(RecycleCmd("test", strategy="cold"))
        assert d.reply.accepted
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 3)
        assert w.gen(2).ended and w.gen(2).end_reason[1] is EndClass.SCHEDULED
        assert w.gen(2).gate_report.state == "parked", "the set-aside standby's gate was opened"
        assert S.OPENING_GATE not in w.states() and w.states()[-4:] == [S.DRAINING, S.STOPPING, S.STARTING,
                                                                         S.SERVING]
        (rec,) = list(w.books.recycles)
        assert rec.strategy == "cold"
        assert not w.books.failures.total
        await w.run_until(lambda: w.drivers[0].state is S.STANDBY and w.number == 4)  # a new standby after it

    run(tmp_path, scenario, standby_cfg())


def test_configured_cold_recycles_keep_no_standby(tmp_path: Path) -> None:
    c = standby_cfg()
    c = tweak(c, "server", recycle_strategy="cold")

    async def scenario(w: World) -> None:
        await serving(w)
        for _ in range(30):
            await w.step()
        assert w.number == 1 and w.drivers[0].state is S.SERVING

    run(tmp_path, scenario, c)


def test_a_standby_that_dies_is_replaced_and_is_no_failure_of_the_serving_generation(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.plans += [Plan(), Plan(exit_at_s=2.0), Plan(exit_at_s=2.0), Plan(exit_at_s=2.0), Plan()]
        await w.run_until(lambda: w.number >= 4 and w.drivers[0].state is S.SERVING)
        for _ in range(20):
            await w.step()
        assert w.number == 4, "a standby was started again after three were lost in a row"
        assert not w.books.failures.total and w.drivers[0].current.number == 1
        assert all(w.gen(n).ended and w.gen(n).end_reason[1] is EndClass.SCHEDULED for n in (2, 3, 4))

    run(tmp_path, scenario, standby_cfg())


def test_a_standby_that_parks_while_a_recycle_waits_for_it_ends_the_run_of_lost_ones(tmp_path: Path) -> None:
    """One standby is lost; the next is still booting when a recycle begins, and parks while the
    recycle waits for it (GATED_PARKING, never STANDBY). It parked: the count of lost standbys
    starts again. Left at one, every later standby would park before CUDA (5-6 s gated recycles
    on the 7B shape, instead of 1.6 s parked ready)."""
    async def scenario(w: World) -> None:
        w.fit = MemoryFit(host_available_mb=3.5 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)  # two do not fit
        w.plans += [Plan(), Plan(exit_at_s=2.0), Plan(park_s=20.0), Plan()]
        await w.run_until(lambda: w.number >= 3)
        assert w.standby_failures.get(0) == 1 and w.gen(3).gate_report is None
        d = await w.command(RecycleCmd("test"))
        assert d.reply.accepted and w.drivers[0].state is S.GATED_PARKING
        await w.run_until(lambda: w.drivers[0].state is not S.GATED_PARKING)
        assert w.gen(3).gate_report is not None and w.gen(3).gate_report.state == "parked"
        assert w.standby_failures.get(0) == 0, "a standby that parked left the run of lost ones standing"
        await w.run_until(lambda: w.drivers[0].state is S.SERVING and w.drivers[0].current.number == 3)
        assert not w.books.failures.total

    run(tmp_path, scenario, standby_cfg())


def test_an_overlap_recycle_that_opened_a_booting_standbys_gate_takes_it_once_the_old_one_is_gone(
        tmp_path: Path) -> None:
    """A recycle begins while the standby still boots toward its gate: overlap opens the gate at
    once, the memory forecast's half runs out, the old generation drains and stops. The standby
    then arrives at a gate already open and goes on (`opened`, never `parked`): the replica waits
    for it to be ready, not for a park that never comes (it waited out `gate_timeout`, then
    started cold, 5.6 minutes without service in `make demo`)."""
    c = standby_cfg()
    c = tweak(c, "recycle", max_requests=100)

    async def scenario(w: World) -> None:
        w.plans += [Plan(), Plan(park_s=60.0, after_gate_s=2.0)]
        await w.run_until(lambda: w.drivers[0].state is S.STANDBY)
        g = w.drivers[0].current
        g.note_memory(g.memory, Growth(rss_mb=10.0), w.fit, to_limit_s=20.0)  # 10 s to wait, at most
        g.target.dispatched = 100
        await w.step()
        assert w.drivers[0].state is S.OVERLAP_STARTING and w.gen(2).gate_report is None
        # late by the forecast: the old one drains while the standby still boots
        await w.run_until(lambda: w.drivers[0].current is None or w.drivers[0].current.number == 2)
        took = await w.run_until(lambda: w.drivers[0].state is S.SERVING)
        assert w.drivers[0].current.number == 2 and w.gen(2).gate_report.state == "opened"
        assert took < 120.0 < c.server.gate_timeout, "waited for a park that never comes"
        assert not w.books.failures.total and w.number in (2, 3)
        assert S.OPENING_GATE not in w.states()[-4:], w.states()

    run(tmp_path, scenario, c)


def test_no_standby_without_room_for_it(tmp_path: Path) -> None:
    async def scenario(w: World) -> None:
        w.fit = MemoryFit(host_available_mb=2 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)
        await serving(w)
        for _ in range(10):
            await w.step()
        assert w.number == 1 and w.drivers[0].state is S.SERVING

    run(tmp_path, scenario, standby_cfg())
