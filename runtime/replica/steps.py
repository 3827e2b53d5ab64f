"""The steps `decide` composes: the decision being built (`Out`), how a recycle begins, switches,
hands over and falls back, how a failure is recorded and killed, and where a stop ends. Pure,
like `decide`; split from it so each stays small. Only `decide` calls these (the driver reads
`KILL_WAIT_S` and keeps the rates `prior_rate` turns into the next generation's prior).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Iterable, TypeVar

from vllm_guard.core import plugin
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.stats import time_to_exhaust

from ..child.death import same_cause
from .machine import Machine, Recycle, State, Wanted, idle, rolling, serving_count
from .strategy import AUTO, MemoryFit, Strategy, choose, late_gate_fits
from .view import (
    Abandon, Decision, Drain, Effect, Event, Failure, GenPhase, GenView, GiveUp, GoLive, HoldCmd, LearnGate, LearnStart,
    Leaving, OpenGate, PastLimit, Promote, RecycleBegan, RecycleNote, RecycleOver, RecycleReady, RejectRequests,
    ReplicaView, Slot, Spawn, StartCauseRepeated, Stop, WatchRoom, log,
)

S = State
KILL_WAIT_S = 10.0  # after SIGKILL, how long a generation's processes get to disappear
URGENCY_SHARE = 0.5  # a memory-triggered recycle gives its successor this share of the time left
READING_WAIT_S = 30.0  # longest a planned recycle waits for a new generation's first memory reading
T = TypeVar("T")


class ViewMismatch(RuntimeError):
    """A view the machine's state rules out (a bug in `decide` or its driver, not an input): a
    state that serves with no current generation, a replica waiting its turn with no recycle."""


def need(x: T | None, what: str) -> T:
    """`x`, which the state guarantees; ViewMismatch (never skipped, unlike `assert` under -O)."""
    if x is None:
        raise ViewMismatch(what)
    return x


class Out:
    """The decision being built: the machine so far and the effects in order."""

    def __init__(self, m: Machine) -> None:
        self.m = m
        self.fx: list[Effect] = []

    def add(self, *effects: Effect) -> Out:
        self.fx.extend(effects)
        return self

    def to(self, state: State, now: float, timeout: float | None = None, **changes: object) -> Out:
        self.m = self.m.to(state, now, timeout, **changes)
        return self

    def set(self, **changes: object) -> Out:
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


# -- recycles ----------------------------------------------------------------------------------
def wait_why(v: ReplicaView, now: float, strategy: str | None) -> str | None:
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


def begin_or_wait(v: ReplicaView, now: float, out: Out, reason: str, cls: EndClass, strategy: str | None) -> None:
    why = wait_why(v, now, strategy)
    if why is None:
        begin_recycle(v, now, out, reason, cls, strategy)
        return
    out.to(S.WAITING_TURN, now, wanted=Wanted(reason, cls, strategy), deferred=why)
    out.add(log("recycle_deferred", replica=v.facts.index, reason=reason, why=why),
            PastLimit(True))  # nothing queues while it waits for its turn


def successor_deadline(v: ReplicaView, reason: str, now: float) -> float | None:
    """How long the serving generation may wait for its successor, whatever the trigger: half the
    time its memory forecast leaves before the memory runs out; None when its memory does not
    grow toward a limit (then nothing is urgent: it serves until its successor is ready)."""
    cur = v.current
    if cur is not None and cur.to_limit_s is not None:
        return now + URGENCY_SHARE * max(0.0, cur.to_limit_s)
    return None


# -- the held KV cache: one computing generation at a time -------------------------------------
KV_HELD, KV_OWN = plugin.KV_HELD, plugin.KV_OWN


def kv_taken(v: ReplicaView, skip: int | None) -> int | None:
    """A live generation other than `skip` that maps the holder's KV cache (its number), or None."""
    for g in (v.current, v.successor, *v.retiring):
        if g is not None and g.number != skip and g.maps_held_kv:
            return g.number
    return None


def kv_for(v: ReplicaView, g: int | None) -> str:
    """The KV cache for generation `g` that may compute now: the held one unless another maps it."""
    return KV_OWN if kv_taken(v, g) is not None else KV_HELD


def fit_with_kv(cur: GenView, fit: MemoryFit) -> MemoryFit:
    return replace(fit, kv_held_mb=cur.kv_mb if cur.kv == KV_HELD else 0.0, weights_held_mb=cur.weights_mb)


def _late_refused(v: ReplicaView) -> str | None:
    """Why no generation may start whole beside the serving one now, whichever KV cache it takes."""
    cur = v.current
    if cur is None or cur.fit is None or not v.facts.nvml:
        return "no GPU memory reading of the serving generation"
    if v.facts.standby_failures:  # a late start that did not fit fails alone: the next one parks before CUDA
        return f"the last {v.facts.standby_failures} standby(s) were lost before they were needed"
    return late_room(cur, parked=False, prior_mb_s=v.facts.gpu_mb_s)


def late_gate(v: ReplicaView, requested: str | None = None) -> tuple[bool, str]:
    """Whether a gated successor or standby may start whole on the held KV cache beside the
    serving generation and park ready (`strategy.late_gate_fits`), and why: the serving one maps
    the held KV cache, its GPU has the room, and the recycle would not be an overlap (then the
    standby parks ready on a KV cache of its own instead: `standby_gate`). `requested`: the
    recycle's strategy if a command gave one, else `[server] recycle_strategy`."""
    if (why := _late_refused(v)) is not None:
        return False, why
    cur = need(v.current, "a late gate with no serving generation")
    if cur.kv != KV_HELD or cur.fit is None:
        return False, "the serving generation does not map a held KV cache"
    fit = fit_with_kv(cur, cur.fit)
    if choose(requested or v.facts.cfg.server.recycle_strategy, fit, v.facts.starts).strategy is Strategy.OVERLAP:
        return False, "two generations fit: the next one computes beside the serving one, on a KV cache of its own"
    return late_gate_fits(fit)


def standby_gate(v: ReplicaView) -> tuple[bool, str, str]:
    """Where the standby parks (late: once ready), the KV cache it takes, and why. Where the
    recycle would be an overlap (two whole generations fit, `auto`), it starts whole on a KV cache
    no other generation computes on (its own, or the held one when the serving generation has its
    own) and parks ready: a recycle opens it beside the serving one (0 s without a serving
    generation, under a second of vLLM's handshake beside it), a crash at once. Parked ready on the
    serving generation's held KV cache it could take over only after the old one was gone (1.6 s
    on an H100). Else `late_gate`'s rule, on the held KV cache."""
    cur, f = v.current, v.facts
    if _late_refused(v) is None and cur is not None and cur.fit is not None:
        choice = choose(f.cfg.server.recycle_strategy, fit_with_kv(cur, cur.fit), f.starts)
        if choice.strategy is Strategy.OVERLAP:
            kv = kv_for(v, None)
            on = "a KV cache of its own" if kv == KV_OWN else "the held KV cache"
            return True, kv, f"{choice.reason}: it parks ready on {on} and opens beside the serving one"
    late, why = late_gate(v)
    return late, KV_HELD, why


def parked_beside(v: ReplicaView, nxt: GenView | None) -> bool:
    """Whether the standby `nxt` parked (or parks) ready on a KV cache no other generation
    computes on: it holds its memory already, so it may open beside the serving one."""
    return nxt is not None and nxt.late and (nxt.kv != KV_HELD or kv_taken(v, nxt.number) is None)


# A late standby holds GPU memory beside the serving generation: the room a leak would grow into.
LATE_START_ROOM_S = 300.0  # one still starting is given up when the serving one's memory runs out sooner
LATE_PARKED_ROOM_S = 60.0  # one parked ready is used (a preventive recycle) when it runs out sooner


PRIOR_GENERATIONS = 3  # the prior is the median rate of this many last generations


def prior_rate(rates: Iterable[float]) -> float | None:
    """The GPU growth rate a new generation is judged at before its own forecast exists: the
    median of the last PRIOR_GENERATIONS generations' rates (oldest first). One generation's
    rate comes from a handful of readings of an allocator that grows in steps (7 MB/s seen
    between two of 20 MB/s), so a single reading would let a wasted late start through."""
    last = list(rates)[-PRIOR_GENERATIONS:]
    return statistics.median(last) if last else None


def late_room(cur: GenView, parked: bool, prior_mb_s: float | None = None) -> str | None:
    """Why the serving generation `cur` has no room left for a late standby beside it, or None:
    its GPU memory grows and the forecast (`to_limit_s`, the device's free memory over its growth
    rate, which counts what the standby holds) runs out within the horizon. Before its own
    forecast has its readings, a start is judged at `prior_mb_s`, the rate its predecessors
    measured (`prior_rate`): a leak outlives the generation it showed in, and a late start it sets
    aside later is a whole vLLM start beside the serving one for nothing."""
    room = LATE_PARKED_ROOM_S if parked else LATE_START_ROOM_S
    to_limit, what, rate = cur.to_limit_s, "memory grows and runs out", "this rate"
    if to_limit is None and cur.gpu_mb_s is None and not parked and prior_mb_s is not None \
            and cur.fit is not None and cur.fit.gpu_free_mb is not None:
        to_limit = time_to_exhaust(cur.fit.gpu_free_mb, prior_mb_s)
        what, rate = "GPU memory runs out", f"the {prior_mb_s:.1f} MB/s its predecessors' grew"
    if to_limit is None or to_limit >= room:
        return None
    return f"generation {cur.number}'s {what} in {to_limit:.0f} s at {rate} (under {room:.0f} s)"


def park_within(v: ReplicaView, g: GenView) -> float:
    """How long `g` may take to reach its gate: a late one parks after its whole start."""
    s = v.facts.cfg.server
    return s.startup_timeout if g.late else s.gate_timeout


def begin_recycle(v: ReplicaView, now: float, out: Out, reason: str, cls: EndClass, strategy: str | None) -> None:
    cur, f = need(v.current, "a recycle begins with no current generation"), v.facts
    fit = cur.fit if cur.fit is not None else MemoryFit(host_available_mb=0.0, host_footprint_mb=None,
                                                        gate_unavailable=f.gate_unavailable)
    if f.gate_unavailable and fit.gate_unavailable != f.gate_unavailable:
        fit = replace(fit, gate_unavailable=f.gate_unavailable)
    fit = fit_with_kv(cur, fit)
    asked = strategy or f.cfg.server.recycle_strategy  # the command's, else the config's
    choice = choose(asked, fit, f.starts)
    if strategy is not None:
        choice = replace(choice, reason=f"asked for by the command{choice.reason.partition(f'= {strategy}')[2]}")
    if parked_beside(v, v.successor) and asked == AUTO \
            and choice.strategy is not Strategy.OVERLAP:  # it holds its memory already: no room needed
        choice = replace(choice, strategy=Strategy.OVERLAP, reason=(
            f"the standby parked ready on a KV cache the serving one does not compute on ({choice.reason})"))
    rec = Recycle(reason=reason, cls=cls, strategy=choice.strategy.value, why=choice.reason, started_at=now,
                  generation=cur.number, successor_deadline=successor_deadline(v, reason, now))
    nxt = v.successor  # a standby: it takes over instead of a new start
    if nxt is not None and choice.strategy is Strategy.COLD and asked == "cold":
        # cold asked for (by the command or the config): obeyed, one vLLM at a time from scratch
        out.add(Abandon(f"a cold recycle was asked for; standby generation {nxt.number} is set aside"),
                log("standby_set_aside", replica=f.index, generation=nxt.number, why="cold recycle asked for"))
        nxt = None
    # never beside: a standby parked ready on the KV cache the serving one computes on
    beside_ok = nxt is not None and (not nxt.late or parked_beside(v, nxt))
    if nxt is not None and (choice.strategy is not Strategy.OVERLAP or not beside_ok):
        rec = replace(rec, strategy=Strategy.GATED.value,
                      why=f"{choice.reason}; the parked standby (generation {nxt.number}) takes over"
                          + ("" if beside_ok else " once the serving one is gone (it parked ready on the held KV cache)"))
    out.set(recycle=rec, end_reason=(reason, cls), wanted=None, deferred=None)
    out.add(RecycleBegan(rec), log("recycle_begin", generation=cur.number, replica=f.index, reason=reason,
                                   cls=cls.value, served=cur.served, toward_limit=cur.requests,
                                   inherited=cur.inherited, limit=cur.limit, strategy=rec.strategy,
                                   why=rec.why))
    if nxt is not None and choice.strategy is Strategy.OVERLAP and beside_ok:
        out.add(PastLimit(True), OpenGate(nxt.number, kv=kv_for(v, nxt.number)),
                log("gate_opened", generation=nxt.number, replica=f.index, beside=cur.number))
        out.to(S.OVERLAP_STARTING, now)
    elif nxt is not None:
        if nxt.gate == "parked":
            unready_or_drain(v, now, out, urgent=False)
        else:
            out.add(PastLimit(True))
            out.to(S.GATED_PARKING, now)
    elif choice.strategy is Strategy.COLD:
        unready_or_drain(v, now, out, urgent=False)
    elif choice.strategy is Strategy.OVERLAP:
        out.add(PastLimit(True), Spawn(Slot.SUCCESSOR, gated=False, strategy=Strategy.OVERLAP.value,
                                       kv=kv_for(v, None)))
        out.to(S.OVERLAP_STARTING, now)
    else:
        late, why = late_gate(v, strategy)
        out.add(PastLimit(True), Spawn(Slot.SUCCESSOR, gated=True, strategy=Strategy.GATED.value, late=late),
                log("gate_at", replica=f.index, late=late, why=why))
        out.to(S.GATED_PARKING, now)


def unready_or_drain(v: ReplicaView, now: float, out: Out, urgent: bool) -> None:
    """Before a gap: announce the replica as leaving for `unready_lead` when it is the only one
    serving (a balancer then moves traffic away first); else, or when urgent, drain now."""
    lead = v.facts.cfg.server.unready_lead
    if lead > 0 and not urgent and serving_count(v.facts.peers, skip=v.facts.index) == 0:
        out.add(Leaving(True), PastLimit(True))
        out.to(S.UNREADY, now, lead)
    else:
        drain_current(v, now, out)


def drain_current(v: ReplicaView, now: float, out: Out) -> None:
    cur, s = need(v.current, "a drain with no current generation"), v.facts.cfg.server
    reason, cls = out.m.end_reason
    rec = out.m.recycle
    if rec is not None and rec.closed_at is None:
        out.set(recycle=replace(rec, closed_at=now))
    out.add(Drain(cur.number, now + s.drain_timeout, reason, cls))
    out.to(S.DRAINING, now, s.drain_timeout)


def switch_over(v: ReplicaView, now: float, out: Out, nxt: GenView, ready_at: float) -> None:
    """The successor `nxt` is ready (at `ready_at`): it takes new requests, and the old one hands
    its followed streams over to it (they go on there from their last token) and drains the rest
    behind it. Both computing at once would slow every request of both (seen on an H100: TTFT
    p99 twice plain vLLM's, all of it in the second after the switch)."""
    old, rec, s = need(v.current, "a switch with no current generation"), out.m.recycle, v.facts.cfg.server
    reason, cls = out.m.end_reason
    out.add(Promote(), GoLive(nxt.number, past_limit=s.recycle_strategy != Strategy.COLD.value),
            LearnStart(beside=True, seconds=round(ready_at - nxt.spawned_at, 1)))
    if old.phase is GenPhase.SERVING:  # its streams go on at the new one: one generation computes
        out.add(Drain(old.number, now + s.drain_timeout, reason, cls, hand_over=True))
    if rec is not None:
        out.add(RecycleReady(nxt.number, round(now - rec.started_at, 3),
                             round(now - rec.closed_at, 3) if rec.closed_at is not None else 0.0))
    out.add(log("generation_switched", replica=v.facts.index, old=old.number, new=nxt.number,
                old_in_flight=old.in_flight))
    out.to(S.SERVING, now, recycle=None, consecutive=0, last_death=None)


def hand_over(v: ReplicaView, now: float, out: Out, nxt: GenView, why: str) -> None:
    """The successor `nxt` is late: the old generation drains now; it keeps starting and takes
    over when it is ready (or when its gate opens)."""
    note = f"handed over: {why}; generation {nxt.number} goes on starting"
    out.add(RecycleNote(out.m.recycle.strategy if out.m.recycle else Strategy.COLD.value, note),
            log("recycle_handover", "warning", replica=v.facts.index, generation=number_of(v.current),
                next_generation=nxt.number, why=why))
    drain_current(v, now, out)


def exit_words(g: GenView, where: str) -> str | None:
    """How a generation that exited on its own is described (`where`: what it was doing), or
    None while it runs: the one wording of a successor's exit."""
    if g.exit_code is None:
        return None
    gate = f" ({g.gate}: {g.gate_reason})" if g.gate not in (None, "parked") else ""
    return f"exited with {g.exit_code} {where}{gate}"


def waiting_words(g: GenView) -> str:
    """What a successor was doing while the old generation drained or stopped."""
    return "while parked at its startup gate" if g.gate == "parked" else "while starting"


def successor_lost(v: ReplicaView, out: Out, nxt: GenView, where: str) -> bool:
    """The recycle's successor `nxt` cannot take over: it exited on its own (a failure of its
    own, with the line its log gives) or cannot park at its gate (learned, not a failure). It is
    killed and the recycle goes on cold; True when it was lost. The caller says what follows."""
    if nxt.gate == "skipped":
        out.add(LearnGate(nxt.gate_reason), log("gate_unavailable", "warning", generation=nxt.number,
                                                replica=v.facts.index, reason=nxt.gate_reason))
    exited = exit_words(nxt, where)
    if exited is not None:
        successor_failed(v, out, *start_failure(out, nxt, exited))
    elif nxt.gate == "skipped":
        set_aside(v, out, f"gated pre-start unavailable: {nxt.gate_reason}")
    else:
        return False
    return True


def never_parked(v: ReplicaView, nxt: GenView) -> Failure:
    return Failure(nxt.number, FailureKind.START_FAILED.value, None,
                   f"did not reach its startup gate within {park_within(v, nxt):.0f}s")


def successor_failed(v: ReplicaView, out: Out, failure: Failure,
                      repeated: StartCauseRepeated | None = None) -> None:
    """The successor failed (`failure`): recorded, killed, the recycle goes on cold."""
    add_failure(out, failure)
    set_aside(v, out, about(failure))
    check_limit(v, out, repeated=repeated)


def set_aside(v: ReplicaView, out: Out, why: str) -> None:
    """The successor cannot take over: kill it; the recycle goes on cold."""
    out.add(Abandon(why))
    note_fallback(v, out, why)


def stopped_or_held(v: ReplicaView, now: float, out: Out) -> bool:
    """Where a stop or a failure ends: shutting down or held, the replica exits or holds (its
    successor, if any, is killed). True when it did; else the caller starts what comes next."""
    f = v.facts
    if not f.stopping and f.hold is None:
        return False
    if v.successor is not None:
        out.add(Abandon("the runtime is shutting down" if f.stopping else f"held ({f.hold})"))
    out.to(S.EXITING if f.stopping else S.HELD, now, recycle=None)
    return True


def note_fallback(v: ReplicaView, out: Out, why: str) -> None:
    rec = out.m.recycle
    if rec is None:
        return
    note = f"fell back to cold: {why}"[:500]
    out.set(recycle=replace(rec, strategy=Strategy.COLD.value, why=note))
    out.add(RecycleNote(Strategy.COLD.value, note),
            log("recycle_fallback", "warning", replica=v.facts.index, generation=rec.generation, why=why))


def start_cold(v: ReplicaView, now: float, out: Out, strategy: str | None) -> None:
    out.add(Spawn(Slot.CURRENT, gated=False, strategy=strategy))
    out.to(S.STARTING, now, v.facts.cfg.server.startup_timeout)


# -- failures ----------------------------------------------------------------------------------
def fail(v: ReplicaView, now: float, out: Out, cur: GenView, kind: str, exit_code: int | None, detail: str,
          cls: EndClass = EndClass.UNPLANNED, from_log: bool = False) -> None:
    kill_failed(v, now, out, Failure(cur.number, kind, exit_code, detail, cls, from_log))


def kill_failed(v: ReplicaView, now: float, out: Out, failure: Failure,
            repeated: StartCauseRepeated | None = None) -> None:
    """Any unexpected end (exit 0 included) of `current` (the generation `failure` is of) is a
    failure: record it, kill it. A successor already starting stays: it takes over once this one
    is gone."""
    n, rec, kind, cls = failure.generation, out.m.recycle, failure.kind, failure.cls
    add_failure(out, failure)
    if rec is not None:
        out.add(RecycleNote(rec.strategy, f"ended by a failure of generation {n} ({kind})"))
    out.add(Stop(n, kill=True, deadline=now + KILL_WAIT_S, reason=kind, cls=cls))
    if v.machine.state is S.UNREADY:
        out.add(Leaving(False))
    check_limit(v, out, cls, repeated)
    out.to(S.FAILING, now, stop_span(v, kill=True), recycle=None, wanted=None, end_reason=(kind, cls),
           consecutive=v.machine.consecutive + 1)


def check_limit(v: ReplicaView, out: Out, cls: EndClass = EndClass.UNPLANNED,
                 repeated: StartCauseRepeated | None = None) -> None:
    """One more unplanned failure: at `max_failures` within the window the runtime gives up; a
    start that died of the same cause as the last one ends the runtime at once instead."""
    if repeated is not None:
        out.add(repeated)
    elif cls is EndClass.UNPLANNED and v.facts.failures_in_window + 1 >= v.facts.cfg.server.max_failures:
        out.add(GiveUp())


def add_failure(out: Out, failure: Failure) -> None:
    """Record a failure; the replica remembers its death if it was a start that died on its own
    (`last_death`), and forgets the last one otherwise."""
    out.add(failure)
    out.set(last_death=failure.death)


def start_failure(out: Out, g: GenView, detail: str) -> tuple[Failure, StartCauseRepeated | None]:
    """The failure of `g`, which exited on its own before it ever served: its detail is the line
    its log gives (`child.death`; else `detail` and vLLM's root-cause line), and, when the
    replica's last failure was a death of the same cause, the runtime's end instead of a restart."""
    d = g.death
    if d is None:  # nothing read (the driver reads every such death first)
        return Failure(g.number, FailureKind.START_FAILED.value, g.exit_code, detail, from_log=True), None
    repeated = StartCauseRepeated(g.number, d) if same_cause(out.m.last_death, d) else None
    return Failure(g.number, FailureKind.START_FAILED.value, g.exit_code, d.line(g.number), death=d), repeated


def about(f: Failure) -> str:
    """A failure in a few words for a recycle's note: `generation N ...`."""
    return f.detail if f.death is not None else f"generation {f.generation} {f.detail}"


# -- spans -------------------------------------------------------------------------------------
def stop_span(v: ReplicaView, kill: bool) -> float:
    """The longest a stop may take: the signal's deadline, SIGKILL's wait, the memory release."""
    s = v.facts.cfg.server
    return (0.0 if kill else s.stop_timeout) + KILL_WAIT_S + s.memory_release_timeout


def gate_span(v: ReplicaView) -> float:
    s = v.facts.cfg.server
    reach = park_within(v, v.successor) if v.successor is not None else s.gate_timeout
    return reach + s.memory_release_timeout


def number_of(g: GenView | None) -> str:
    return str(g.number) if g is not None else "-"
