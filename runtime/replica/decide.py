"""The one place that decides what a replica does: `decide(view, event, now) -> Decision`.

Pure: a typed, immutable view (`view.ReplicaView`: the machine, the facts the monitors cached,
the runtime around it) and an event (a tick, a command) in; the next machine and the effects
for the driver out. Nothing here reads a clock, a process, a file or NVML, so every path — each
strategy start to end, a successor that dies or is late, a crash in any state, a command in any
state — is tested in milliseconds (tests/test_replica_machine.py).

Rules kept here, and only here (everyone else reads the machine's state and these effects):
- a recycle begins only when the rolling rule allows (no other replica busy or down: `Facts.peers`),
  else the replica waits its turn (WAITING_TURN) serving past its limit;
- the proxy's side of a hold and a stop: held, no generation stops at its count limit
  (`EnforceLimits`) and, once no replica runs, requests fail fast (`RejectRequests`); a release
  takes them again; a stop refuses them;
- what follows from how the machine changed (`_Out.done`): the GPU-room watch while a parked
  successor waits for its gate (`WatchRoom`), a recycle over with nothing ready (`RecycleOver`);
- the strategy is chosen per recycle from the serving generation's readings (`strategy.choose`);
- a successor's wait is bounded by the trigger's urgency: a memory trigger gives it half the
  forecast time to the memory limit, a request limit lets the old generation take at most
  `[recycle] max_requests_overrun` of its limit more; past that, the old generation drains anyway
  and the successor takes over when it is ready (overlap) or when its gate opens (gated) — it is
  never thrown away for being late;
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

from dataclasses import replace
from typing import TypeVar

from vllm_guard.core.errors import EXIT_BOOT_ERROR
from vllm_guard.core.ledger import EndClass, FailureKind

from ..child.death import same_cause
from . import triggers
from .machine import (
    BOOTING_STATES, RECYCLABLE_STATES, RECYCLING_STATES, RESTARTABLE_STATES, SERVING_STATES, Machine, Recycle,
    State, Wanted, idle, rolling, serving_count,
)
from .strategy import AUTO, MemoryFit, Strategy, choose, gated_fits
from .view import (
    Abandon, Decision, Drain, Effect, EnforceLimits, Event, Extend, ExitAll, Failure, Finish, GenPhase, GenView, GiveUp,
    GoLive, HoldCmd, LearnGate, LearnStandby, LearnStart, Leaving, OpenGate, PastLimit, Promote, RecycleBegan,
    RecycleCmd, RecycleMark, RecycleNote, RecycleOver, RecycleReady, RejectRequests, ReleaseCmd, ReplicaView, Reply,
    RestartCmd, Slot, Spawn, SpawnFailed, StartCauseRepeated, Stop, StopCmd, Tick, WatchRoom, log,
)

S = State
KILL_WAIT_S = 10.0  # after SIGKILL, how long a generation's processes get to disappear
EXTEND_EVERY_S = 10.0
URGENCY_SHARE = 0.5  # a memory-triggered recycle gives its successor this share of the time left
STANDBY_TRIES = 3  # standbys in a row that die or cannot park before the replica stops keeping one
READING_WAIT_S = 30.0  # longest a planned recycle waits for a new generation's first memory reading
T = TypeVar("T")


class ViewMismatch(RuntimeError):
    """A view the machine's state rules out (a bug in `decide` or its driver, not an input): a
    state that serves with no current generation, a replica waiting its turn with no recycle."""


def _need(x: T | None, what: str) -> T:
    """`x`, which the state guarantees; ViewMismatch (never skipped, unlike `assert` under -O)."""
    if x is None:
        raise ViewMismatch(what)
    return x


class _Out:
    """The decision being built: the machine so far and the effects in order."""

    def __init__(self, m: Machine) -> None:
        self.m = m
        self.fx: list[Effect] = []

    def add(self, *effects: Effect) -> _Out:
        self.fx.extend(effects)
        return self

    def to(self, state: State, now: float, timeout: float | None = None, **changes: object) -> _Out:
        self.m = self.m.to(state, now, timeout, **changes)
        return self

    def set(self, **changes: object) -> _Out:
        self.m = replace(self.m, **changes)  # type: ignore[arg-type]
        return self

    def done(self, v: ReplicaView, event: Event) -> Decision:
        """The decision, with what follows from how the machine changed, said once here for
        every path: the GPU-room watch of a parked successor (in OPENING_GATE; first, so a
        launch that fails after it cannot skip it), a recycle over with nothing ready (the
        books close it), a hold's rejection once nothing runs."""
        before, m, f = v.machine, self.m, v.facts
        moved = m.seq != before.seq
        first: tuple[Effect, ...] = ()
        if moved and (before.state is S.OPENING_GATE) != (m.state is S.OPENING_GATE):
            first = (WatchRoom(m.state is S.OPENING_GATE),)
        if before.recycle is not None and m.recycle is None and not any(isinstance(e, RecycleReady) for e in self.fx):
            self.add(RecycleOver())
        if m.state is S.HELD and (moved or isinstance(event, HoldCmd)) and f.hold is not None and not f.stopping \
                and idle(f.peers, skip=f.index):
            self.add(RejectRequests(f"held: {f.hold}"))
        return Decision(m, first + tuple(self.fx))


def decide(v: ReplicaView, event: Event, now: float) -> Decision:
    """What the replica does on `event`, seen as `v`, at monotonic time `now`."""
    out = _Out(v.machine)
    if isinstance(event, Tick) and not v.machine.entered:  # the replica's first look
        if v.facts.stopping:
            out.to(S.EXITING, now)
        elif v.facts.hold is not None:
            out.add(EnforceLimits(False))
            out.to(S.HELD, now)
        else:
            _start_cold(v, now, out, None)
    elif isinstance(event, Tick):
        _retiring(v, now, out)
        _tick(v, now, out)
    elif isinstance(event, RecycleCmd):
        _recycle_cmd(v, event, now, out)
    elif isinstance(event, RestartCmd):
        _restart_cmd(v, event, now, out)
    elif isinstance(event, HoldCmd):
        _hold_cmd(v, now, out)
    elif isinstance(event, ReleaseCmd):
        _release_cmd(v, now, out)
    elif isinstance(event, StopCmd):
        _stop_cmd(v, event, now, out)
    elif isinstance(event, SpawnFailed):
        # the interpreter cannot even be run: the runtime exits (it stops every replica)
        out.add(log("backend_launch_failed", "error", replica=v.facts.index, error=event.error),
                ExitAll(EXIT_BOOT_ERROR))
        if out.m.state is not S.EXITING and out.m.can(S.EXITING):
            out.to(S.EXITING, now)
    return out.done(v, event)


# -- ticks -------------------------------------------------------------------------------------
def _tick(v: ReplicaView, now: float, out: _Out) -> None:
    st = v.machine.state
    if st in BOOTING_STATES:
        _booting(v, now, out)
    elif st in SERVING_STATES:
        _serving(v, now, out)
    elif st is S.DRAINING:
        _draining(v, now, out)
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
            _start_cold(v, now, out, None)


def _booting(v: ReplicaView, now: float, out: _Out) -> None:
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
        _failed(v, now, out, *_start_failure(out, cur, f"exited with {cur.exit_code} while loading"))
    elif v.machine.overdue(now):
        _fail(v, now, out, cur, FailureKind.START_TIMEOUT.value, None,
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


def _serving(v: ReplicaView, now: float, out: _Out) -> None:
    cur = v.current
    if cur is not None and (failed := _current_failed(cur)) is not None:
        _fail(v, now, out, cur, *failed)
        return
    st = v.machine.state
    if st is S.SERVING:
        if v.facts.hold is None and not v.facts.stopping:
            t = _trigger(v, now)
            if t is not None:
                _begin_or_wait(v, now, out, t.reason, t.cls, None)
            elif _standby_wanted(v):
                out.add(Spawn(Slot.SUCCESSOR, gated=True, strategy="standby", standby=True),
                        log("standby_starting", replica=v.facts.index, generation=_n(v.current)))
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


def _standby(v: ReplicaView, now: float, out: _Out) -> None:
    """Serving, with a standby beside it: watch the standby; a trigger's recycle uses it."""
    nxt, f = v.successor, v.facts
    if nxt is None:
        out.to(S.SERVING, now)
        return
    lost = _exited(nxt, "before it was needed")
    if lost is None and nxt.gate == "skipped":
        out.add(LearnGate(nxt.gate_reason))
        lost = f"cannot park at the gate: {nxt.gate_reason}"
    elif lost is None and nxt.gate is None and now - nxt.spawned_at > f.cfg.server.gate_timeout:
        lost = f"did not reach its startup gate within {f.cfg.server.gate_timeout:.0f}s"
    if lost is not None:
        out.add(Abandon(f"standby {lost}"), LearnStandby(failed=True),
                log("standby_lost", "warning", replica=f.index, generation=nxt.number, why=lost))
        out.to(S.SERVING, now)
        return
    if nxt.gate == "parked" and f.standby_failures:
        out.add(LearnStandby(failed=False))
    if f.hold is None and not f.stopping:
        t = _trigger(v, now)
        if t is not None:
            _begin_or_wait(v, now, out, t.reason, t.cls, None)


def _trigger(v: ReplicaView, now: float) -> triggers.Trigger | None:
    cur = v.current
    if cur is None or cur.ready_at is None:
        return None
    r = triggers.Readings(ready_at=cur.ready_at, requests=cur.requests, limit=cur.limit,
                          idle_for=min(cur.idle_for, now - cur.ready_at), growth=cur.growth)
    return triggers.recycle_trigger(v.facts.cfg.recycle, r, now)


def _waiting_turn(v: ReplicaView, now: float, out: _Out) -> None:
    wanted = _need(v.machine.wanted, "a replica waits for its turn with no recycle wanted")
    t = _trigger(v, now)
    if t is not None and t.cls is EndClass.PREVENTIVE and wanted.cls is not EndClass.PREVENTIVE:
        wanted = Wanted(t.reason, t.cls, wanted.strategy)  # a leak caught while waiting is what it is
    why = _wait_why(v, now, wanted.strategy)
    if why is None:
        out.set(wanted=None, deferred=None)
        _begin(v, now, out, wanted.reason, wanted.cls, wanted.strategy)
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
    over = v.facts.cfg.recycle.max_requests_overrun
    if rec.reason == triggers.MAX_REQUESTS and cur.limit and cur.requests >= cur.limit * (1.0 + over):
        return (f"it took {cur.requests} requests against its limit of {cur.limit} while its successor started "
                f"([recycle] max_requests_overrun {over:g})")
    return None


def _since(v: ReplicaView, nxt: GenView) -> float:
    """When the successor's wait began: its spawn, or the recycle's start for a standby."""
    rec = v.machine.recycle
    return max(nxt.spawned_at, rec.started_at) if rec is not None else nxt.spawned_at


def _past_gate(g: GenView) -> bool:
    """A successor that boots on by itself: ungated, or its gate already opened (by the runtime,
    perhaps before the engine reached it: an overlap recycle opens a standby's gate at once)."""
    return not g.gated or g.gate == "opened" or g.gate_open


def _overlap_starting(v: ReplicaView, now: float, out: _Out) -> None:
    nxt, cfg = v.successor, v.facts.cfg
    if nxt is None:
        return
    if nxt.ready_at is not None:
        _switch(v, now, out, nxt, nxt.ready_at)
    elif _successor_lost(v, out, nxt, f"while starting beside generation {_n(v.current)}"):
        _unready_or_drain(v, now, out, urgent=False)
    elif now - _since(v, nxt) > cfg.server.startup_timeout:
        _successor_failed(v, out, Failure(
            nxt.number, FailureKind.START_TIMEOUT.value, None,
            f"not ready after {cfg.server.startup_timeout:.0f}s while starting beside generation {_n(v.current)}"))
        _unready_or_drain(v, now, out, urgent=False)
    elif (why := _late(v, now)) is not None:
        _handover(v, now, out, nxt, why)


def _gated_parking(v: ReplicaView, now: float, out: _Out) -> None:
    nxt, cfg = v.successor, v.facts.cfg
    if nxt is None:
        return
    if nxt.gate == "parked":
        out.add(log("generation_parked", generation=nxt.number, replica=v.facts.index,
                    parked_after_s=round(now - nxt.spawned_at, 1)))
        _unready_or_drain(v, now, out, urgent=False)
    elif _successor_lost(v, out, nxt, "before reaching its startup gate"):
        _unready_or_drain(v, now, out, urgent=False)
    elif now - _since(v, nxt) > cfg.server.gate_timeout:
        _successor_failed(v, out, _never_parked(v, nxt))
        _unready_or_drain(v, now, out, urgent=False)
    elif (why := _late(v, now)) is not None:
        _handover(v, now, out, nxt, why)


def _unready(v: ReplicaView, now: float, out: _Out) -> None:
    nxt = v.successor
    if nxt is not None and _past_gate(nxt) and nxt.ready_at is not None:
        out.add(Leaving(False))
        _switch(v, now, out, nxt, nxt.ready_at)  # a late overlap successor made it before the old one stopped
        return
    if nxt is not None and _successor_lost(v, out, nxt, _waiting(nxt)):
        return
    if v.machine.overdue(now):
        _drain_current(v, now, out)


def _draining(v: ReplicaView, now: float, out: _Out) -> None:
    cur, cfg = v.current, v.facts.cfg
    if cur is None:
        return
    nxt = v.successor
    if nxt is not None and _past_gate(nxt) and nxt.ready_at is not None and not v.facts.stopping:
        _switch(v, now, out, nxt, nxt.ready_at)  # a late overlap successor made it: it serves, the old one drains behind it
        return
    if nxt is not None and _successor_lost(v, out, nxt, _waiting(nxt)):
        return
    if cur.died:
        _fail(v, now, out, cur, FailureKind.CRASH.value, cur.exit_code, "backend died while draining")
    elif cur.in_flight == 0 or now > (cur.deadline or now):
        if cur.in_flight:
            out.add(log("drain_timeout", "warning", generation=cur.number, replica=v.facts.index,
                        in_flight=cur.in_flight))
        elif v.machine.recycle is not None:
            out.add(RecycleMark("drained"))
        out.add(Stop(cur.number, kill=False, deadline=now + cfg.server.stop_timeout))
        out.to(S.STOPPING, now, _stop_span(v, kill=False))


def _stopping(v: ReplicaView, now: float, out: _Out) -> None:
    cur, nxt = v.current, v.successor
    if nxt is not None and _successor_lost(v, out, nxt, _waiting(nxt)):
        return
    if cur is None or _ladder_step(v, cur, now, out):
        if v.machine.recycle is not None:
            out.add(RecycleMark("stopped"))
        _after_stop(v, now, out)


def _after_stop(v: ReplicaView, now: float, out: _Out) -> None:
    """`current` is gone after a planned stop: what next."""
    f, nxt = v.facts, v.successor
    if _stopped_or_held(v, now, out):
        return
    if nxt is not None and not _past_gate(nxt):
        out.to(S.OPENING_GATE, now, _gate_span(v))
    elif nxt is not None:
        out.add(Promote())  # a late overlap successor: it goes on starting as the replica's own
        left = max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now)
        out.to(S.STARTING, now, left)
    else:
        _start_cold(v, now, out, Strategy.COLD.value if v.machine.recycle is not None else None)


def _opening_gate(v: ReplicaView, now: float, out: _Out) -> None:
    f, nxt = v.facts, v.successor
    if _stopped_or_held(v, now, out):
        return
    if nxt is None or _successor_lost(v, out, nxt, _waiting(nxt)):
        _start_cold(v, now, out, Strategy.COLD.value)
    elif _past_gate(nxt):  # its gate was opened before it parked there: it is starting
        out.add(Promote())
        out.to(S.PAST_GATE, now, max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now))
    elif nxt.gate == "parked":
        waited = v.machine.age(now)
        if f.nvml and f.gpu_room is not True:
            if waited < f.cfg.server.memory_release_timeout:
                return
            out.add(log("gpu_memory_not_free_for_gate", "error", replica=f.index, generation=nxt.number,
                        waited_s=round(waited, 1)))
        out.add(OpenGate(nxt.number), log("gate_opened", generation=nxt.number, replica=f.index,
                                          after_stop_s=round(waited, 2)), Promote())
        out.to(S.PAST_GATE, now, f.cfg.server.startup_timeout)
    elif now - nxt.spawned_at > f.cfg.server.gate_timeout:
        _successor_failed(v, out, _never_parked(v, nxt))
        _start_cold(v, now, out, Strategy.COLD.value)


def _failing(v: ReplicaView, now: float, out: _Out) -> None:
    cur = v.current
    if cur is not None and not _ladder_step(v, cur, now, out):
        return
    f, nxt = v.facts, v.successor
    if _stopped_or_held(v, now, out):
        return
    if nxt is not None and not _past_gate(nxt):
        out.to(S.OPENING_GATE, now, _gate_span(v))  # a parked successor (a standby): open its gate
    elif nxt is not None:
        out.add(Promote())
        out.to(S.STARTING, now, max(1.0, nxt.spawned_at + f.cfg.server.startup_timeout - now))
    else:
        s = f.cfg.server
        out.to(S.BACKOFF, now, min(s.backoff_max, s.backoff_initial * 2 ** max(v.machine.consecutive - 1, 0)))


# -- generations on their way out ----------------------------------------------------------------
def _ladder_step(v: ReplicaView, g: GenView, now: float, out: _Out) -> bool:
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


def _retiring(v: ReplicaView, now: float, out: _Out) -> None:
    """Old generations behind the current one: drain, stop, finish, each on its own deadline."""
    s = v.facts.cfg.server
    for g in v.retiring:
        if g.phase is GenPhase.DRAINING:
            if g.died:
                _add_failure(out, Failure(g.number, FailureKind.CRASH.value, g.exit_code,
                                          f"backend died while draining (replaced by generation {_n(v.current)})"))
                out.add(Stop(g.number, kill=True, deadline=now + KILL_WAIT_S))
                _check_limit(v, out)
            elif g.in_flight == 0 or now > (g.deadline or now):
                if g.in_flight:
                    out.add(log("drain_timeout", "warning", generation=g.number, replica=v.facts.index,
                                in_flight=g.in_flight))
                out.add(Stop(g.number, kill=False, deadline=now + s.stop_timeout))
        else:
            _ladder_step(v, g, now, out)


# -- recycles ----------------------------------------------------------------------------------
def _wait_why(v: ReplicaView, now: float, strategy: str | None) -> str | None:
    """Why a planned recycle waits before it begins, or None: the rolling rule (another replica
    recycles or does not serve), or, for `auto`, a generation that became ready so recently that
    no memory reading says yet which strategy fits (without one, `auto` could only go cold: a
    recycle asked for the moment a generation serves would leave the replica without service)."""
    f, cur = v.facts, v.current
    others = rolling(f.index, f.peers)
    if others is not None:
        return others
    if (cur is not None and cur.fit is None and v.successor is None and cur.ready_at is not None
            and now - cur.ready_at < READING_WAIT_S and (strategy or f.cfg.server.recycle_strategy) == AUTO):
        return f"generation {cur.number} has no memory reading yet to choose the strategy from"
    return None


def _begin_or_wait(v: ReplicaView, now: float, out: _Out, reason: str, cls: EndClass, strategy: str | None) -> None:
    why = _wait_why(v, now, strategy)
    if why is None:
        _begin(v, now, out, reason, cls, strategy)
        return
    out.to(S.WAITING_TURN, now, wanted=Wanted(reason, cls, strategy), deferred=why)
    out.add(log("recycle_deferred", replica=v.facts.index, reason=reason, why=why),
            PastLimit(True))  # nothing queues while it waits for its turn


def _successor_deadline(v: ReplicaView, reason: str, now: float) -> float | None:
    cur = v.current
    if reason in (triggers.GPU_MEMORY_GROWTH, triggers.HOST_RSS_GROWTH) and cur is not None \
            and cur.to_limit_s is not None:
        return now + URGENCY_SHARE * max(0.0, cur.to_limit_s)
    return None


def _begin(v: ReplicaView, now: float, out: _Out, reason: str, cls: EndClass, strategy: str | None) -> None:
    cur, f = _need(v.current, "a recycle begins with no current generation"), v.facts
    fit = cur.fit if cur.fit is not None else MemoryFit(host_available_mb=0.0, host_footprint_mb=None,
                                                        gate_unavailable=f.gate_unavailable)
    if f.gate_unavailable and fit.gate_unavailable != f.gate_unavailable:
        fit = replace(fit, gate_unavailable=f.gate_unavailable)
    choice = choose(strategy or f.cfg.server.recycle_strategy, fit, f.starts)
    if strategy is not None:
        choice = replace(choice, reason=f"asked for by the command{choice.reason.partition(f'= {strategy}')[2]}")
    rec = Recycle(reason=reason, cls=cls, strategy=choice.strategy.value, why=choice.reason, started_at=now,
                  generation=cur.number, successor_deadline=_successor_deadline(v, reason, now))
    nxt = v.successor  # a standby: it takes over instead of a new start
    if nxt is not None and choice.strategy is Strategy.COLD and (strategy or f.cfg.server.recycle_strategy) == "cold":
        # cold asked for (by the command or the config): obeyed, one vLLM at a time from scratch
        out.add(Abandon(f"a cold recycle was asked for; standby generation {nxt.number} is set aside"),
                log("standby_set_aside", replica=f.index, generation=nxt.number, why="cold recycle asked for"))
        nxt = None
    if nxt is not None and choice.strategy is not Strategy.OVERLAP:
        rec = replace(rec, strategy=Strategy.GATED.value,
                      why=f"{choice.reason}; the parked standby (generation {nxt.number}) takes over")
    out.set(recycle=rec, end_reason=(reason, cls), wanted=None, deferred=None)
    out.add(RecycleBegan(rec), log("recycle_begin", generation=cur.number, replica=f.index, reason=reason,
                                   cls=cls.value, served=cur.served, toward_limit=cur.requests,
                                   inherited=cur.inherited, limit=cur.limit, strategy=rec.strategy,
                                   why=rec.why))
    if nxt is not None and choice.strategy is Strategy.OVERLAP:
        out.add(PastLimit(True), OpenGate(nxt.number),
                log("gate_opened", generation=nxt.number, replica=f.index, beside=cur.number))
        out.to(S.OVERLAP_STARTING, now)
    elif nxt is not None:
        if nxt.gate == "parked":
            _unready_or_drain(v, now, out, urgent=False)
        else:
            out.add(PastLimit(True))
            out.to(S.GATED_PARKING, now)
    elif choice.strategy is Strategy.COLD:
        _unready_or_drain(v, now, out, urgent=False)
    elif choice.strategy is Strategy.OVERLAP:
        out.add(PastLimit(True), Spawn(Slot.SUCCESSOR, gated=False, strategy=Strategy.OVERLAP.value))
        out.to(S.OVERLAP_STARTING, now)
    else:
        out.add(PastLimit(True), Spawn(Slot.SUCCESSOR, gated=True, strategy=Strategy.GATED.value))
        out.to(S.GATED_PARKING, now)


def _unready_or_drain(v: ReplicaView, now: float, out: _Out, urgent: bool) -> None:
    """Before a gap: announce the replica as leaving for `unready_lead` when it is the only one
    serving (a balancer then moves traffic away first); else, or when urgent, drain now."""
    lead = v.facts.cfg.server.unready_lead
    if lead > 0 and not urgent and serving_count(v.facts.peers, skip=v.facts.index) == 0:
        out.add(Leaving(True), PastLimit(True))
        out.to(S.UNREADY, now, lead)
    else:
        _drain_current(v, now, out)


def _drain_current(v: ReplicaView, now: float, out: _Out) -> None:
    cur, s = _need(v.current, "a drain with no current generation"), v.facts.cfg.server
    reason, cls = out.m.end_reason
    rec = out.m.recycle
    if rec is not None and rec.closed_at is None:
        out.set(recycle=replace(rec, closed_at=now))
    out.add(Drain(cur.number, now + s.drain_timeout, reason, cls))
    out.to(S.DRAINING, now, s.drain_timeout)


def _switch(v: ReplicaView, now: float, out: _Out, nxt: GenView, ready_at: float) -> None:
    """The successor `nxt` is ready (at `ready_at`): it takes new requests, then the old one
    drains behind it."""
    old, rec, s = _need(v.current, "a switch with no current generation"), out.m.recycle, v.facts.cfg.server
    reason, cls = out.m.end_reason
    out.add(Promote(), GoLive(nxt.number, past_limit=s.recycle_strategy != Strategy.COLD.value),
            LearnStart(beside=True, seconds=round(ready_at - nxt.spawned_at, 1)))
    if old.phase is GenPhase.SERVING:
        out.add(Drain(old.number, now + s.drain_timeout, reason, cls))
    if rec is not None:
        out.add(RecycleReady(nxt.number, round(now - rec.started_at, 3),
                             round(now - rec.closed_at, 3) if rec.closed_at is not None else 0.0))
    out.add(log("generation_switched", replica=v.facts.index, old=old.number, new=nxt.number,
                old_in_flight=old.in_flight))
    out.to(S.SERVING, now, recycle=None, consecutive=0, last_death=None)


def _handover(v: ReplicaView, now: float, out: _Out, nxt: GenView, why: str) -> None:
    """The successor `nxt` is late: the old generation drains now; it keeps starting and takes
    over when it is ready (or when its gate opens)."""
    note = f"handed over: {why}; generation {nxt.number} goes on starting"
    out.add(RecycleNote(out.m.recycle.strategy if out.m.recycle else Strategy.COLD.value, note),
            log("recycle_handover", "warning", replica=v.facts.index, generation=_n(v.current),
                next_generation=nxt.number, why=why))
    _drain_current(v, now, out)


def _exited(g: GenView, where: str) -> str | None:
    """How a generation that exited on its own is described (`where`: what it was doing), or
    None while it runs: the one wording of a successor's exit."""
    if g.exit_code is None:
        return None
    gate = f" ({g.gate}: {g.gate_reason})" if g.gate not in (None, "parked") else ""
    return f"exited with {g.exit_code} {where}{gate}"


def _waiting(g: GenView) -> str:
    """What a successor was doing while the old generation drained or stopped."""
    return "while parked at its startup gate" if g.gate == "parked" else "while starting"


def _successor_lost(v: ReplicaView, out: _Out, nxt: GenView, where: str) -> bool:
    """The recycle's successor `nxt` cannot take over: it exited on its own (a failure of its
    own, with the line its log gives) or cannot park at its gate (learned, not a failure). It is
    killed and the recycle goes on cold; True when it was lost. The caller says what follows."""
    if nxt.gate == "skipped":
        out.add(LearnGate(nxt.gate_reason), log("gate_unavailable", "warning", generation=nxt.number,
                                                replica=v.facts.index, reason=nxt.gate_reason))
    exited = _exited(nxt, where)
    if exited is not None:
        _successor_failed(v, out, *_start_failure(out, nxt, exited))
    elif nxt.gate == "skipped":
        _set_aside(v, out, f"gated pre-start unavailable: {nxt.gate_reason}")
    else:
        return False
    return True


def _never_parked(v: ReplicaView, nxt: GenView) -> Failure:
    return Failure(nxt.number, FailureKind.START_FAILED.value, None,
                   f"did not reach its startup gate within {v.facts.cfg.server.gate_timeout:.0f}s")


def _successor_failed(v: ReplicaView, out: _Out, failure: Failure,
                      repeated: StartCauseRepeated | None = None) -> None:
    """The successor failed (`failure`): recorded, killed, the recycle goes on cold."""
    _add_failure(out, failure)
    _set_aside(v, out, _about(failure))
    _check_limit(v, out, repeated=repeated)


def _set_aside(v: ReplicaView, out: _Out, why: str) -> None:
    """The successor cannot take over: kill it; the recycle goes on cold."""
    out.add(Abandon(why))
    _note_fallback(v, out, why)


def _stopped_or_held(v: ReplicaView, now: float, out: _Out) -> bool:
    """Where a stop or a failure ends: shutting down or held, the replica exits or holds (its
    successor, if any, is killed). True when it did; else the caller starts what comes next."""
    f = v.facts
    if not f.stopping and f.hold is None:
        return False
    if v.successor is not None:
        out.add(Abandon("the runtime is shutting down" if f.stopping else f"held ({f.hold})"))
    out.to(S.EXITING if f.stopping else S.HELD, now, recycle=None)
    return True


def _note_fallback(v: ReplicaView, out: _Out, why: str) -> None:
    rec = out.m.recycle
    if rec is None:
        return
    note = f"fell back to cold: {why}"[:500]
    out.set(recycle=replace(rec, strategy=Strategy.COLD.value, why=note))
    out.add(RecycleNote(Strategy.COLD.value, note),
            log("recycle_fallback", "warning", replica=v.facts.index, generation=rec.generation, why=why))


def _start_cold(v: ReplicaView, now: float, out: _Out, strategy: str | None) -> None:
    out.add(Spawn(Slot.CURRENT, gated=False, strategy=strategy))
    out.to(S.STARTING, now, v.facts.cfg.server.startup_timeout)


# -- failures ----------------------------------------------------------------------------------
def _fail(v: ReplicaView, now: float, out: _Out, cur: GenView, kind: str, exit_code: int | None, detail: str,
          cls: EndClass = EndClass.UNPLANNED, from_log: bool = False) -> None:
    _failed(v, now, out, Failure(cur.number, kind, exit_code, detail, cls, from_log))


def _failed(v: ReplicaView, now: float, out: _Out, failure: Failure,
            repeated: StartCauseRepeated | None = None) -> None:
    """Any unexpected end (exit 0 included) of `current` (the generation `failure` is of) is a
    failure: record it, kill it. A successor already starting stays: it takes over once this one
    is gone."""
    n, rec, kind, cls = failure.generation, out.m.recycle, failure.kind, failure.cls
    _add_failure(out, failure)
    if rec is not None:
        out.add(RecycleNote(rec.strategy, f"ended by a failure of generation {n} ({kind})"))
    out.add(Stop(n, kill=True, deadline=now + KILL_WAIT_S, reason=kind, cls=cls))
    if v.machine.state is S.UNREADY:
        out.add(Leaving(False))
    _check_limit(v, out, cls, repeated)
    out.to(S.FAILING, now, _stop_span(v, kill=True), recycle=None, wanted=None, end_reason=(kind, cls),
           consecutive=v.machine.consecutive + 1)


def _check_limit(v: ReplicaView, out: _Out, cls: EndClass = EndClass.UNPLANNED,
                 repeated: StartCauseRepeated | None = None) -> None:
    """One more unplanned failure: at `max_failures` within the window the runtime gives up; a
    start that died of the same cause as the last one ends the runtime at once instead."""
    if repeated is not None:
        out.add(repeated)
    elif cls is EndClass.UNPLANNED and v.facts.failures_in_window + 1 >= v.facts.cfg.server.max_failures:
        out.add(GiveUp())


def _add_failure(out: _Out, failure: Failure) -> None:
    """Record a failure; the replica remembers its death if it was a start that died on its own
    (`last_death`), and forgets the last one otherwise."""
    out.add(failure)
    out.set(last_death=failure.death)


def _start_failure(out: _Out, g: GenView, detail: str) -> tuple[Failure, StartCauseRepeated | None]:
    """The failure of `g`, which exited on its own before it ever served: its detail is the line
    its log gives (`child.death`; else `detail` and vLLM's root-cause line), and, when the
    replica's last failure was a death of the same cause, the runtime's end instead of a restart."""
    d = g.death
    if d is None:  # nothing read (the driver reads every such death first)
        return Failure(g.number, FailureKind.START_FAILED.value, g.exit_code, detail, from_log=True), None
    repeated = StartCauseRepeated(g.number, d) if same_cause(out.m.last_death, d) else None
    return Failure(g.number, FailureKind.START_FAILED.value, g.exit_code, d.line(g.number), death=d), repeated


def _about(f: Failure) -> str:
    """A failure in a few words for a recycle's note: `generation N ...`."""
    return f.detail if f.death is not None else f"generation {f.generation} {f.detail}"


# -- commands ----------------------------------------------------------------------------------
def _why_not(v: ReplicaView) -> str:
    f, m, cur = v.facts, v.machine, v.current
    where = f"replica {f.index}: " if f.replicas > 1 else ""
    if f.stopping:
        return where + "the runtime is shutting down"
    n = cur.number if cur is not None else "-"
    return where + {
        S.STARTING: f"generation {n} is still starting",
        S.PAST_GATE: f"generation {n} is still starting",
        S.BACKOFF: "no generation is running (backing off after a failure)",
        S.FAILING: f"generation {n} failed and is being stopped",
        S.HELD: f"held ({f.hold}): nothing runs until release",
        S.EXITING: "the runtime is shutting down",
    }.get(m.state, "a recycle or stop is already in progress")


def _recycle_cmd(v: ReplicaView, cmd: RecycleCmd, now: float, out: _Out) -> None:
    f, cur = v.facts, v.current
    where = f"replica {f.index}: " if f.replicas > 1 else ""
    if f.hold is not None:
        out.add(Reply(False, f"held ({f.hold}): planned recycles wait for release"))
    elif f.stopping or v.machine.state not in RECYCLABLE_STATES or cur is None:
        out.add(Reply(False, _why_not(v)))
    elif (why := _wait_why(v, now, cmd.strategy)) is not None:
        _begin_or_wait(v, now, out, cmd.reason, cmd.cls, cmd.strategy)
        out.add(Reply(True, f"{where}waits ({why})"))
    else:
        _begin(v, now, out, cmd.reason, cmd.cls, cmd.strategy)
        st, nxt_n = out.m.state, "next"
        if st is S.OVERLAP_STARTING or st is S.GATED_PARKING:
            how = "up to its startup gate " if st is S.GATED_PARKING else ""
            out.add(Reply(True, f"{where}starting the {nxt_n} generation {how}beside generation {cur.number} "
                                f"({out.m.recycle.strategy if out.m.recycle else ''})"))
        else:
            out.add(Reply(True, f"{where}draining generation {cur.number}"))


def _restart_cmd(v: ReplicaView, cmd: RestartCmd, now: float, out: _Out) -> None:
    cur = v.current
    if v.facts.stopping or cur is None or v.machine.state not in RESTARTABLE_STATES:
        out.add(Reply(False, _why_not(v)))
        return
    _fail(v, now, out, cur, FailureKind.RESTART.value, cur.exit_code, cmd.reason, cmd.cls)
    out.add(Reply(True, f"killing generation {cur.number}; requests not yet answered go to the next"))


def _hold_cmd(v: ReplicaView, now: float, out: _Out) -> None:
    """Held: nothing new starts. A successor starting beside the serving generation is stopped
    (the serving one keeps serving), a recycle waiting for its turn is dropped, a replica backing
    off stays down; a stop under way ends in HELD (`_after_stop`). No generation stops at its
    count limit while held: no recycle can follow."""
    st = v.machine.state
    out.add(EnforceLimits(False))
    if st in RECYCLING_STATES or st is S.STANDBY:
        if v.successor is not None:
            out.add(Abandon(f"held ({v.facts.hold})"))
        if st is S.UNREADY:
            out.add(Leaving(False))
        out.to(S.SERVING, now, recycle=None, wanted=None, deferred=None)
    elif st is S.BACKOFF:
        out.to(S.HELD, now)
    out.add(Reply(True, "held"))


def _release_cmd(v: ReplicaView, now: float, out: _Out) -> None:
    out.add(EnforceLimits(True))
    if not v.facts.stopping:
        out.add(RejectRequests(None))
    if v.machine.state is S.HELD and not v.facts.stopping:
        _start_cold(v, now, out, None)
        out.add(Reply(True, "starting"))
    else:
        out.add(Reply(True, "released"))


def _stop_cmd(v: ReplicaView, cmd: StopCmd, now: float, out: _Out) -> None:
    """SIGTERM/SIGINT: requests are refused from now on; drain and stop; a second signal
    shortens the ladder."""
    st, cur, s = v.machine.state, v.current, v.facts.cfg.server
    out.add(RejectRequests("vllm-guard is shutting down"))
    if v.successor is not None and st is not S.FAILING:
        out.add(Abandon("the runtime is shutting down"))
    out.set(wanted=None, deferred=None)
    if st in (S.BACKOFF, S.HELD, S.OPENING_GATE):
        out.to(S.EXITING, now, recycle=None)
    elif st in SERVING_STATES and cur is not None:
        if st is S.UNREADY:
            out.add(Leaving(False))
        out.set(end_reason=("shutdown", EndClass.SCHEDULED), recycle=None)
        _drain_current(v, now, out)
    elif st in BOOTING_STATES and cur is not None:
        # nothing was served: no request to drain; SIGKILL (a loading vLLM ignores SIGTERM until it is up)
        out.add(Stop(cur.number, kill=True, deadline=now + KILL_WAIT_S, reason="shutdown", cls=EndClass.SCHEDULED))
        out.to(S.STOPPING, now, _stop_span(v, kill=True), recycle=None)
    elif cmd.second and st is S.DRAINING and cur is not None:
        out.add(Stop(cur.number, kill=False, deadline=now + s.stop_timeout))
        out.to(S.STOPPING, now, _stop_span(v, kill=False))
    elif cmd.second and st is S.STOPPING and cur is not None:
        out.add(Stop(cur.number, kill=True, deadline=now + KILL_WAIT_S))
        out.to(S.STOPPING, now, _stop_span(v, kill=True))


def _stop_span(v: ReplicaView, kill: bool) -> float:
    """The longest a stop may take: the signal's deadline, SIGKILL's wait, the memory release."""
    s = v.facts.cfg.server
    return (0.0 if kill else s.stop_timeout) + KILL_WAIT_S + s.memory_release_timeout


def _gate_span(v: ReplicaView) -> float:
    s = v.facts.cfg.server
    return s.gate_timeout + s.memory_release_timeout


def _n(g: GenView | None) -> str:
    return str(g.number) if g is not None else "-"


__all__ = ["KILL_WAIT_S", "decide"]
