"""The supervisor: one loop that keeps exactly one vLLM generation serving.

Like gunicorn's Arbiter, signals and admin commands only enqueue; every decision happens in
`run()`, which reads like a runbook: wait, handle commands, step the current state, tell
systemd we are alive. Long actions (draining, a 60-140 s cold start) are states with deadlines
(`machine`), never blocking calls, so the WATCHDOG=1 pings continue through a planned recycle.
What it decides on comes from elsewhere: the recycle triggers are pure functions (`triggers`),
hang and memory and process readings come from the monitors (`monitors`), off this loop.
`run()` stops the vLLM process group on every way out, an exception included.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.errors import EXIT_BOOT_ERROR, EXIT_FAILURE_LIMIT, EXIT_OK
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.notify import Notifier
from vllm_guard.core.protocol import ProbeSummary, StatusSnapshot
from vllm_guard.core.timefmt import utcnow

from . import lifecycle, monitors, procs
from .backend import Backend, child_env, free_port
from .commands import Commands
from .generation import Generation
from .holdfile import HoldFile
from .ledger import RuntimeLedger
from .machine import Machine, State
from .proxy import Proxy, Target
from .records import FailureRecord, Recent, RecycleRecord
from .status import snapshot, status_line
from .triggers import Readings, generation_limit, recycle_trigger

if TYPE_CHECKING:
    import aiohttp

    from vllm_guard.core.nvml import NvmlSession

log = structlog.get_logger("vllm_guard.supervisor")

TICK_S = 0.25
OVERRUN_GRACE_S = 60.0
EXTEND_S = 60.0
# Test hook: "ready" makes the supervisor raise once a generation is ready, to prove that
# `run()` stops the vLLM group on an unexpected exception too.
FAULT_VAR = "VLLM_GUARD_RUNTIME_FAULT"


class InjectedFault(RuntimeError):
    """Raised on purpose (FAULT_VAR)."""


class After(enum.Enum):
    """What follows a stopped generation."""

    START = "start"
    BACKOFF = "backoff"
    HOLD = "hold"
    EXIT = "exit"


class Supervisor:
    def __init__(self, cfg: GuardConfig, model: str, python: str = sys.executable,
                 ledger: RuntimeLedger | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.python = python
        self.state_dir = Path(cfg.server.state_dir)
        self.machine = Machine()
        self.ledger = ledger if ledger is not None else RuntimeLedger(self.state_dir)
        self.generation = self.ledger.first_generation - 1  # numbers continue across runtimes
        self.gen: Generation | None = None
        self.proxy = Proxy(cfg.server, on_limit=self._on_proxy_event, on_error=self._on_proxy_event)
        self.notifier = Notifier()
        self.holdfile = HoldFile(self.state_dir)
        self.hold: str | None = self.holdfile.read()
        self.proxy.enforce_limit = self.hold is None
        self.nvml: NvmlSession | None = None
        self.commands = Commands(self)
        self._wakeup = asyncio.Event()
        self.failures: Recent[FailureRecord] = Recent()
        self.recycles: Recent[RecycleRecord] = Recent()
        self._failure_times: collections.deque[float] = collections.deque()
        self._consecutive = 0
        self._unrestored: list[FailureRecord] = []
        self._recycle: RecycleRecord | None = None
        self._after_stop = After.START
        self.end_reason: tuple[str, EndClass] = ("", EndClass.SCHEDULED)
        self._kill_sent = False
        self._stop_mark = 0.0
        self._status_sent = 0.0
        self._extend_sent = 0.0
        self._overrun_logged = False
        self.exit_code = EXIT_OK
        self.vllm_version = ""
        self.gpu_name = ""
        self.last_probe: ProbeSummary | None = None
        self.reaper = procs.Reaper()
        self.http: aiohttp.ClientSession | None = None
        self.admin: Any = None  # the admin socket's runner
        self.tasks: list[asyncio.Task[Any]] = []  # the runtime's own (the status monitor)
        self._steps: dict[State, Callable[[], Awaitable[None]]] = {
            State.STARTING: self._step_starting,
            State.SERVING: self._step_serving,
            State.DRAINING: self._step_draining,
            State.STOPPING: self._step_stopping,
            State.BACKOFF: self._step_backoff,
        }

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def recycle_in_progress(self) -> RecycleRecord | None:
        return self._recycle

    def status(self) -> StatusSnapshot:
        return snapshot(self)

    def after_stop_exit(self) -> None:
        self._after_stop = After.EXIT

    # -- the runbook ---------------------------------------------------------------------------
    async def run(self, admin_start: Callable[[Supervisor], Awaitable[Any]] | None = None) -> int:
        try:
            await lifecycle.open_runtime(self, admin_start)
            while self.state is not State.EXITING:
                await self._sleep()
                await self.commands.handle()
                step = self._steps.get(self.state)
                if step is not None:
                    await step()
                await self._heartbeat()
        finally:
            await lifecycle.close_runtime(self)
        log.info("runtime_exited", exit_code=self.exit_code)
        return self.exit_code

    async def _sleep(self) -> None:
        try:
            await asyncio.wait_for(self._wakeup.wait(), TICK_S)
        except asyncio.TimeoutError:
            pass
        self._wakeup.clear()

    def wake(self) -> None:
        self._wakeup.set()

    def enter(self, state: State, timeout: float | None = None) -> None:
        first = not self.machine.entered
        old = self.machine.enter(state, time.monotonic(), timeout)
        self._overrun_logged = False
        log.info("state", old=None if first else old.value, new=state.value, generation=self.generation,
                 deadline_s=timeout)
        self.send_status()

    # -- generation life -----------------------------------------------------------------------
    async def start_generation(self) -> None:
        self.generation += 1
        n, s = self.generation, self.cfg.server
        logs = self.state_dir / "logs"
        backend = Backend(generation=n, model=self.model, host=s.backend_host, port=free_port(s.backend_host),
                          vllm_args=list(s.vllm_args), log_path=logs / f"generation-{n}.log", python=self.python,
                          env=child_env(self.cfg, self.state_dir, n))
        target = Target(generation=n, url=backend.url, limit=generation_limit(self.cfg.recycle))
        try:
            await backend.start()
        except OSError as e:
            log.error("backend_launch_failed", error=str(e), python=self.python)
            self.exit_code = EXIT_BOOT_ERROR
            self.enter(State.EXITING)
            return
        await asyncio.to_thread(lifecycle.prune_logs, logs)
        row = self.ledger.generation_started(n, backend.pid, backend.pid_started, self.model)
        self.gen = gen = Generation(n, backend, target, row)
        log.info("generation_starting", generation=n, pid=backend.pid, backend=backend.url, max_requests=target.limit,
                 log=str(backend.log_path))
        assert self.http is not None
        http, probe = self.http, self.cfg.probe
        gen.tasks.append(asyncio.create_task(monitors.guarded("ready", n, lambda: monitors.wait_ready(
            gen, http, probe, self._on_version, self.wake))))
        self.enter(State.STARTING, s.startup_timeout)

    async def _step_starting(self) -> None:
        gen = self._current()
        b, now = gen.backend, time.monotonic()
        if gen.ready_mono is not None:
            await self._on_ready(gen)
        elif b.returncode is not None:
            await self.fail(FailureKind.START_FAILED.value, b.returncode, await asyncio.to_thread(b.exit_detail))
        elif self.machine.overdue(now):
            await self.fail(FailureKind.START_TIMEOUT.value, None,
                             f"not ready after {self.cfg.server.startup_timeout:.0f}s")
        elif not self.notifier.ready_sent and now - self._extend_sent >= 10:
            self._extend_sent = now  # the first model load may outlast TimeoutStartSec
            self.notifier.extend_timeout(EXTEND_S)

    async def _on_ready(self, gen: Generation) -> None:
        b, t = gen.backend, gen.target
        gen.cancel_tasks()
        t.open(self.cfg.server.request_timeout)
        await self.proxy.set_target(t)
        self.ledger.generation_ready(gen.row, self.vllm_version, self.gpu_name)
        self._consecutive = 0
        for f in self._unrestored:
            f.restored_at = utcnow()
            self.ledger.failure_restored(f.ledger_id)
        self._unrestored.clear()
        if self._recycle is not None:
            rec, self._recycle = self._recycle, None
            rec.duration_s = rec.downtime_s = round(time.monotonic() - rec.started_mono, 3)
            rec.queued = max(rec.queued, self.proxy.counters.max_queued)
            self.ledger.recycle_update(rec.ledger_id, ready_at=utcnow(), duration_s=rec.duration_s,
                                       downtime_s=rec.downtime_s, max_queued=rec.queued)
        found = await b.children()
        gen.children, gen.engine_pids = found, monitors.engine_pids(found)
        log.info("generation_ready", generation=gen.number, pid=b.pid, load_s=round(time.monotonic() - b.started_mono, 1),
                 vllm=self.vllm_version, children=[c.model_dump(mode="json") for c in gen.listed_children])
        if os.environ.get(FAULT_VAR) == "ready":
            raise InjectedFault(f"{FAULT_VAR}=ready: raised once generation {gen.number} was ready")
        self.last_probe = None  # a clean slate: the last probe of the old generation says nothing of this one
        self.enter(State.SERVING)
        if not self.notifier.ready_sent:
            self.notifier.ready(status_line(self))
        assert self.http is not None
        http, n = self.http, gen.number
        gen.tasks = [
            asyncio.create_task(monitors.guarded("probe", n, lambda: monitors.probe_loop(
                gen, http, self.cfg.probe, self._on_probe, self.wake))),
            asyncio.create_task(monitors.guarded("memory", n, lambda: monitors.memory_loop(
                gen, self.cfg.recycle, self.nvml, self.ledger, self.wake))),
        ]

    def _on_probe(self, summary: ProbeSummary) -> None:
        self.last_probe = summary

    def _on_version(self, version: str) -> None:
        self.vllm_version = version

    async def _step_serving(self) -> None:
        gen = self._current()
        b = gen.backend
        if b.returncode is not None:
            await self.fail(FailureKind.CRASH.value, b.returncode, f"backend exited with {b.returncode}")
        elif gen.dead_engine is not None:
            await self.fail(FailureKind.CRASH.value, None, f"engine process {gen.dead_engine} died")
        elif gen.hang is not None:
            await self.fail(FailureKind.HANG.value, None, gen.hang)
        elif self.hold is None:
            trigger = recycle_trigger(self.cfg.recycle, self._readings(gen), time.monotonic())
            if trigger is not None:
                await self.begin_recycle(trigger.reason, trigger.cls)

    def _readings(self, gen: Generation) -> Readings:
        now = time.monotonic()
        ready = gen.ready_mono if gen.ready_mono is not None else now
        t = gen.target
        return Readings(ready_at=ready, requests=t.toward_limit, limit=t.limit,
                        idle_for=min(self.proxy.idle_for(), now - ready), growth=gen.growth)

    def _on_proxy_event(self, target: Target) -> None:
        self.wake()

    # -- recycle: drain, stop, start -----------------------------------------------------------
    async def begin_recycle(self, reason: str, cls: EndClass) -> None:
        gen = self._current()
        t, q = gen.target, self.proxy.queued
        rec = RecycleRecord(reason=reason, cls=cls, started=utcnow(), in_flight=t.in_flight, queued=q,
                            generation=gen.number, started_mono=time.monotonic())
        rec.ledger_id = self.ledger.recycle_started(gen.number, reason, cls.value, rec.in_flight, q)
        self.proxy.counters.max_queued = q
        self._recycle = self.recycles.add(rec)
        self.end_reason = (reason, cls)
        self._after_stop = After.START
        log.info("recycle_begin", generation=gen.number, reason=reason, cls=cls.value, in_flight=rec.in_flight,
                 queued=q, served=t.dispatched, toward_limit=t.toward_limit, inherited=t.inherited, limit=t.limit)
        await self.begin_drain()

    async def begin_drain(self) -> None:
        gen = self._current()
        await self.proxy.stop_dispatch(gen.target)
        gen.cancel_tasks()
        self.enter(State.DRAINING, self.cfg.server.drain_timeout)

    async def _step_draining(self) -> None:
        gen = self._current()
        b, t = gen.backend, gen.target
        if self._recycle is not None:
            self._recycle.queued = max(self._recycle.queued, self.proxy.counters.max_queued)
        if b.returncode is not None or gen.dead_engine is not None:
            await self.fail(FailureKind.CRASH.value, b.returncode, "backend died while draining")
        elif t.in_flight == 0:
            if self._recycle is not None:
                self.ledger.recycle_update(self._recycle.ledger_id, drained_at=utcnow())
            await self.begin_stop(kill=False)
        elif self.machine.overdue(time.monotonic()):
            log.warning("drain_timeout", generation=gen.number, in_flight=t.in_flight)
            await self.begin_stop(kill=False)

    async def begin_stop(self, kill: bool) -> None:
        """SIGTERM (SIGKILL for a failed generation) to the whole process group."""
        gen = self._current()
        gen.cancel_tasks()
        await gen.backend.children()  # remember every pid before the tree falls apart
        gen.backend.signal_all(signal.SIGKILL if kill else signal.SIGTERM)
        self._kill_sent = kill
        self._stop_mark = time.monotonic()
        self.enter(State.STOPPING, 10.0 if kill else self.cfg.server.stop_timeout)

    async def _step_stopping(self) -> None:
        gen = self._current()
        b = gen.backend
        alive = await b.alive_pids()
        now = time.monotonic()
        if alive:
            if self.machine.overdue(now):
                if not self._kill_sent:
                    log.warning("stop_timeout_sigkill", generation=gen.number, pids=alive)
                    b.signal_all(signal.SIGKILL)
                    self._kill_sent = True
                    self.machine.deadline = now + 10.0
                else:
                    log.error("stop_incomplete", generation=gen.number, pids=alive)
                    await self._finish_stop(gen, leftover=alive)
            return
        gpu_left = await self._gpu_memory_left(b)
        if gpu_left and now - self._stop_mark < self.cfg.server.memory_release_timeout:
            return
        if gpu_left:
            log.error("gpu_memory_not_released", generation=gen.number, pids=gpu_left)
        await self._finish_stop(gen)

    async def _gpu_memory_left(self, b: Backend) -> dict[int, float]:
        nv = self.nvml
        if nv is None or not nv.available:
            return {}
        used = await asyncio.to_thread(nv.process_memory_mb)
        return {pid: mb for pid, mb in used.items() if pid in b.known_pids}

    async def _finish_stop(self, gen: Generation, leftover: list[int] | None = None) -> None:
        b, t = gen.backend, gen.target
        if b.proc is not None and b.proc.returncode is None and not leftover:
            await b.proc.wait()
        # A grandchild can die after its parent and reach us (the subreaper) only later: keep
        # reaping this generation's pids for a while so no zombie outlives it.
        self.reaper.add((p for p in b.known_pids if p != b.pid), time.monotonic())
        gen.children, gen.ended = [], True
        await t.close()
        reason, cls = self.end_reason
        self.ledger.generation_ended(gen.row, reason, cls.value, t.completed)
        if self._recycle is not None:
            self.ledger.recycle_update(self._recycle.ledger_id, stopped_at=utcnow())
        log.info("generation_stopped", generation=gen.number, reason=reason, cls=cls.value, served=t.completed,
                 exit_code=b.returncode, stop_s=round(time.monotonic() - self._stop_mark, 2))
        nxt = self._after_stop
        if nxt is After.EXIT:
            self.enter(State.EXITING)
        elif nxt is After.HOLD or self.hold:
            await self.enter_held()
        elif nxt is After.BACKOFF:
            s = self.cfg.server
            self.enter(State.BACKOFF, min(s.backoff_max, s.backoff_initial * 2 ** max(self._consecutive - 1, 0)))
        else:
            await self.start_generation()

    async def _step_backoff(self) -> None:
        if self.machine.overdue(time.monotonic()):
            await self.start_generation()

    async def enter_held(self) -> None:
        await self.proxy.set_reject(f"held: {self.hold}")
        self.enter(State.HELD)

    # -- failures ------------------------------------------------------------------------------
    async def fail(self, kind: str, exit_code: int | None, detail: str, cls: EndClass = EndClass.UNPLANNED) -> None:
        """Any unexpected end (exit 0 included) is a failure: record it, kill the group, back off."""
        gen = self._current()
        rec = FailureRecord(kind=kind, at=utcnow(), exit_code=exit_code, detail=detail, generation=gen.number,
                            cls=cls)
        rec.ledger_id = self.ledger.failure(gen.number, kind, exit_code, detail, cls.value)
        self.failures.add(rec)
        self._unrestored.append(rec)
        log.error("generation_failed", generation=gen.number, kind=kind, exit_code=exit_code, detail=detail,
                  cls=cls.value)
        await self.proxy.stop_dispatch(gen.target, dead=True)
        self._recycle = None  # a recycle that ended in a failure is over
        now = time.monotonic()
        if cls is EndClass.UNPLANNED:
            self._failure_times.append(now)
        while self._failure_times and now - self._failure_times[0] > self.cfg.server.failure_window:
            self._failure_times.popleft()
        self._consecutive += 1
        self.end_reason = (kind, cls)
        if self.commands.stop_requests:
            self._after_stop = After.EXIT
        elif self.hold:
            self._after_stop = After.HOLD
        elif len(self._failure_times) >= self.cfg.server.max_failures:
            log.error("failure_limit", failures=len(self._failure_times), window_s=self.cfg.server.failure_window)
            self.exit_code = EXIT_FAILURE_LIMIT
            self._after_stop = After.EXIT
        else:
            self._after_stop = After.BACKOFF
        await self.begin_stop(kill=True)

    def _current(self) -> Generation:
        if self.gen is None:
            raise RuntimeError(f"state {self.state.value} without a generation")
        return self.gen

    # -- systemd -------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.reaper.later:
            await asyncio.to_thread(self.reaper.poll, now)
        overrun = self.machine.overdue(now, OVERRUN_GRACE_S)
        if overrun and not self._overrun_logged:
            log.error("state_overrun", state=self.state.value, over_s=round(now - (self.machine.deadline or now), 1))
            self._overrun_logged = True
        if not overrun and self.notifier.watchdog_due(now):
            self.notifier.watchdog(now)
        if now - self._status_sent >= 2.0:
            self.send_status()

    def send_status(self) -> None:
        self._status_sent = time.monotonic()
        self.notifier.status(status_line(self))
