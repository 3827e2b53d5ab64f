"""The replica's thin driver: builds the view, asks `decide`, carries out the effects.

It holds what cannot be data — the generations' processes, targets and monitor tasks — in three
slots (`current`, `successor`, `retiring`) and changes them only as an effect says. It decides
nothing: every branch on the replica's state or strategy is in `decide` (tests/test_architecture.py
checks it). Effects are carried out in order through the narrow interfaces of `ports`; one that
cannot be (a launch that fails) turns into an event for `decide`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Awaitable, Callable

import structlog

from vllm_guard.core import plugin
from vllm_guard.core.protocol import HolderStatus

from .decide import decide
from .generation import Generation
from .machine import Machine, State, coarse
from .plan import ReplicaPlan
from .steps import PRIOR_GENERATIONS, prior_rate
from .ports import Books, Door, Hub, Spawner, Watchers
from .view import (
    Abandon, Decision, Drain, Effect, EnforceLimits, Event, Extend, ExitAll, Facts, Failure, Finish, GiveUp, GoLive,
    LearnGate, LearnStandby, LearnStart, Leaving, Log, OpenGate, PastLimit, Promote, RecycleBegan, RecycleMark,
    RecycleNote, RecycleOver, RecycleReady, RejectRequests, ReplicaView, Reply, Slot, Spawn, SpawnFailed,
    StartCauseRepeated, Stop, Tick, Unpace, WatchRoom, Detach,
)

log = structlog.get_logger("vllm_guard.supervisor")

# Test hook: "ready" makes the runtime raise once a generation is ready, to prove that the
# runtime stops the vLLM group on an unexpected exception too.
FAULT_VAR = "VLLM_GUARD_RUNTIME_FAULT"
MAX_FOLLOW_UPS = 4
SLOW_EFFECT_S = 1.0


class InjectedFault(RuntimeError):
    """Raised on purpose (FAULT_VAR)."""


class ReplicaDriver:
    def __init__(self, plan: ReplicaPlan, spawner: Spawner, door: Door, books: Books, watchers: Watchers,
                 hub: Hub, request_timeout: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.index = plan.index
        self.spawner, self.door, self.books, self.watchers, self.hub = spawner, door, books, watchers, hub
        self.clock = clock
        self.request_timeout = request_timeout
        self.machine = Machine()
        self.current: Generation | None = None
        self.successor: Generation | None = None
        self.retiring: list[Generation] = []
        self.gpu_name = ""
        self.gpu_room: bool | None = None
        # generation -> the GPU growth rate it last measured, oldest first (numbers only grow)
        self.gpu_rates: dict[int, float] = {}
        self._room_off: Callable[[], None] | None = None
        self.overrun_logged = False

    # -- what others see ---------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def gpu_mb_s(self) -> float | None:
        """The GPU growth rate the replica's last generations measured: the next one's prior."""
        return prior_rate(self.gpu_rates.values())

    def generations(self) -> list[Generation]:
        """Every generation of this replica whose processes may be alive."""
        out = [g for g in (self.current, self.successor) if g is not None and not g.ended]
        return out + [g for g in self.retiring if not g.ended]

    def view(self, facts: Facts) -> ReplicaView:
        now, q = self.clock(), self.door.queued
        return ReplicaView(
            machine=self.machine, facts=facts,
            current=self.current.view(q, now) if self.current is not None else None,
            successor=self.successor.view(q, now) if self.successor is not None else None,
            retiring=tuple(g.view(q, now) for g in self.retiring))

    # -- one step ----------------------------------------------------------------------------
    async def handle(self, event: Event, facts: Callable[[], Facts]) -> Decision:
        """`decide` on `event`, then carry out its effects; an effect that fails becomes the next
        event (at most a few in a row). Returns the first decision (its reply, if a command)."""
        first, follow = await self._step(event, facts)
        for _ in range(MAX_FOLLOW_UPS - 1):
            if follow is None:
                break
            _, follow = await self._step(follow, facts)
        return first

    async def _step(self, event: Event, facts: Callable[[], Facts]) -> tuple[Decision, Event | None]:
        await self._read_deaths()
        if self.current is not None and self.current.gpu_mb_s is not None:
            self.gpu_rates[self.current.number] = self.current.gpu_mb_s  # kept past its end: a leak outlives it
            if len(self.gpu_rates) > PRIOR_GENERATIONS:
                del self.gpu_rates[next(iter(self.gpu_rates))]
        d = decide(self.view(facts()), event, self.clock())
        before = self.machine
        self.machine = d.machine
        follow = await self._carry_out(d.effects)
        if d.machine.seq != before.seq:
            self._entered(before, d.machine)
        return d, follow

    async def _read_deaths(self) -> None:
        """A generation that exited on its own before it ever served: why, from its log (read in
        a worker thread: it blocks), before `decide` sees the exit, so its view carries the cause."""
        for gen in (self.current, self.successor):
            if gen is not None and gen.died_unread():
                text = await asyncio.to_thread(gen.backend.log_text)
                gen.note_death(text, self.clock())

    async def tick(self, facts: Callable[[], Facts]) -> None:
        await self.handle(Tick(), facts)

    def _entered(self, before: Machine, m: Machine) -> None:
        self.overrun_logged = False
        log.info("state", old=before.state.value if before.entered else None, new=m.state.value,
                 runtime_state=coarse(m.state).value,
                 replica=self.index, generation=self.current.number if self.current else None,
                 deadline_s=round(m.deadline - m.since, 1) if m.deadline is not None else None)
        self.hub.state_changed()

    def _note_room(self, room: bool) -> None:
        self.gpu_room = room

    async def _carry_out(self, effects: tuple[Effect, ...]) -> Event | None:
        for e in effects:
            follow = await self._one(e)
            if follow is not None:
                return follow
        return None

    async def _one(self, e: Effect) -> Event | None:  # noqa: C901 - one line per effect kind
        handler = self._handlers.get(type(e))
        if handler is None:
            raise TypeError(f"no handler for effect {type(e).__name__}")
        t0 = time.monotonic()
        try:
            return await handler(self, e)
        finally:
            took = time.monotonic() - t0
            if took >= SLOW_EFFECT_S:  # the supervisor's turn (and WATCHDOG=1) waited for it
                log.warning("effect_slow", replica=self.index, effect=type(e).__name__, seconds=round(took, 2),
                            state=self.state.value)

    # -- effects -----------------------------------------------------------------------------
    async def _spawn(self, e: Spawn) -> Event | None:
        try:
            gen = await self.spawner.spawn(self.index, e.strategy, e.gated, beside=e.slot is Slot.SUCCESSOR,
                                           standby=e.standby, late=e.late, kv=e.kv)
        except OSError as err:
            return SpawnFailed(str(err))
        if e.slot is Slot.SUCCESSOR:
            self.successor = gen
            self.books.recycle_note(self.index, e.strategy or "", "", gen.number)
        else:
            self.current = gen
        self.watchers.booting(gen)
        return None

    async def _go_live(self, e: GoLive) -> Event | None:
        gen = self._find(e.generation)
        gen.cancel_tasks()
        gen.target.open(self.request_timeout)
        await self.door.add_target(gen.target, self.index)
        if e.past_limit:
            await self.door.allow_past_limit(gen.target)  # the limit is soft: its successor starts beside it
        gen.went_live()
        await self.spawner.unpin(gen, "it serves")
        gen.note_engines(await gen.backend.children())
        await self.spawner.went_live(gen)
        self.books.generation_ready(gen)
        self.books.restored(self.index)
        log.info("generation_ready", generation=gen.number, replica=self.index, pid=gen.backend.pid,
                 load_s=round(self.clock() - gen.backend.started_mono, 1), strategy=gen.strategy,
                 children=[c.model_dump(mode="json") for c in gen.listed_children])
        if os.environ.get(FAULT_VAR) == "ready":
            raise InjectedFault(f"{FAULT_VAR}=ready: raised once generation {gen.number} was ready")
        self.hub.ready()
        self.watchers.serving(gen)
        return None

    async def _promote(self, _: Promote) -> Event | None:
        old, self.current, self.successor = self.current, self.successor, None
        if old is not None:
            self.retiring.append(old)
        return None

    async def _abandon(self, e: Abandon) -> Event | None:
        nxt, self.successor = self.successor, None
        if nxt is None:
            return None
        log.warning("successor_abandoned", generation=nxt.number, replica=self.index, why=e.why)
        self.retiring.append(nxt)
        from vllm_guard.core.ledger import EndClass

        from .steps import KILL_WAIT_S
        await self._stop(Stop(nxt.number, kill=True, deadline=self.clock() + KILL_WAIT_S,
                              reason=f"abandoned: {e.why}"[:200], cls=EndClass.SCHEDULED))
        return None

    async def _drain(self, e: Drain) -> Event | None:
        gen = self._find(e.generation)
        await self.door.stop_dispatch(gen.target, hand_over=e.hand_over)
        gen.cancel_tasks()
        gen.begin_drain(e.deadline, (e.reason, e.cls))
        return None

    async def _stop(self, e: Stop) -> Event | None:
        gen = self._find(e.generation)
        await self.door.stop_dispatch(gen.target, dead=e.kill)
        gen.cancel_tasks()
        await gen.backend.children()  # remember every pid before the tree falls apart
        gen.backend.signal_all(signal.SIGKILL if e.kill else signal.SIGTERM)
        gen.begin_stop(e.kill, e.deadline, self.clock(),
                       (e.reason, e.cls) if e.reason is not None and e.cls is not None else None)
        if gen.stop_task is None:
            self.watchers.stopping(gen)
        return None

    async def _detach(self, e: Detach) -> Event | None:
        """Leave the generation running for the next runtime: no monitor, no route, not stopped
        by this runtime's way out; its ledger row stays open for the next runtime to go on with."""
        gen = self._find(e.generation)
        await self.door.stop_dispatch(gen.target)
        gen.cancel_tasks()
        gen.note_engines(await gen.backend.children())  # every pid, for the record and the keeper
        gen.finished()
        if gen is self.current:
            self.current = None
        self.hub.handed_over(gen)
        log.info("generation_handed_over", generation=gen.number, replica=self.index, pid=gen.backend.pid,
                 served=gen.target.completed)
        return None

    async def _finish(self, e: Finish) -> Event | None:
        gen = self._find(e.generation)
        b = gen.backend
        if b.proc is not None and b.returncode is None and not e.leftover:
            try:
                await asyncio.wait_for(b.proc.wait(), 2.0)
            except asyncio.TimeoutError:
                log.warning("api_server_not_reaped", generation=gen.number, pid=b.pid)
        gen.finished()
        self.hub.reap_later([p for p in b.known_pids if p != b.pid])
        b.gone()
        await gen.target.close()
        self.books.generation_ended(gen, e.leftover)
        if gen is self.current:
            self.current = None
        elif gen is self.successor:
            self.successor = None
        else:
            self.retiring = [g for g in self.retiring if g is not gen]
        reason, cls = gen.end_reason
        log.info("generation_stopped", generation=gen.number, replica=self.index, reason=reason, cls=cls.value,
                 served=gen.target.completed, exit_code=b.returncode,
                 stop_s=round(self.clock() - gen.stop_mark, 2) if gen.stop_mark is not None else None)
        return None

    async def _open_gate(self, e: OpenGate) -> Event | None:
        gen = self._find(e.generation)
        if gen.gate is not None:
            kv = e.kv if gen.kv else ""  # only where the spawner let it map the held KV cache
            await self.spawner.unpin(gen, "its gate opens")  # before: its start after the gate is the gap
            await asyncio.to_thread(plugin.open_gate, gen.gate, kv)
            if kv and not gen.late:
                gen.kv = kv  # an early-gated engine allocates its KV cache after the gate, as told here
            gen.gate_open = True
            gen.mark("gate_opened", self.clock())
        return None

    async def _unpace(self, e: Unpace) -> Event | None:
        gen = self._find(e.generation)
        await self.spawner.unpin(gen, "nothing serves beside its start any more")
        if gen.paced and not gen.unpaced:
            await self.spawner.unpace(gen)
            gen.unpaced = True
            log.info("generation_unpaced", generation=gen.number, replica=self.index,
                     why="nothing serves beside its start any more")
        return None

    async def _past_limit(self, e: PastLimit) -> Event | None:
        if self.current is not None:
            await self.door.allow_past_limit(self.current.target, e.allowed)
        return None

    async def _leaving(self, e: Leaving) -> Event | None:
        if self.current is not None:
            self.door.set_leaving(self.current.target, e.leaving)
        return None

    async def _watch_room(self, e: WatchRoom) -> Event | None:
        """Start (a fresh reading: none yet) or stop the GPU-room watch of a parked successor."""
        if self._room_off is not None:
            self._room_off()
        self._room_off = self.watchers.room(self.index, self._note_room) if e.on else None
        self.gpu_room = None
        return None

    async def _enforce_limits(self, e: EnforceLimits) -> Event | None:
        self.door.enforce_limit = e.on
        return None

    async def _reject_requests(self, e: RejectRequests) -> Event | None:
        await self.door.set_reject(e.reason)
        return None

    async def _failure(self, e: Failure) -> Event | None:
        gen = self._find(e.generation)
        detail = e.detail
        if e.from_log:
            full = await asyncio.to_thread(gen.backend.exit_detail)
            cause = full.partition(": ")[2] if ": " in full else ""
            detail = f"{detail}: {cause}" if cause else detail
        self.books.failure(gen, e.kind, e.exit_code, detail, e.cls)
        return None

    async def _recycle_began(self, e: RecycleBegan) -> Event | None:
        cur = self.current
        self.books.recycle_began(self.index, e.recycle, cur.target.in_flight if cur else 0, self.door.queued)
        if self.successor is not None:  # a standby takes over
            self.books.recycle_note(self.index, e.recycle.strategy, "", self.successor.number)
        self.door.queue_mark()  # the queue's high-water mark counts from the decision
        return None

    async def _recycle_note(self, e: RecycleNote) -> Event | None:
        nxt = self.successor.number if self.successor is not None else None
        self.books.recycle_note(self.index, e.strategy, e.why, nxt)
        return None

    async def _recycle_mark(self, e: RecycleMark) -> Event | None:
        self.books.recycle_mark(self.index, e.what)
        return None

    async def _recycle_over(self, _: RecycleOver) -> Event | None:
        self.books.recycle_over(self.index)
        return None

    async def _recycle_ready(self, e: RecycleReady) -> Event | None:
        self.books.recycle_ready(self.index, e.generation, e.duration_s, e.downtime_s, self.door.queue_mark())
        log.info("recycle_done", replica=self.index, next_generation=e.generation, duration_s=e.duration_s,
                 downtime_s=e.downtime_s)
        return None

    async def _log(self, e: Log) -> Event | None:
        getattr(log, e.level)(e.event, **dict(e.fields))
        return None

    async def _extend(self, _: Extend) -> Event | None:
        self.hub.extend()
        return None

    async def _give_up(self, _: GiveUp) -> Event | None:
        self.hub.give_up()
        return None

    async def _start_cause_repeated(self, e: StartCauseRepeated) -> Event | None:
        self.hub.start_failure(e.death.line(e.generation))
        return None

    async def _exit_all(self, e: ExitAll) -> Event | None:
        self.hub.exit_all(e.code)
        return None

    async def _learn_gate(self, e: LearnGate) -> Event | None:
        self.hub.learn_gate(e.reason)
        return None

    async def _learn_standby(self, e: LearnStandby) -> Event | None:
        self.hub.learn_standby(self.index, e.failed)
        return None

    async def _learn_start(self, e: LearnStart) -> Event | None:
        self.hub.learn_start(self.index, e.beside, e.seconds)
        return None

    async def _reply(self, _: Reply) -> Event | None:
        return None  # the caller reads it from the decision

    _handlers: dict[type, Callable[[ReplicaDriver, Any], Awaitable[Event | None]]] = {
        Spawn: _spawn, GoLive: _go_live, Promote: _promote, Abandon: _abandon, Drain: _drain, Stop: _stop,
        Detach: _detach, Finish: _finish, OpenGate: _open_gate, Unpace: _unpace, PastLimit: _past_limit, Leaving: _leaving, WatchRoom: _watch_room,
        EnforceLimits: _enforce_limits, RejectRequests: _reject_requests, Failure: _failure,
        RecycleBegan: _recycle_began, RecycleNote: _recycle_note, RecycleMark: _recycle_mark,
        RecycleOver: _recycle_over, RecycleReady: _recycle_ready, Log: _log, Extend: _extend, GiveUp: _give_up,
        StartCauseRepeated: _start_cause_repeated, ExitAll: _exit_all,
        LearnGate: _learn_gate, LearnStandby: _learn_standby, LearnStart: _learn_start, Reply: _reply,
    }

    # -- helpers -----------------------------------------------------------------------------
    def _find(self, number: int) -> Generation:
        for g in (self.current, self.successor, *self.retiring):
            if g is not None and g.number == number:
                return g
        raise LookupError(f"replica {self.index} has no generation {number}")

    async def kill_for_good(self, ended: Callable[[Generation], None]) -> None:
        """The runtime's way out, whatever the state: no process of this replica survives."""
        for gen in self.generations():
            gen.cancel_tasks()
            await gen.backend.kill_for_good()
            if not gen.ended:  # the runtime itself failed (an exception) with this generation
                gen.finished()
                ended(gen)
        if self._room_off is not None:
            self._room_off()
            self._room_off = None

    def holder_status(self) -> HolderStatus | None:
        return self.spawner.holder_status(self.index)

    def overdue(self, now: float, grace: float) -> bool:
        return self.machine.overdue(now, grace)

    def note_overrun(self) -> None:
        self.overrun_logged = True


__all__ = ["FAULT_VAR", "InjectedFault", "ReplicaDriver"]
