"""The one place that decides what a replica does: `decide(view, event, now) -> Decision`.

Pure: a typed, immutable view (`view.ReplicaView`: the machine, the facts the monitors cached,
the runtime around it) and an event (a tick, a command) in; the next machine and the effects
for the driver out. Nothing here reads a clock, a process, a file or NVML, so every path — each
strategy start to end, a successor that dies or is late, a crash in any state, a command in any
state — is tested in milliseconds (tests/test_replica_machine.py). The steps it composes (how a
recycle begins, switches and falls back, how a failure is recorded) are in `steps`; what each
command does (recycle, restart, hold, release, stop, a hand-over) is in `orders`.

Rules kept here and in `orders`, and only there (everyone else reads the machine's state and
these effects):
- a recycle begins only when the rolling rule allows (no other replica busy or down: `Facts.peers`),
  else the replica waits its turn (WAITING_TURN) serving past its limit;
- the proxy's side of a hold and a stop: held, no generation stops at its count limit
  (`EnforceLimits`) and, once no replica runs, requests fail fast (`RejectRequests`); a release
  takes them again; a stop refuses them;
- what follows from how the machine changed (`steps.Out.done`): the GPU-room watch while a parked
  successor waits for its gate (`WatchRoom`), a recycle over with nothing ready (`RecycleOver`);
- the strategy is chosen per recycle from the serving generation's readings (`strategy.choose`);
- a successor's wait is bounded by memory, not by a count: half the forecast time to the memory
  limit (any trigger); with no growth toward a limit the old generation serves until its
  successor is ready (startup and gate timeouts still fail a successor that never comes). Only a
  generation with no memory reading at all lets a request limit bound it, by `[recycle]
  max_requests_overrun`. Past the bound the old generation drains anyway and the successor takes
  over when it is ready (overlap) or when its gate opens (gated) — never thrown away for being late;
- any unexpected end of the serving generation (exit 0 included) is a failure: it is killed, and
  a successor already starting takes over; else the replica backs off;
- a cold or gated stop of the only serving replica is announced (`unready_lead`) so a balancer
  moves traffic before the gap;
- a generation that exits on its own before it ever served is a failure whose detail is the line
  its log gives (`child.death`); when the replica's previous failure was such a death of the
  same cause (`same_cause`, `Machine.last_death`), restarting cannot help: the runtime stops
  with that line (`StartCauseRepeated`) instead of backing off. A generation that serves, and
  any other failure, clears it.
"""

from __future__ import annotations

from vllm_guard.core.errors import EXIT_BOOT_ERROR
from vllm_guard.core.ledger import EndClass, FailureKind

from . import triggers
from .machine import BOOTING_STATES, SERVING_STATES, State, Wanted
from .steps import (
    KILL_WAIT_S, KV_HELD, KV_OWN, Out, add_failure, begin_or_wait, begin_recycle, check_limit, drain_current,
    exit_words, fail, gate_span, hand_over, kill_failed, kv_taken, late_room, need, never_parked, number_of,
    park_within, set_aside, standby_gate, start_cold, start_failure, stop_span, stopped_or_held, successor_failed,
    successor_lost, switch_over, unready_or_drain, wait_why, waiting_words,
)
from .orders import hold_cmd, recycle_cmd, release_cmd, restart_cmd, stop_cmd
from .strategy import Strategy, gated_fits
from .view import (
    Abandon, Decision, Detach, EnforceLimits, Event, ExitAll, Extend, Failure, Finish, GenPhase, GenView, GoLive,
    HoldCmd, LearnGate, LearnStandby, LearnStart, Leaving, OpenGate, Promote, RecycleCmd, RecycleMark, RecycleReady,
    ReleaseCmd, ReplicaView, RestartCmd, Slot, Spawn, SpawnFailed, Stop, StopCmd, Tick, Unpace, log,
)

S = State
EXTEND_EVERY_S = 10.0
# a connection accepted just before the listener closed sends its request within this: it is served here
HANDOVER_SETTLE_S = 1.0
STANDBY_TRIES = 3  # standbys in a row that die or cannot park before the replica stops keeping one


def decide(v: ReplicaView, event: Event, now: float) -> Decision:
    """What the replica does on `event`, seen as `v`, at monotonic time `now`."""
    out = Out(v.machine)
    if isinstance(event, Tick) and not v.machine.entered:  # the replica's first look
        if v.facts.stopping:
            out.to(S.EXITING, now)
        elif v.facts.hold is not None:
            out.add(EnforceLimits(False))
            out.to(S.HELD, now)
        else:
            start_cold(v, now, out, None)
    elif isinstance(event, Tick):
        _retiring(v, now, out)
        _tick(v, now, out)
    elif isinstance(event, RecycleCmd):
        recycle_cmd(v, event, now, out)
    elif isinstance(event, RestartCmd):
        restart_cmd(v, event, now, out)
    elif isinstance(event, HoldCmd):
        hold_cmd(v, now, out)
    elif isinstance(event, ReleaseCmd):
        release_cmd(v, now, out)
    elif isinstance(event, StopCmd):
        stop_cmd(v, event, now, out)
    elif isinstance(event, SpawnFailed):
        # the interpreter cannot even be run: the runtime exits (it stops every replica)
        out.add(log("backend_launch_failed", "error", replica=v.facts.index, error=event.error),
                ExitAll(EXIT_BOOT_ERROR))
        if out.m.state is not S.EXITING and out.m.can(S.EXITING):
            out.to(S.EXITING, now)
    return out.done(v, event)


# -- ticks -------------------------------------------------------------------------------------
def _tick(v: ReplicaView, now: float, out: Out) -> None:
    nxt = v.successor
    if v.facts.standby_failures and nxt is not None and nxt.standby and nxt.gate == "parked" and not nxt.died:
        # it parked: the count of lost ones starts again, whatever the replica does meanwhile (a
        # recycle that began before it parked waits for it in GATED_PARKING, never in STANDBY)
        out.add(LearnStandby(failed=False))
    st = v.machine.state
    if st in BOOTING_STATES:
        _booting(v, now, out)
    elif st in SERVING_STATES:
        _serving(v, now, out)
    elif st is S.DRAINING:
        _draining(v, now, out)
    elif st is S.HANDING_OVER:
        _handing_over(v, now, out)
    elif st is S.STOPPING:
        _stopping(v, now, out)
    elif st is S.OPENING_GATE:
        _opening_gate(v, now, out)
    elif st is S.FAILING:
        _failing(v, now, out)
    elif st is S.BACKOFF:
        if v.facts.hold is not None:
            out.to(S.HELD, now)
        elif v.machine.overdue(now):
            start_cold(v, now, out, None)


def _booting(v: ReplicaView, now: float, out: Out) -> None:
    cur, cfg = v.current, v.facts.cfg
    if cur is None:
        return
    if cur.ready_at is not None:
        rec = v.machine.recycle
        out.add(GoLive(cur.number, past_limit=cfg.server.recycle_strategy != Strategy.COLD.value))
        if not cur.gated:  # a gated start waited at its gate: its length says nothing of starving
            out.add(LearnStart(beside=cur.beside, seconds=round(cur.ready_at - cur.spawned_at, 1)))
        if rec is not None:
            out.add(RecycleReady(cur.number, round(now - rec.started_at, 3),
                                 round(now - rec.closed_at, 3) if rec.closed_at is not None else 0.0))
        out.to(S.SERVING, now, recycle=None, consecutive=0, last_death=None)
    elif cur.exit_code is not None:
        kill_failed(v, now, out, *start_failure(out, cur, f"exited with {cur.exit_code} while loading"))
    elif v.machine.overdue(now):
        fail(v, now, out, cur, FailureKind.START_TIMEOUT.value, None,
              f"not ready after {cfg.server.startup_timeout:.0f}s")
    elif not v.facts.ready_sent and now - v.facts.extend_sent_at >= EXTEND_EVERY_S:
        out.add(Extend())  # the first model load may outlast TimeoutStartSec


def _current_failed(cur: GenView) -> tuple[str, int | None, str] | None:
    if cur.exit_code is not None:
        return FailureKind.CRASH.value, cur.exit_code, f"backend exited with {cur.exit_code}"
    if cur.engine_dead is not None:
        return FailureKind.CRASH.value, None, f"engine process {cur.engine_dead} died"
    if cur.hang is not None:
        return FailureKind.HANG.value, None, cur.hang
    return None


def _serving(v: ReplicaView, now: float, out: Out) -> None:
    cur = v.current
    if cur is not None and (failed := _current_failed(cur)) is not None:
        fail(v, now, out, cur, *failed)
        return
    st = v.machine.state
    if st is S.SERVING:
        if v.facts.hold is None and not v.facts.stopping:
            t = _trigger(v, now)
            if t is not None:
                begin_or_wait(v, now, out, t.reason, t.cls, None)
            elif _standby_wanted(v):
                late, kv, why = standby_gate(v)
                out.add(Spawn(Slot.SUCCESSOR, gated=True, strategy="standby", standby=True, late=late, kv=kv),
                        log("standby_starting", replica=v.facts.index, generation=number_of(v.current),
                            late=late, kv=kv if late else None, why=why))
                out.to(S.STANDBY, now)
    elif st is S.STANDBY:
        _standby(v, now, out)
    elif st is S.WAITING_TURN:
        _waiting_turn(v, now, out)
    elif st is S.OVERLAP_STARTING:
        _overlap_starting(v, now, out)
    elif st is S.GATED_PARKING:
        _gated_parking(v, now, out)
    elif st is S.UNREADY:
        _unready(v, now, out)


def _standby_wanted(v: ReplicaView) -> bool:
    """Keep a parked next generation: on (`[server] standby = auto`), a vLLM that can park, not
    too many lost in a row, and host RAM for it beside the serving one."""
    f, cur = v.facts, v.current
    if f.cfg.server.standby != "auto" or f.gate_unavailable or f.standby_failures >= STANDBY_TRIES:
        return False
    if f.cfg.server.recycle_strategy == Strategy.COLD.value:
        return False  # cold recycles asked for: one vLLM at a time, nothing pre-started
    if cur is None or cur.fit is None:
        return False  # no memory reading of the serving generation yet
    return gated_fits(cur.fit)[0]


def _standby(v: ReplicaView, now: float, out: Out) -> None:
    """Serving, with a standby beside it: watch the standby; a trigger's recycle uses it."""
    nxt, f = v.successor, v.facts
    if nxt is None:
        out.to(S.SERVING, now)
        return
    lost = exit_words(nxt, "before it was needed")
    if lost is None and nxt.gate == "skipped":
        out.add(LearnGate(nxt.gate_reason))
        lost = f"cannot park at the gate: {nxt.gate_reason}"
    elif lost is None and nxt.gate is None and now - nxt.spawned_at > park_within(v, nxt):
        lost = f"did not reach its startup gate within {park_within(v, nxt):.0f}s"
    if lost is not None:
        out.add(Abandon(f"standby {lost}"), LearnStandby(failed=True),
                log("standby_lost", "warning", replica=f.index, generation=nxt.number, why=lost))
        out.to(S.SERVING, now)
        return
    if nxt.config != f.config_hash:  # a reload changed the configuration: it would start the old one
        why = f"launched with configuration {nxt.config or '?'}, the runtime now runs {f.config_hash}"
        out.add(Abandon(f"standby {why}"), log("standby_replaced", replica=f.index, generation=nxt.number, why=why))
        out.to(S.SERVING, now)
        return
    cur = need(v.current, "a standby with no serving generation")
    if nxt.late and nxt.gate != "parked" and (room := late_room(cur, parked=False, prior_mb_s=f.gpu_mb_s)) is not None:
        # it would take the room the serving one grows into: given up; the next one parks before CUDA
        out.add(Abandon(f"standby set aside: {room}"), LearnStandby(failed=True),
                log("standby_set_aside", "warning", replica=f.index, generation=nxt.number, why=room))
        out.to(S.SERVING, now)
        return
    if nxt.late and nxt.gate == "parked" and f.hold is None and not f.stopping \
            and late_room(cur, parked=True) is not None:
        begin_or_wait(v, now, out, triggers.GPU_MEMORY_FORECAST, EndClass.PREVENTIVE, None)
        return
    if f.hold is None and not f.stopping:
        t = _trigger(v, now)
        if t is not None:
            begin_or_wait(v, now, out, t.reason, t.cls, None)


def _trigger(v: ReplicaView, now: float) -> triggers.Trigger | None:
    cur = v.current
    if cur is None or cur.ready_at is None:
        return None
    r = triggers.Readings(ready_at=cur.ready_at, requests=cur.requests, limit=cur.limit,
                          idle_for=min(cur.idle_for, now - cur.ready_at), growth=cur.growth)
    return triggers.recycle_trigger(v.facts.cfg.recycle, r, now)


def _waiting_turn(v: ReplicaView, now: float, out: Out) -> None:
    wanted = need(v.machine.wanted, "a replica waits for its turn with no recycle wanted")
    t = _trigger(v, now)
    if t is not None and t.cls is EndClass.PREVENTIVE and wanted.cls is not EndClass.PREVENTIVE:
        wanted = Wanted(t.reason, t.cls, wanted.strategy)  # a leak caught while waiting is what it is
    why = wait_why(v, now, wanted.strategy)
    if why is None:
        out.set(wanted=None, deferred=None)
        begin_recycle(v, now, out, wanted.reason, wanted.cls, wanted.strategy)
    elif why != v.machine.deferred or wanted != v.machine.wanted:
        out.set(deferred=why, wanted=wanted)
        out.add(log("recycle_deferred", replica=v.facts.index, reason=wanted.reason, why=why))


def _late(v: ReplicaView, now: float) -> str | None:
    """Why the successor may not be waited for any longer (the trigger's urgency), or None."""
    rec, cur = v.machine.recycle, v.current
    if rec is None or cur is None:
        return None
    if rec.successor_deadline is not None and now >= rec.successor_deadline:
        return (f"its successor was not ready {now - rec.started_at:.0f} s after the recycle began, "
                f"half the time its memory forecast left")
    # a request count bounds the wait only where nothing was measured: a generation with memory
    # readings serves on until its successor is ready, bounded by the forecast above (a count ran
    # out before a 15 s start after the gate on an H200 and left 1.2 s without a serving generation)
    over = v.facts.cfg.recycle.max_requests_overrun
    if rec.reason == triggers.MAX_REQUESTS and cur.fit is None and cur.limit \
            and cur.requests >= cur.limit * (1.0 + over):
        return (f"it took {cur.requests} requests against its limit of {cur.limit} while its successor started, "
                f"with no memory reading to say waiting is safe ([recycle] max_requests_overrun {over:g})")
    return None


def _since(v: ReplicaView, nxt: GenView) -> float:
    """When the successor's wait began: its spawn, or the recycle's start for a standby."""
    rec = v.machine.recycle
    return max(nxt.spawned_at, rec.started_at) if rec is not None else nxt.spawned_at


def _past_gate(g: GenView) -> bool:
    """A successor that boots on by itself: ungated, or its gate already opened (by the runtime,
    perhaps before the engine reached it: an overlap recycle opens a standby's gate at once)."""
    return not g.gated or g.gate == "opened" or g.gate_open


def _overlap_starting(v: ReplicaView, now: float, out: Out) -> None:
    nxt, cfg = v.successor, v.facts.cfg
    if nxt is None:
        return
    if nxt.ready_at is not None:
        switch_over(v, now, out, nxt, nxt.ready_at)
    elif successor_lost(v, out, nxt, f"while starting beside generation {number_of(v.current)}"):
        unready_or_drain(v, now, out, urgent=False)
    elif now - _since(v, nxt) > cfg.server.startup_timeout:
        successor_failed(v, out, Failure(
            nxt.number, FailureKind.START_TIMEOUT.value, None,
            f"not ready after {cfg.server.startup_timeout:.0f}s while starting beside generation "
            f"{number_of(v.current)}"))
        unready_or_drain(v, now, out, urgent=False)
    elif (why := _late(v, now)) is not None:
        hand_over(v, now, out, nxt, why)


def _gated_parking(v: ReplicaView, now: float, out: Out) -> None:
    nxt, cfg = v.successor, v.facts.cfg
    if nxt is None:
        return
    if nxt.gate == "parked":
        out.add(log("generation_parked", generation=nxt.number, replica=v.facts.index,
                    parked_after_s=round(now - nxt.spawned_at, 1)))
        unready_or_drain(v, now, out, urgent=False)
    elif successor_lost(v, out, nxt, "before reaching its startup gate"):
        unready_or_drain(v, now, out, urgent=False)
    elif now - _since(v, nxt) > park_within(v, nxt):
        successor_failed(v, out, never_parked(v, nxt))
        unready_or_drain(v, now, out, urgent=False)
    elif (why := _late(v, now)) is not None:
        hand_over(v, now, out, nxt, why)


def _unready(v: ReplicaView, now: float, out: Out) -> None:
    nxt = v.successor
    if nxt is not None and _past_gate(nxt) and nxt.ready_at is not None:
        out.add(Leaving(False))
        switch_over(v, now, out, nxt, nxt.ready_at)  # a late overlap successor made it before the old one stopped
        return
    if nxt is not None and successor_lost(v, out, nxt, waiting_words(nxt)):
        return
    if v.machine.overdue(now):
        drain_current(v, now, out)


def _draining(v: ReplicaView, now: float, out: Out) -> None:
    cur, cfg = v.current, v.facts.cfg
    if cur is None:
        return
    nxt = v.successor
    if nxt is not None and _past_gate(nxt) and nxt.ready_at is not None and not v.facts.stopping:
        # a late overlap successor made it: it serves, the old one drains behind it
        switch_over(v, now, out, nxt, nxt.ready_at)
        return
    if nxt is not None and successor_lost(v, out, nxt, waiting_words(nxt)):
        return
    if cur.died:
        fail(v, now, out, cur, FailureKind.CRASH.value, cur.exit_code, "backend died while draining")
    elif cur.in_flight == 0 or now > (cur.deadline or now):
        if cur.in_flight:
            out.add(log("drain_timeout", "warning", generation=cur.number, replica=v.facts.index,
                        in_flight=cur.in_flight))
        elif v.machine.recycle is not None:
            out.add(RecycleMark("drained"))
        out.add(Stop(cur.number, kill=False, deadline=now + cfg.server.stop_timeout))
        out.to(S.STOPPING, now, stop_span(v, kill=False))


def _handing_over(v: ReplicaView, now: float, out: Out) -> None:
    """The runtime exits for the next one: once `current`'s requests are done (or the drain
    timeout passed), it is left running for the next runtime, and this replica is over."""
    cur = v.current
    if cur is None:
        out.to(S.EXITING, now)
    elif cur.died:
        fail(v, now, out, cur, FailureKind.CRASH.value, cur.exit_code, "backend died while handing over")
    elif (cur.in_flight == 0 and now - v.machine.since >= HANDOVER_SETTLE_S) or now > (v.machine.deadline or now):
        if cur.in_flight:
            out.add(log("drain_timeout", "warning", generation=cur.number, replica=v.facts.index,
                        in_flight=cur.in_flight))
        out.add(Detach(cur.number))
        out.to(S.EXITING, now)


def _stopping(v: ReplicaView, now: float, out: Out) -> None:
    cur, nxt = v.current, v.successor
    if nxt is not None and successor_lost(v, out, nxt, waiting_words(nxt)):
        return
    if cur is None or _ladder_step(v, cur, now, out):
        if v.machine.recycle is not None:
            out.add(RecycleMark("stopped"))
        _after_stop(v, now, out)


def _after_stop(v: ReplicaView, now: float, out: Out) -> None:
    """`current` is gone after a planned stop: what next."""
    f, nxt = v.facts, v.successor
    if stopped_or_held(v, now, out):
        return
    if nxt is not None and not _past_gate(nxt):
        out.to(S.OPENING_GATE, now, gate_span(v))
    elif nxt is not None:
        out.add(Promote())  # a late overlap successor: it goes on starting as the replica's own
        left = max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now)
        out.to(S.STARTING, now, left)
    else:
        start_cold(v, now, out, Strategy.COLD.value if v.machine.recycle is not None else None)


def _opening_gate(v: ReplicaView, now: float, out: Out) -> None:
    f, nxt = v.facts, v.successor
    if stopped_or_held(v, now, out):
        return
    if nxt is not None and nxt.held_back and nxt.gate != "parked":  # the old one is gone: its start is all there is
        out.add(Unpace(nxt.number))
    if nxt is None or successor_lost(v, out, nxt, waiting_words(nxt)):
        start_cold(v, now, out, Strategy.COLD.value)
    elif _past_gate(nxt):  # its gate was opened before it parked there: it is starting
        out.add(Promote())
        out.to(S.PAST_GATE, now, max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now))
    elif nxt.gate == "parked":
        waited = v.machine.age(now)
        taken = kv_taken(v, nxt.number) if not nxt.late or nxt.kv == KV_HELD else None  # else its own
        if taken is not None:  # two generations never compute on the held KV cache
            if waited < f.cfg.server.memory_release_timeout:
                return
            out.add(log("held_kv_still_mapped", "error", replica=f.index, generation=nxt.number, by=taken,
                        waited_s=round(waited, 1)))
            if nxt.late:  # it mapped it already: it must not go on
                set_aside(v, out, f"generation {taken} still maps the held KV cache")
                start_cold(v, now, out, Strategy.COLD.value)
                return
        if not nxt.late and f.nvml and f.gpu_room is not True:  # a late one holds its memory already
            if waited < f.cfg.server.memory_release_timeout:
                return
            out.add(log("gpu_memory_not_free_for_gate", "error", replica=f.index, generation=nxt.number,
                        waited_s=round(waited, 1)))
        kv = KV_OWN if taken is not None else KV_HELD
        out.add(OpenGate(nxt.number, kv=kv), log("gate_opened", generation=nxt.number, replica=f.index,
                                                 after_stop_s=round(waited, 2), late=nxt.late or None), Promote())
        out.to(S.PAST_GATE, now, f.cfg.server.startup_timeout)
    elif now - nxt.spawned_at > park_within(v, nxt):
        successor_failed(v, out, never_parked(v, nxt))
        start_cold(v, now, out, Strategy.COLD.value)


def _failing(v: ReplicaView, now: float, out: Out) -> None:
    cur = v.current
    if cur is not None and not _ladder_step(v, cur, now, out):
        return
    f, nxt = v.facts, v.successor
    if stopped_or_held(v, now, out):
        return
    if nxt is not None and not _past_gate(nxt):
        out.to(S.OPENING_GATE, now, gate_span(v))  # a parked successor (a standby): open its gate
    elif nxt is not None:
        if nxt.held_back:  # an overlap's successor still starting: nothing serves beside it now
            out.add(Unpace(nxt.number))
        out.add(Promote())
        out.to(S.STARTING, now, max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now))
    else:
        s = f.cfg.server
        out.to(S.BACKOFF, now, min(s.backoff_max, s.backoff_initial * 2 ** max(v.machine.consecutive - 1, 0)))


# -- generations on their way out ----------------------------------------------------------------
def _ladder_step(v: ReplicaView, g: GenView, now: float, out: Out) -> bool:
    """One look at a stopping generation: escalate, or finish. True once it is finished."""
    s = v.facts.cfg.server
    if g.phase is not GenPhase.STOPPING:
        return g.phase is GenPhase.DONE
    if not g.gone:
        if now <= (g.deadline or now):
            return False
        if not g.kill_sent:
            out.add(log("stop_timeout_sigkill", "warning", generation=g.number, replica=v.facts.index,
                        pids=list(g.alive)),
                    Stop(g.number, kill=True, deadline=now + KILL_WAIT_S))
            return False
        out.add(log("stop_incomplete", "error", generation=g.number, replica=v.facts.index, pids=list(g.alive)),
                Finish(g.number, leftover=g.alive))
        return True
    waited = now - (g.stop_mark if g.stop_mark is not None else now)
    if not g.gpu_free and waited < s.memory_release_timeout:
        return False
    if not g.gpu_free:
        out.add(log("gpu_memory_not_released", "error", generation=g.number, replica=v.facts.index))
    out.add(Finish(g.number))
    return True


def _retiring(v: ReplicaView, now: float, out: Out) -> None:
    """Old generations behind the current one: drain, stop, finish, each on its own deadline."""
    s = v.facts.cfg.server
    for g in v.retiring:
        if g.phase is GenPhase.DRAINING:
            if g.died:
                add_failure(out, Failure(g.number, FailureKind.CRASH.value, g.exit_code, "backend died while "
                                         f"draining (replaced by generation {number_of(v.current)})"))
                out.add(Stop(g.number, kill=True, deadline=now + KILL_WAIT_S))
                check_limit(v, out)
            elif g.in_flight == 0 or now > (g.deadline or now):
                if g.in_flight:
                    out.add(log("drain_timeout", "warning", generation=g.number, replica=v.facts.index,
                                in_flight=g.in_flight))
                out.add(Stop(g.number, kill=False, deadline=now + s.stop_timeout))
        else:
            _ladder_step(v, g, now, out)


__all__ = ["decide"]
