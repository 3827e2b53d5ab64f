"""Admin commands and stop signals, decided in the supervisor's loop.

Signals and the admin socket only enqueue; the loop takes each command in turn, decides in the
state it is in, and answers: accepted (what happens next) or refused (why not: held, still
starting, a recycle already under way...). A refused command changes nothing, and the caller
learns it (`CommandReply.accepted` false, HTTP 409), instead of a silent no-op.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.protocol import Command, CommandReply, CommandRequest

from .machine import State

if TYPE_CHECKING:
    from .replica import Replica
    from .supervisor import Supervisor

log = structlog.get_logger("vllm_guard.supervisor")


@dataclass(frozen=True)
class Stop:
    """SIGTERM or SIGINT: drain, stop, exit (a second one shortens the ladder)."""

    signal: str


Pending = tuple["CommandRequest | Stop", "asyncio.Future[CommandReply] | None"]


class Commands:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.stop_requests = 0
        self._handlers: dict[Command, Callable[[CommandRequest], Awaitable[CommandReply]]] = {
            Command.RECYCLE: self.recycle,
            Command.RESTART: self.restart,
            Command.HOLD: self.hold,
            Command.RELEASE: self.release,
        }

    def put(self, item: CommandRequest | Stop) -> None:
        """From a signal handler: queue without waiting for an answer."""
        self.queue.put_nowait((item, None))
        self.sup.wake()

    async def submit(self, request: CommandRequest, timeout: float = 10.0) -> CommandReply:
        """Queue an admin command and wait for the loop's answer."""
        fut: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((request, fut))
        self.sup.wake()
        return await asyncio.wait_for(fut, timeout)

    async def handle(self) -> None:
        while not self.queue.empty():
            item, fut = self.queue.get_nowait()
            if isinstance(item, Stop):
                log.info("command", command="stop", signal=item.signal)
                await self.stop()
                continue
            log.info("command", command=item.command.value, reason=item.reason,
                     cls=item.cls.value if item.cls else None)
            reply = await self._handlers[item.command](item)
            if not reply.accepted:
                log.warning("command_refused", command=item.command.value, detail=reply.detail)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _reply(self, req: CommandRequest, accepted: bool, detail: str) -> CommandReply:
        return CommandReply(command=req.command, accepted=accepted, detail=detail, state=self.sup.state,
                            generation=self.sup.generation)

    def _why_not(self, rep: Replica | None = None) -> str:
        sup = self.sup
        if self.stop_requests:
            return "the runtime is shutting down"
        state = rep.state if rep is not None else sup.state
        where = f"replica {rep.index}: " if rep is not None and len(sup.replicas) > 1 else ""
        gen = rep.gen.number if rep is not None and rep.gen is not None else sup.generation
        return where + {
            State.STARTING: f"generation {gen} is still starting",
            State.DRAINING: "a recycle or stop is already in progress",
            State.STOPPING: "a recycle or stop is already in progress",
            State.BACKOFF: "no generation is running (backing off after a failure)",
            State.HELD: f"held ({sup.hold}): nothing runs until release",
        }.get(state, f"state {state.value}")

    def _chosen(self, req: CommandRequest) -> list[Replica] | str:
        """The replicas a command is for, or why there is no such replica."""
        reps = self.sup.replicas
        if req.replica is None:
            return list(reps)
        if req.replica >= len(reps):
            return f"no replica {req.replica} (this runtime has {len(reps)}: 0..{len(reps) - 1})"
        return [reps[req.replica]]

    async def stop(self) -> None:
        sup = self.sup
        self.stop_requests += 1
        if self.stop_requests == 1:
            sup.notifier.stopping()
        await sup.shutdown(second=self.stop_requests > 1)

    async def recycle(self, req: CommandRequest) -> CommandReply:
        """Drain-and-replace, rolling: each replica in turn (the strategy is chosen as each begins)."""
        sup = self.sup
        if sup.hold:
            return self._reply(req, False, f"held ({sup.hold}): planned recycles wait for release")
        chosen = self._chosen(req)
        if isinstance(chosen, str):
            return self._reply(req, False, chosen)
        for rep in chosen:
            if rep.state is not State.SERVING or self.stop_requests:
                return self._reply(req, False, self._why_not(rep))
            if rep.busy_recycling or rep.pending is not None:
                return self._reply(req, False, self._why_not_busy(rep))
        cls = req.ledger_class() or EndClass.SCHEDULED
        done = []
        for rep in chosen:
            began = await rep.try_recycle(req.reason, cls)
            done.append(self._began(rep) if began else f"replica {rep.index}: waits for its turn ({rep.deferred})")
        return self._reply(req, True, "; ".join(done))

    def _why_not_busy(self, rep: Replica) -> str:
        where = f"replica {rep.index}: " if len(self.sup.replicas) > 1 else ""
        return where + "a recycle or stop is already in progress"

    def _began(self, rep: Replica) -> str:
        rec, gen = rep.recycle, rep.gen
        n = gen.number if gen is not None else self.sup.generation
        where = f"replica {rep.index}: " if len(self.sup.replicas) > 1 else ""
        if rec is not None and rec.strategy in ("overlap", "gated") and rep.next is not None:
            how = "up to its startup gate " if rec.strategy == "gated" else ""
            return f"{where}starting generation {rep.next.number} {how}beside generation {n} ({rec.strategy})"
        return f"{where}draining generation {n}"

    async def restart(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        chosen = self._chosen(req)
        if isinstance(chosen, str):
            return self._reply(req, False, chosen)
        ok = (State.SERVING, State.STARTING, State.DRAINING)
        targets = [r for r in chosen if r.gen is not None and r.state in ok]
        if self.stop_requests or not targets:
            return self._reply(req, False, self._why_not(chosen[0]))
        killed = []
        for rep in targets:
            gen = rep.gen
            assert gen is not None
            await rep.fail(FailureKind.RESTART.value, gen.backend.returncode, req.reason,
                           req.ledger_class() or EndClass.UNPLANNED)
            killed.append(str(gen.number))
        word = "generation" if len(killed) == 1 else "generations"
        return self._reply(req, True, f"killing {word} {', '.join(killed)}; requests not yet answered go to the next")

    async def hold(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        sup.hold = req.reason
        sup.proxy.router.enforce_limit = False  # no recycle can follow: never stop dispatching at the limit
        detail = "held: no generation will be started until release"
        try:
            await asyncio.to_thread(sup.holdfile.write, req.reason)
        except OSError as e:
            log.error("hold_not_persisted", error=str(e), path=str(sup.holdfile.path))
            detail += f" (not persisted, a restarted runtime will not hold: {e.strerror or e})"
        for rep in sup.replicas:
            await rep.on_hold()
        await sup.held_changed()
        return self._reply(req, True, detail)

    async def release(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        if sup.hold is None:
            return self._reply(req, False, "not held")
        sup.hold = None
        sup.proxy.router.enforce_limit = True
        try:
            await asyncio.to_thread(sup.holdfile.clear)
        except OSError as e:
            log.error("hold_file_not_removed", error=str(e), path=str(sup.holdfile.path))
        held = [r for r in sup.replicas if r.state is State.HELD]
        if held and not self.stop_requests:
            await sup.proxy.set_reject(None)
            for rep in held:
                await rep.start()
            return self._reply(req, True, f"released: starting generation {sup.generation}")
        return self._reply(req, True, "released")


__all__ = ["Commands", "Pending", "Stop"]
