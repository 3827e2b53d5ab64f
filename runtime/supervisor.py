"""The supervisor: one loop that keeps the service's vLLM replicas serving.

Like gunicorn's Arbiter, signals and admin commands only enqueue; every decision happens in
`run()`, which reads like a runbook: wait, handle commands, step each replica, tell systemd we
are alive. Long actions (draining, a 60-140 s cold start, a successor starting beside the
serving generation) are states with deadlines, never blocking calls, so the WATCHDOG=1 pings
continue through a planned recycle. Each replica runs its own runbook (`replica`); what is
shared lives here: the proxy and its router, the ledger, the failure window, the hold, the
rolling rule (one replica recycles at a time, never while another is down). What it decides on
comes from elsewhere: the recycle triggers (`triggers`) and the recycle strategy (`strategy`)
are pure functions; hang, memory and process readings come from the monitors (`monitors`),
off this loop. `run()` stops every vLLM process group on every way out, an exception included.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import structlog

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.errors import EXIT_FAILURE_LIMIT, EXIT_OK
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.notify import Notifier
from vllm_guard.core.protocol import ProbeSummary, StatusSnapshot
from vllm_guard.core.timefmt import utcnow

from . import lifecycle, procs, replicas
from .commands import Commands
from .generation import Generation
from .holdfile import HoldFile
from .ledger import RuntimeLedger
from .machine import State
from .proxy import Proxy, Target
from .records import FailureRecord, Recent, RecycleRecord
from .replica import FAULT_VAR, InjectedFault, Replica
from .replicas import ReplicaPlan
from .router import AVOID_AFTER_FAILURE_S
from .status import snapshot, status_line

if TYPE_CHECKING:
    import aiohttp

    from vllm_guard.core.nvml import NvmlSession

log = structlog.get_logger("vllm_guard.supervisor")

TICK_S = 0.25
OVERRUN_GRACE_S = 60.0
SLOW_TURN_S = 5.0  # a loop turn this long is logged (supervisor_turn_slow): WATCHDOG=1 waits for it

__all__ = ["FAULT_VAR", "InjectedFault", "Supervisor", "TICK_S"]


class Supervisor:
    def __init__(self, cfg: GuardConfig, model: str, python: str = sys.executable,
                 ledger: RuntimeLedger | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.python = python
        self.state_dir = Path(cfg.server.state_dir)
        self.ledger = ledger if ledger is not None else RuntimeLedger(self.state_dir)
        self.last_number = self.ledger.first_generation - 1  # numbers continue across runtimes
        self.proxy = Proxy(cfg.server, on_limit=self._on_limit, on_error=self._on_error)
        self.notifier = Notifier()
        self.holdfile = HoldFile(self.state_dir)
        self.hold: str | None = self.holdfile.read()
        self.proxy.router.enforce_limit = self.hold is None
        self.nvml: NvmlSession | None = None
        self.commands = Commands(self)
        self._wakeup = asyncio.Event()
        self.failures: Recent[FailureRecord] = Recent()
        self.recycles: Recent[RecycleRecord] = Recent()
        self._failure_times: collections.deque[float] = collections.deque()
        self._unrestored: list[FailureRecord] = []
        self.exit_code = EXIT_OK
        self.stopping = False  # a stop was asked for (signal, failure limit): nothing new starts
        self.vllm_version = ""
        self.gpu_name = ""
        self.gate_unavailable: str | None = None  # learned from a gated start: this vLLM cannot park
        self.last_probe: ProbeSummary | None = None
        self.reaper = procs.Reaper()
        self.http: aiohttp.ClientSession | None = None
        self.admin: Any = None  # the admin socket's runner
        self.tasks: list[asyncio.Task[Any]] = []  # the runtime's own (the status monitor)
        # one replica until open_runtime has NVML and plans the GPUs (`plan_replicas`)
        self.replicas: list[Replica] = [Replica(self, ReplicaPlan(0))]
        self._agg: tuple[State, float] = (State.STARTING, time.monotonic())
        self._status_sent = 0.0

    # -- what status and the commands see ----------------------------------------------------
    @property
    def gen(self) -> Generation | None:
        """The first replica's current generation (the only one with one replica)."""
        return self.replicas[0].gen

    @property
    def state(self) -> State:
        return replicas.aggregate([r.state for r in self.replicas])

    @property
    def state_for_s(self) -> float:
        return max(0.0, time.monotonic() - self._agg[1])

    @property
    def generation(self) -> int:
        """The newest generation that serves or is starting as a replica's own (not a successor)."""
        return max((r.gen.number for r in self.replicas if r.gen is not None), default=self.last_number)

    @property
    def recycle_in_progress(self) -> RecycleRecord | None:
        return next((r.recycle for r in self.replicas if r.recycle is not None), None)

    def status(self) -> StatusSnapshot:
        return snapshot(self)

    def next_number(self) -> int:
        self.last_number += 1
        return self.last_number

    def live_generations(self) -> list[Generation]:
        return [g for r in self.replicas for g in r.generations()]

    def replica_gpus(self, rep: Replica) -> list[str]:
        static = self.nvml.static if self.nvml is not None and self.nvml.available else []
        return replicas.replica_uuids(static, rep.plan, {**os.environ, **rep.plan.env()})

    # -- the runbook ---------------------------------------------------------------------------
    async def run(self, admin_start: Callable[[Supervisor], Awaitable[Any]] | None = None) -> int:
        try:
            await lifecycle.open_runtime(self, admin_start)
            while not self._done():
                t0 = time.monotonic()
                await self._sleep()
                t1 = time.monotonic()
                await self.commands.handle()
                t2 = time.monotonic()
                for rep in self.replicas:
                    await rep.step()
                t3 = time.monotonic()
                await self._heartbeat()
                self._note_slow_turn(t0, t1, t2, t3, time.monotonic())
        finally:
            await lifecycle.close_runtime(self)
        log.info("runtime_exited", exit_code=self.exit_code)
        return self.exit_code

    def _note_slow_turn(self, *marks: float) -> None:
        parts = slow_turn(*marks)
        if parts is not None:
            log.warning("supervisor_turn_slow", **parts, states=[r.state.value for r in self.replicas])

    def _done(self) -> bool:
        return all(r.state is State.EXITING and not r.retiring for r in self.replicas)

    async def _sleep(self) -> None:
        try:
            await asyncio.wait_for(self._wakeup.wait(), TICK_S)
        except asyncio.TimeoutError:
            pass
        self._wakeup.clear()

    def wake(self) -> None:
        self._wakeup.set()

    def state_changed(self) -> None:
        st = self.state
        if st is not self._agg[0]:
            self._agg = (st, time.monotonic())
        self.send_status()

    async def start_all(self) -> None:
        for rep in self.replicas:
            if self.hold:
                rep.enter(State.HELD)
            else:
                await rep.start()
        await self.held_changed()

    # -- callbacks from the proxy and the monitors ---------------------------------------------
    def _on_limit(self, target: Target) -> None:
        self.wake()

    def _on_error(self, target: Target) -> None:
        self.proxy.router.failed(target)  # the retry goes to another replica for a moment
        self.wake()

    def on_probe(self, summary: ProbeSummary) -> None:
        self.last_probe = summary

    def on_version(self, version: str) -> None:
        self.vllm_version = version

    def ready(self) -> None:
        if not self.notifier.ready_sent:
            self.notifier.ready(status_line(self))

    def prune_logs(self) -> None:
        lifecycle.prune_logs(self.state_dir / "logs")

    async def gpu_memory_of(self, pids: Iterable[int]) -> dict[int, float]:
        """GPU memory (MiB) NVML still shows for these pids; {} without NVML."""
        nv = self.nvml
        if nv is None or not nv.available:
            return {}
        wanted = set(pids)
        used = await asyncio.to_thread(nv.process_memory_mb)
        return {pid: mb for pid, mb in used.items() if pid in wanted}

    # -- the rolling rule ----------------------------------------------------------------------
    def why_wait(self, rep: Replica) -> str | None:
        """None when `rep` may begin a planned recycle now (`replicas.may_recycle`)."""
        if self.stopping:
            return "the runtime is shutting down"
        return replicas.may_recycle(rep.index, [r.state for r in self.replicas],
                                    [r.busy_recycling for r in self.replicas])

    # -- failures ------------------------------------------------------------------------------
    def record_failure(self, gen: Generation, kind: str, exit_code: int | None, detail: str,
                       cls: EndClass = EndClass.UNPLANNED) -> FailureRecord:
        rec = FailureRecord(kind=kind, at=utcnow(), exit_code=exit_code, detail=detail, generation=gen.number,
                            cls=cls)
        rec.ledger_id = self.ledger.failure(gen.number, kind, exit_code, detail, cls.value)
        self.failures.add(rec)
        self._unrestored.append(rec)
        log.error("generation_failed", generation=gen.number, replica=gen.replica, kind=kind, exit_code=exit_code,
                  detail=detail, cls=cls.value)
        if cls is EndClass.UNPLANNED:
            self._failure_times.append(time.monotonic())
        return rec

    def failure_restored(self) -> None:
        """A generation became ready: every failure so far is restored."""
        for f in self._unrestored:
            f.restored_at = utcnow()
            self.ledger.failure_restored(f.ledger_id)
        self._unrestored.clear()

    def failure_limit_reached(self) -> bool:
        now = time.monotonic()
        while self._failure_times and now - self._failure_times[0] > self.cfg.server.failure_window:
            self._failure_times.popleft()
        return len(self._failure_times) >= self.cfg.server.max_failures

    async def give_up(self, failing: Replica | None) -> None:
        """Too many failures in the window: stop every replica and exit 3 (systemd's StartLimit
        takes over)."""
        if self.exit_code != EXIT_FAILURE_LIMIT:
            log.error("failure_limit", failures=len(self._failure_times), window_s=self.cfg.server.failure_window)
        self.exit_code = EXIT_FAILURE_LIMIT
        await self.shutdown(skip=failing)

    async def shutdown(self, skip: Replica | None = None, second: bool = False) -> None:
        """Drain and stop every replica (a second time: shorten the ladder), then exit."""
        self.stopping = True
        await self.proxy.set_reject("vllm-guard is shutting down")
        for rep in self.replicas:
            if rep is not skip:
                await rep.stop(second)

    def exit_all(self) -> None:
        """The backend cannot even be launched: exit at once (nothing runs)."""
        self.stopping = True
        for rep in self.replicas:
            if rep.state is not State.EXITING and rep.machine.can(State.EXITING):
                rep.enter(State.EXITING)

    async def held_changed(self) -> None:
        """Held with no replica left serving: requests fail fast instead of queueing."""
        if self.hold and all(r.state in (State.HELD, State.EXITING) for r in self.replicas):
            await self.proxy.set_reject(f"held: {self.hold}")

    # -- systemd -------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.reaper.later:
            await asyncio.to_thread(self.reaper.poll, now)
        overrun = False
        for rep in self.replicas:
            late = rep.machine.overdue(now, OVERRUN_GRACE_S)
            if late and not rep.overrun_logged:
                log.error("state_overrun", replica=rep.index, state=rep.state.value,
                          over_s=round(now - (rep.machine.deadline or now), 1))
                rep.overrun_logged = True
            overrun = overrun or late
        if not overrun and self.notifier.watchdog_due(now):
            self.notifier.watchdog(now)
        if now - self._status_sent >= 2.0:
            self.send_status()

    def send_status(self) -> None:
        self._status_sent = time.monotonic()
        self.notifier.status(status_line(self))


def slow_turn(t0: float, t1: float, t2: float, t3: float, t4: float) -> dict[str, float] | None:
    """Where a loop turn (sleep, commands, replicas, heartbeat: t0..t4) long enough to delay
    WATCHDOG=1 went; None for a normal turn. A long `sleep_s` is the event loop itself blocked
    or starved of CPU; the others are the turn's own awaits."""
    if t4 - t0 < SLOW_TURN_S:
        return None
    return {"seconds": round(t4 - t0, 2), "sleep_s": round(t1 - t0, 2), "commands_s": round(t2 - t1, 2),
            "replicas_s": round(t3 - t2, 2), "heartbeat_s": round(t4 - t3, 2)}


# the router's grace after a failed request, re-exported for the docs and tests
FAILED_TARGET_AVOIDED_S = AVOID_AFTER_FAILURE_S
