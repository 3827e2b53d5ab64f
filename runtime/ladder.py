"""One generation's way out, the same for every path: drain, SIGTERM, deadline, SIGKILL, reap,
and wait until NVML shows its GPU memory released.

Used for the replica's own generation (its DRAINING and STOPPING states mirror the ladder) and
for a generation that an overlap recycle replaced, which drains and stops in the background
while its successor serves. Each `step()` is one look, never a wait: deadlines are monotonic
times checked on the supervisor's tick.
"""

from __future__ import annotations

import asyncio
import enum
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.timefmt import utcnow

from .generation import Generation

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = structlog.get_logger("vllm_guard.supervisor")

KILL_WAIT_S = 10.0


class Phase(str, enum.Enum):
    DRAINING = "draining"  # no new requests; in-flight ones finish (drain timeout)
    STOPPING = "stopping"  # signalled; waiting for the processes and their GPU memory to go
    DONE = "done"  # gone and recorded in the ledger


@dataclass(eq=False)
class Ladder:
    gen: Generation
    reason: str  # recorded as the generation's end reason
    cls: EndClass
    recycle_row: int | None = None  # the recycle whose drained_at/stopped_at it stamps
    phase: Phase = Phase.DRAINING
    deadline: float = 0.0
    kill_sent: bool = False
    stop_mark: float = 0.0  # when the signal went out
    died: bool = False  # the backend died while draining (a crash, not our signal)
    leftover: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    async def begin_drain(self, sup: Supervisor) -> None:
        """No new requests to it; in-flight ones have `drain_timeout` to finish."""
        await sup.proxy.stop_dispatch(self.gen.target)
        self.gen.cancel_tasks()
        self.phase, self.deadline = Phase.DRAINING, time.monotonic() + sup.cfg.server.drain_timeout

    async def begin_stop(self, sup: Supervisor, kill: bool) -> None:
        """SIGTERM (SIGKILL for a failed generation) to the whole process group."""
        gen = self.gen
        await sup.proxy.stop_dispatch(gen.target, dead=kill)
        gen.cancel_tasks()
        await gen.backend.children()  # remember every pid before the tree falls apart
        gen.backend.signal_all(signal.SIGKILL if kill else signal.SIGTERM)
        self.kill_sent = kill
        self.stop_mark = time.monotonic()
        self.phase = Phase.STOPPING
        self.deadline = self.stop_mark + (KILL_WAIT_S if kill else sup.cfg.server.stop_timeout)

    async def step(self, sup: Supervisor) -> None:
        if self.phase is Phase.DRAINING:
            await self._step_draining(sup)
        elif self.phase is Phase.STOPPING:
            await self._step_stopping(sup)

    async def _step_draining(self, sup: Supervisor) -> None:
        gen = self.gen
        b, t = gen.backend, gen.target
        if b.returncode is not None or gen.dead_engine is not None:
            self.died = True
            await self.begin_stop(sup, kill=True)
        elif t.in_flight == 0:
            if self.recycle_row is not None:
                sup.ledger.recycle_update(self.recycle_row, drained_at=utcnow())
            await self.begin_stop(sup, kill=False)
        elif time.monotonic() > self.deadline:
            log.warning("drain_timeout", generation=gen.number, replica=gen.replica, in_flight=t.in_flight)
            await self.begin_stop(sup, kill=False)

    async def _step_stopping(self, sup: Supervisor) -> None:
        gen = self.gen
        b = gen.backend
        alive = await b.alive_pids()
        now = time.monotonic()
        if alive:
            if now > self.deadline:
                if not self.kill_sent:
                    log.warning("stop_timeout_sigkill", generation=gen.number, replica=gen.replica, pids=alive)
                    b.signal_all(signal.SIGKILL)
                    self.kill_sent = True
                    self.deadline = now + KILL_WAIT_S
                else:
                    log.error("stop_incomplete", generation=gen.number, replica=gen.replica, pids=alive)
                    await self._finish(sup, leftover=alive)
            return
        gpu_left = await sup.gpu_memory_of(b.known_pids)
        if gpu_left and now - self.stop_mark < sup.cfg.server.memory_release_timeout:
            return
        if gpu_left:
            log.error("gpu_memory_not_released", generation=gen.number, replica=gen.replica, pids=gpu_left)
        await self._finish(sup)

    async def _finish(self, sup: Supervisor, leftover: list[int] | None = None) -> None:
        gen = self.gen
        b, t = gen.backend, gen.target
        if b.proc is not None and b.proc.returncode is None and not leftover:
            await b.proc.wait()
        # A grandchild can die after its parent and reach us (the subreaper) only later: keep
        # reaping this generation's pids for a while so no zombie outlives it.
        sup.reaper.add((p for p in b.known_pids if p != b.pid), time.monotonic())
        gen.children, gen.ended = [], True
        await t.close()
        sup.ledger.generation_ended(gen.row, self.reason, self.cls.value, t.completed)
        if self.recycle_row is not None:
            sup.ledger.recycle_update(self.recycle_row, stopped_at=utcnow())
        self.leftover = leftover or []
        self.phase = Phase.DONE
        log.info("generation_stopped", generation=gen.number, replica=gen.replica, reason=self.reason,
                 cls=self.cls.value, served=t.completed, exit_code=b.returncode,
                 stop_s=round(time.monotonic() - self.stop_mark, 2))


async def wait_gone(ladder: Ladder, sup: Supervisor, tick: float = 0.05) -> None:
    """Run a ladder to its end (the runtime's way out; not used on the supervisor's tick)."""
    while not ladder.done:
        await ladder.step(sup)
        await asyncio.sleep(tick)
