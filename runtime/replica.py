"""One replica: the runbook that keeps one vLLM server of the service serving, recycle after
recycle.

Its states are the supervisor's (`machine`): STARTING → SERVING → DRAINING → STOPPING → …,
a failure → STOPPING (SIGKILL) → BACKOFF → STARTING; HELD; EXITING. A recycle runs one of three
strategies (`strategy`), chosen when it begins:

- cold: DRAINING → STOPPING → STARTING the next generation (requests wait through its start);
- overlap: the next generation starts beside the serving one (`next`) while the replica stays
  SERVING; once it is ready it takes new requests and the old one drains and stops in the
  background (`retiring`);
- gated: the next generation starts beside it and parks at its startup gate; then the old one
  DRAINING → STOPPING; when its memory is gone the gate opens and the parked generation goes
  on, STARTING from there (`successor` has the pre-start part).

Everything here is one look per tick; long waits are deadlines.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from vllm_guard.core import plugin
from vllm_guard.core.errors import EXIT_BOOT_ERROR
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.timefmt import utcnow

from . import monitors, successor
from .backend import Backend, child_env, free_port
from .generation import Generation
from .ladder import Ladder, Phase
from .machine import After, Machine, State
from .proxy import Target
from .records import RecycleRecord
from .replicas import ReplicaPlan
from .strategy import Strategy
from .triggers import Readings, generation_limit, recycle_trigger

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = structlog.get_logger("vllm_guard.supervisor")

EXTEND_S = 60.0
# Test hook: "ready" makes the supervisor raise once a generation is ready, to prove that
# `run()` stops the vLLM group on an unexpected exception too.
FAULT_VAR = "VLLM_GUARD_RUNTIME_FAULT"


class InjectedFault(RuntimeError):
    """Raised on purpose (FAULT_VAR)."""


class Replica:
    def __init__(self, sup: Supervisor, plan: ReplicaPlan) -> None:
        self.sup = sup
        self.plan = plan
        self.index = plan.index
        self.machine = Machine()
        self.gen: Generation | None = None  # the generation new requests go to (or that is starting)
        self.next: Generation | None = None  # its successor, starting beside it (overlap, gated)
        self.ladder: Ladder | None = None  # `gen` on its way out (DRAINING, STOPPING)
        self.retiring: list[Ladder] = []  # generations an overlap replaced, draining in the background
        self.recycle: RecycleRecord | None = None
        self.pending: tuple[str, EndClass] | None = None  # a recycle asked for, waiting for its turn
        self.after = After.START
        self.end_reason: tuple[str, EndClass] = ("", EndClass.SCHEDULED)
        self.consecutive = 0
        self.gpu_name = ""
        self.last_strategy: str | None = None
        self.deferred: str | None = None  # why its recycle waits (logged once)
        self.overrun_logged = False
        self._extend_sent = 0.0
        self._steps: dict[State, Callable[[], Awaitable[None]]] = {
            State.STARTING: self._step_starting, State.SERVING: self._step_serving,
            State.DRAINING: self._step_draining, State.STOPPING: self._step_stopping,
            State.BACKOFF: self._step_backoff,
        }

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def busy_recycling(self) -> bool:
        return self.recycle is not None or self.next is not None

    def generations(self) -> list[Generation]:
        """Every generation of this replica whose processes may be alive."""
        out = [g for g in (self.gen, self.next) if g is not None and not g.ended]
        return out + [lad.gen for lad in self.retiring if not lad.gen.ended]

    def enter(self, state: State, timeout: float | None = None) -> None:
        first = not self.machine.entered
        old = self.machine.enter(state, time.monotonic(), timeout)
        self.overrun_logged = False
        log.info("state", old=None if first else old.value, new=state.value, replica=self.index,
                 generation=self.gen.number if self.gen else None, deadline_s=timeout)
        self.sup.state_changed()

    async def step(self) -> None:
        for lad in list(self.retiring):
            await self._step_retiring(lad)
        step = self._steps.get(self.state)
        if step is not None:
            await step()

    # -- generation life -----------------------------------------------------------------------
    async def spawn(self, strategy: str | None, gated: bool = False) -> Generation | None:
        """Launch a generation of this replica (None if the interpreter cannot even be run)."""
        sup, s = self.sup, self.sup.cfg.server
        n = sup.next_number()
        logs = sup.state_dir / "logs"
        env = child_env(sup.cfg, sup.state_dir, n)
        env.update(self.plan.env())
        gate = plugin.gate_dir(sup.state_dir, n) if gated else None
        if gate is not None:
            env = plugin.gate_env(env, gate, successor.park_limit(s))
        backend = Backend(generation=n, model=sup.model, host=s.backend_host, port=free_port(s.backend_host),
                          vllm_args=list(s.vllm_args), log_path=logs / f"generation-{n}.log", python=sup.python,
                          env=env)
        target = Target(generation=n, url=backend.url, limit=generation_limit(sup.cfg.recycle))
        try:
            await backend.start()
        except OSError as e:
            log.error("backend_launch_failed", error=str(e), python=sup.python)
            sup.exit_code = EXIT_BOOT_ERROR
            sup.exit_all()
            return None
        row = sup.ledger.generation_started(n, backend.pid, backend.pid_started, sup.model, self.index, strategy)
        gen = Generation(n, backend, target, row, replica=self.index, strategy=strategy, gate=gate,
                         spawned_mono=time.monotonic())
        log.info("generation_starting", generation=n, replica=self.index, pid=backend.pid, backend=backend.url,
                 max_requests=target.limit, strategy=strategy, gated=gated, gpus=self.plan.gpus or None,
                 log=str(backend.log_path))
        await asyncio.to_thread(sup.prune_logs)
        assert sup.http is not None
        http, probe = sup.http, sup.cfg.probe
        gen.tasks.append(asyncio.create_task(monitors.guarded("ready", n, lambda: monitors.wait_ready(
            gen, http, probe, sup.on_version, sup.wake))))
        return gen

    async def start(self, strategy: str | None = None) -> None:
        """Start the replica's next generation cold (the first, after a failure, after a drain)."""
        gen = await self.spawn(strategy)
        if gen is not None:
            self.gen, self.ladder = gen, None
            self.enter(State.STARTING, self.sup.cfg.server.startup_timeout)

    async def _step_starting(self) -> None:
        gen = self._current()
        b, now = gen.backend, time.monotonic()
        if gen.ready_mono is not None:
            await self.go_live(gen)
            self.enter(State.SERVING)
        elif b.returncode is not None:
            await self.fail(FailureKind.START_FAILED.value, b.returncode, await asyncio.to_thread(b.exit_detail))
        elif self.machine.overdue(now):
            await self.fail(FailureKind.START_TIMEOUT.value, None,
                            f"not ready after {self.sup.cfg.server.startup_timeout:.0f}s")
        elif not self.sup.notifier.ready_sent and now - self._extend_sent >= 10:
            self._extend_sent = now  # the first model load may outlast TimeoutStartSec
            self.sup.notifier.extend_timeout(EXTEND_S)

    async def go_live(self, gen: Generation) -> None:
        """`gen` is ready: requests go to it; its recycle (if one brought it) is over."""
        sup, b, t = self.sup, gen.backend, gen.target
        gen.cancel_tasks()
        t.open(sup.cfg.server.request_timeout)
        await sup.proxy.add_target(t, self.index)
        if sup.cfg.server.recycle_strategy != Strategy.COLD.value:
            # the count limit is soft: the recycle it triggers starts the successor beside it
            sup.proxy.router.allow_past_limit(t)
        sup.ledger.generation_ready(gen.row, sup.vllm_version, self.gpu_name)
        self.consecutive = 0
        sup.failure_restored()
        rec = self.recycle
        if rec is not None:
            self.recycle = None
            now = time.monotonic()
            rec.duration_s = round(now - rec.started_mono, 3)
            rec.downtime_s = round(now - rec.closed_mono, 3) if rec.closed_mono is not None else 0.0
            rec.queued = max(rec.queued, sup.proxy.counters.max_queued)
            sup.ledger.recycle_update(rec.ledger_id, ready_at=utcnow(), duration_s=rec.duration_s,
                                      downtime_s=rec.downtime_s, max_queued=rec.queued, strategy=rec.strategy)
            log.info("recycle_done", replica=self.index, generation=rec.generation, next_generation=gen.number,
                     strategy=rec.strategy, duration_s=rec.duration_s, downtime_s=rec.downtime_s, queued=rec.queued)
        found = await b.children()
        gen.children, gen.engine_pids = found, monitors.engine_pids(found)
        log.info("generation_ready", generation=gen.number, replica=self.index, pid=b.pid,
                 load_s=round(time.monotonic() - b.started_mono, 1), vllm=sup.vllm_version, strategy=gen.strategy,
                 children=[c.model_dump(mode="json") for c in gen.listed_children])
        if os.environ.get(FAULT_VAR) == "ready":
            raise InjectedFault(f"{FAULT_VAR}=ready: raised once generation {gen.number} was ready")
        sup.last_probe = None  # a clean slate: the last probe of the old generation says nothing of this one
        sup.ready()
        assert sup.http is not None
        http, n = sup.http, gen.number
        gen.tasks = [
            asyncio.create_task(monitors.guarded("probe", n, lambda: monitors.probe_loop(
                gen, http, sup.cfg.probe, sup.on_probe, sup.wake))),
            asyncio.create_task(monitors.guarded("memory", n, lambda: monitors.memory_loop(
                gen, sup.cfg.recycle, sup.nvml, sup.ledger, sup.wake))),
        ]

    async def _step_serving(self) -> None:
        gen = self._current()
        b = gen.backend
        if b.returncode is not None:
            await self.fail(FailureKind.CRASH.value, b.returncode, f"backend exited with {b.returncode}")
        elif gen.dead_engine is not None:
            await self.fail(FailureKind.CRASH.value, None, f"engine process {gen.dead_engine} died")
        elif gen.hang is not None:
            await self.fail(FailureKind.HANG.value, None, gen.hang)
        elif self.next is not None:
            await successor.step(self)
        elif self.sup.hold is None:
            trigger = recycle_trigger(self.sup.cfg.recycle, self.readings(gen), time.monotonic())
            wanted = (trigger.reason, trigger.cls) if trigger is not None else self.pending
            if wanted is not None:
                await self.try_recycle(*wanted)

    def readings(self, gen: Generation) -> Readings:
        now = time.monotonic()
        ready = gen.ready_mono if gen.ready_mono is not None else now
        t = gen.target
        idle = 0.0 if t.in_flight or self.sup.proxy.queued else now - t.last_activity
        return Readings(ready_at=ready, requests=t.toward_limit, limit=t.limit, idle_for=min(idle, now - ready),
                        growth=gen.growth)

    # -- recycle -------------------------------------------------------------------------------
    async def try_recycle(self, reason: str, cls: EndClass) -> bool:
        """Begin a recycle if the rolling rule allows it now; else keep serving and wait."""
        why = self.sup.why_wait(self)
        if why is None:
            self.pending, self.deferred = None, None
            await self.begin_recycle(reason, cls)
            return True
        self.pending = (reason, cls)
        if self.deferred != why:
            self.deferred = why
            log.info("recycle_deferred", replica=self.index, reason=reason, why=why)
        if self.gen is not None:
            self.sup.proxy.router.allow_past_limit(self.gen.target)  # nothing queues while it waits
            await self.sup.proxy.wake_waiters()
        return False

    async def begin_recycle(self, reason: str, cls: EndClass) -> None:
        sup, gen = self.sup, self._current()
        t, q = gen.target, sup.proxy.queued
        in_flight, started, started_mono = t.in_flight, utcnow(), time.monotonic()  # the moment of the decision:
        sup.proxy.counters.max_queued = q  # the queue's high-water mark counts from here
        choice = await successor.choose_strategy(self, gen)  # measuring takes a while; requests end and queue
        rec = RecycleRecord(reason=reason, cls=cls, started=started, in_flight=in_flight, queued=q,
                            generation=gen.number, started_mono=started_mono, replica=self.index,
                            strategy=choice.strategy.value, strategy_reason=choice.reason)
        rec.ledger_id = sup.ledger.recycle_started(gen.number, reason, cls.value, rec.in_flight, q, self.index,
                                                   rec.strategy)
        self.recycle = sup.recycles.add(rec)
        self.last_strategy = rec.strategy
        self.end_reason = (reason, cls)
        self.after = After.START
        log.info("recycle_begin", generation=gen.number, replica=self.index, reason=reason, cls=cls.value,
                 in_flight=rec.in_flight, queued=q, served=t.dispatched, toward_limit=t.toward_limit,
                 inherited=t.inherited, limit=t.limit, strategy=rec.strategy, why=choice.reason)
        if choice.strategy is Strategy.COLD:
            await self.begin_drain()
        else:
            await successor.begin(self, choice.strategy)

    async def begin_drain(self) -> None:
        gen = self._current()
        reason, cls = self.end_reason
        rec = self.recycle
        if rec is not None and rec.closed_mono is None:
            rec.closed_mono = time.monotonic()
        self.ladder = Ladder(gen, reason, cls, rec.ledger_id if rec is not None else None)
        await self.ladder.begin_drain(self.sup)
        self.enter(State.DRAINING, self.sup.cfg.server.drain_timeout)

    async def begin_stop(self, kill: bool) -> None:
        gen = self._current()
        reason, cls = self.end_reason
        rec = self.recycle
        if self.ladder is None or self.ladder.gen is not gen:
            self.ladder = Ladder(gen, reason, cls, rec.ledger_id if rec is not None else None)
        self.ladder.reason, self.ladder.cls = reason, cls
        await self.ladder.begin_stop(self.sup, kill)
        self.enter(State.STOPPING, self.ladder.deadline - time.monotonic())

    async def _step_draining(self) -> None:
        lad = self._ladder()
        if self.recycle is not None:
            self.recycle.queued = max(self.recycle.queued, self.sup.proxy.counters.max_queued)
        await successor.watch_parked(self)
        await lad.step(self.sup)
        if lad.died:
            await self.fail(FailureKind.CRASH.value, lad.gen.backend.returncode, "backend died while draining",
                            ladder_started=True)
        elif lad.phase is Phase.STOPPING:
            self.enter(State.STOPPING, lad.deadline - time.monotonic())

    async def _step_stopping(self) -> None:
        lad = self._ladder()
        if not lad.done:
            await successor.watch_parked(self)
            await lad.step(self.sup)
            if not lad.done:
                return
        if self.after is After.PROMOTE and not self.sup.hold and not self.sup.stopping and self.next is not None:
            await successor.promote(self, lad)  # opens the gate once the GPU memory is free
            return
        await self.after_stop()

    async def after_stop(self) -> None:
        sup, nxt = self.sup, self.after
        await successor.abandon(self, "its predecessor's recycle did not complete")
        if nxt is After.EXIT or sup.stopping:
            self.enter(State.EXITING)
        elif nxt is After.HOLD or sup.hold:
            self.enter(State.HELD)
            await sup.held_changed()
        elif nxt is After.BACKOFF:
            s = sup.cfg.server
            self.enter(State.BACKOFF, min(s.backoff_max, s.backoff_initial * 2 ** max(self.consecutive - 1, 0)))
        else:
            await self.start("cold" if self.recycle is not None else None)

    async def _step_backoff(self) -> None:
        if self.machine.overdue(time.monotonic()):
            await self.start()

    async def _step_retiring(self, lad: Ladder) -> None:
        await lad.step(self.sup)
        if lad.died:
            lad.died = False
            g = lad.gen
            self.sup.record_failure(g, FailureKind.CRASH.value, g.backend.returncode,
                                    f"backend died while draining (replaced by generation "
                                    f"{self.gen.number if self.gen else '-'})")
        if lad.done:
            self.retiring.remove(lad)

    # -- failures ------------------------------------------------------------------------------
    async def fail(self, kind: str, exit_code: int | None, detail: str, cls: EndClass = EndClass.UNPLANNED,
                   ladder_started: bool = False) -> None:
        """Any unexpected end (exit 0 included) is a failure: record it, kill the group, back off."""
        sup, gen = self.sup, self._current()
        sup.record_failure(gen, kind, exit_code, detail, cls)
        await sup.proxy.stop_dispatch(gen.target, dead=True)
        await successor.abandon(self, f"generation {gen.number} failed ({kind})")
        self.recycle = None  # a recycle that ended in a failure is over
        self.consecutive += 1
        self.end_reason = (kind, cls)
        if sup.stopping:
            self.after = After.EXIT
        elif sup.hold:
            self.after = After.HOLD
        elif sup.failure_limit_reached():
            self.after = After.EXIT
            await sup.give_up(self)
        else:
            self.after = After.BACKOFF
        await self.begin_stop(kill=True)

    def _current(self) -> Generation:
        if self.gen is None:
            raise RuntimeError(f"replica {self.index} in state {self.state.value} without a generation")
        return self.gen

    def _ladder(self) -> Ladder:
        if self.ladder is None:
            raise RuntimeError(f"replica {self.index} in state {self.state.value} without a stop in progress")
        return self.ladder

    async def on_hold(self) -> None:
        """Held: nothing new starts. A successor starting beside the serving generation is
        stopped (the serving one keeps serving); a replica backing off stays down."""
        if self.state is State.SERVING and self.next is not None:
            await successor.abandon(self, f"held ({self.sup.hold})")
            self.recycle = None
        elif self.state is State.BACKOFF:
            self.enter(State.HELD)
        self.pending = None

    # -- shutdown ------------------------------------------------------------------------------
    async def stop(self, second: bool) -> None:
        """SIGTERM/SIGINT: drain and stop; a second signal shortens the ladder."""
        self.after = After.EXIT
        self.pending = None
        await successor.abandon(self, "the runtime is shutting down")
        if self.state in (State.BACKOFF, State.HELD):
            self.enter(State.EXITING)
        elif self.state is State.SERVING:
            self.end_reason = ("shutdown", EndClass.SCHEDULED)
            await self.begin_drain()
        elif self.state is State.STARTING:
            self.end_reason = ("shutdown", EndClass.SCHEDULED)
            await self.begin_stop(kill=False)
        elif second and self.state is State.DRAINING:
            await self.begin_stop(kill=False)
        elif second and self.state is State.STOPPING:
            await self.begin_stop(kill=True)

    async def kill_for_good(self) -> None:
        """The runtime's way out, whatever the state: no process of this replica survives."""
        for gen in self.generations():
            gen.cancel_tasks()
            await gen.backend.kill_for_good()
            if not gen.ended:  # the runtime itself failed (an exception) with this generation
                gen.ended = True
                self.sup.ledger.generation_ended(gen.row, "runtime_error", EndClass.UNPLANNED.value,
                                                 gen.target.completed)
