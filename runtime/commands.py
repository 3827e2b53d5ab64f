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

    def _why_not(self) -> str:
        sup = self.sup
        if self.stop_requests:
            return "the runtime is shutting down"
        return {
            State.STARTING: f"generation {sup.generation} is still starting",
            State.DRAINING: "a recycle or stop is already in progress",
            State.STOPPING: "a recycle or stop is already in progress",
            State.BACKOFF: "no generation is running (backing off after a failure)",
            State.HELD: f"held ({sup.hold}): nothing runs until release",
        }.get(sup.state, f"state {sup.state.value}")

    async def stop(self) -> None:
        sup = self.sup
        self.stop_requests += 1
        if self.stop_requests == 1:
            sup.notifier.stopping()
            await sup.proxy.set_reject("vllm-guard is shutting down")
        sup.after_stop_exit()
        if sup.state in (State.BACKOFF, State.HELD):
            sup.enter(State.EXITING)
        elif sup.state in (State.SERVING, State.STARTING) and sup.gen is not None:
            sup.end_reason = ("shutdown", EndClass.SCHEDULED)
            if sup.state is State.SERVING:
                await sup.begin_drain()
            else:
                await sup.begin_stop(kill=False)
        elif self.stop_requests > 1:  # a second signal shortens the ladder
            if sup.state is State.DRAINING:
                await sup.begin_stop(kill=False)
            elif sup.state is State.STOPPING:
                await sup.begin_stop(kill=True)

    async def recycle(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        if sup.hold:
            return self._reply(req, False, f"held ({sup.hold}): planned recycles wait for release")
        if sup.state is not State.SERVING or self.stop_requests:
            return self._reply(req, False, self._why_not())
        await sup.begin_recycle(req.reason, req.ledger_class() or EndClass.SCHEDULED)
        return self._reply(req, True, f"draining generation {sup.generation}")

    async def restart(self, req: CommandRequest) -> CommandReply:
        sup, gen = self.sup, self.sup.gen
        if gen is None or self.stop_requests or sup.state not in (State.SERVING, State.STARTING, State.DRAINING):
            return self._reply(req, False, self._why_not())
        await sup.fail(FailureKind.RESTART.value, gen.backend.returncode, req.reason,
                       req.ledger_class() or EndClass.UNPLANNED)
        return self._reply(req, True, f"killing generation {gen.number}; requests not yet answered go to the next")

    async def hold(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        sup.hold = req.reason
        sup.proxy.enforce_limit = False  # no recycle can follow: never stop dispatching at the limit
        detail = "held: no generation will be started until release"
        try:
            await asyncio.to_thread(sup.holdfile.write, req.reason)
        except OSError as e:
            log.error("hold_not_persisted", error=str(e), path=str(sup.holdfile.path))
            detail += f" (not persisted, a restarted runtime will not hold: {e.strerror or e})"
        if sup.state is State.BACKOFF:
            await sup.enter_held()
        return self._reply(req, True, detail)

    async def release(self, req: CommandRequest) -> CommandReply:
        sup = self.sup
        if sup.hold is None:
            return self._reply(req, False, "not held")
        sup.hold = None
        sup.proxy.enforce_limit = True
        try:
            await asyncio.to_thread(sup.holdfile.clear)
        except OSError as e:
            log.error("hold_file_not_removed", error=str(e), path=str(sup.holdfile.path))
        if sup.state is State.HELD and not self.stop_requests:
            await sup.proxy.set_reject(None)
            await sup.start_generation()
            return self._reply(req, True, f"released: starting generation {sup.generation}")
        return self._reply(req, True, "released")


__all__ = ["Commands", "Pending", "Stop"]
