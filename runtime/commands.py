"""Admin commands and stop signals, taken in the supervisor's loop.

Signals and the admin socket only enqueue; the loop takes each command in turn and hands it to
the replicas it is for. Whether it applies is each replica's `decide`: accepted (what happens
next) or refused (why not: held, still starting, a recycle already under way...). A refused
command changes nothing, and the caller learns it (`CommandReply.accepted` false, HTTP 409),
instead of a silent no-op. A command for several replicas is first tried on each replica's view
without acting (`decide` is pure), so it is accepted or refused whole.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Literal, Protocol, Sequence

import structlog

from vllm_guard.core import holder
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import Command, CommandReply, CommandRequest, RuntimeState

from .reload import ReloadPlan
from .replica.decide import decide
from .replica.driver import ReplicaDriver
from .child import handover
from .replica.view import Event, Facts, RecycleCmd, RestartCmd

log = structlog.get_logger("vllm_guard.supervisor")


@dataclass(frozen=True)
class Stop:
    """SIGTERM or SIGINT: drain, stop, exit (a second one shortens the ladder)."""

    signal: str


Pending = tuple["CommandRequest | Stop", "asyncio.Future[CommandReply] | None"]


class Runtime(Protocol):
    """What commands need of the supervisor."""

    drivers: list[ReplicaDriver]
    hold: str | None

    @property
    def state(self) -> RuntimeState: ...

    @property
    def generation(self) -> int: ...

    def facts(self, d: ReplicaDriver) -> Facts: ...

    def wake(self) -> None: ...

    def begin_stop(self, second: bool, hand_over: bool = False) -> None: ...

    def can_hand_over(self) -> bool: ...

    def drop_holder(self, replica: int | None, reason: str) -> None: ...

    async def set_hold(self, reason: str) -> str: ...

    async def release(self) -> str | None: ...

    async def plan_reload(self) -> ReloadPlan: ...

    def apply_config(self, plan: ReloadPlan) -> None: ...

    def note_reload(self, reason: str, outcome: Literal["applied", "unchanged", "refused"], detail: str) -> None: ...


RELOAD_REASON = "reload"  # the recycle a reload runs is recorded with this reason


class Commands:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.stop_requests = 0
        self._handlers: dict[Command, Callable[[CommandRequest], Awaitable[CommandReply]]] = {
            Command.RECYCLE: self.recycle,
            Command.RESTART: self.restart,
            Command.HOLD: self.hold,
            Command.RELEASE: self.release,
            Command.RELOAD: self.reload,
            Command.UPGRADE: self.upgrade,
        }

    def put(self, item: CommandRequest | Stop) -> None:
        """From a signal handler: queue without waiting for an answer."""
        self.queue.put_nowait((item, None))
        self.rt.wake()

    async def submit(self, request: CommandRequest, timeout: float = 10.0) -> CommandReply:
        """Queue an admin command and wait for the loop's answer."""
        fut: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((request, fut))
        self.rt.wake()
        return await asyncio.wait_for(fut, timeout)

    async def handle(self) -> None:
        while not self.queue.empty():
            item, fut = self.queue.get_nowait()
            if isinstance(item, Stop):
                log.info("command", command="stop", signal=item.signal)
                self.stop_requests += 1
                second = self.stop_requests > 1
                # systemd stopping a socket-activated unit to restart it: an upgrade, hand over
                hand = not second and self.rt.can_hand_over() and await asyncio.to_thread(handover.systemd_restarting)
                self.rt.begin_stop(second=second, hand_over=hand)
                continue
            log.info("command", command=item.command.value, reason=item.reason,
                     cls=item.cls.value if item.cls else None, replica=item.replica,
                     strategy=item.strategy.value if item.strategy else None)
            reply = await self._handlers[item.command](item)
            if not reply.accepted:
                log.warning("command_refused", command=item.command.value, detail=reply.detail)
            else:
                why = holder.drop_reason(command=item.command.value, reason=item.reason,
                                         strategy=item.strategy.value if item.strategy else None)
                if why is not None:
                    self.rt.drop_holder(item.replica, why)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _reply(self, req: CommandRequest, accepted: bool, detail: str, config_error: bool = False) -> CommandReply:
        return CommandReply(command=req.command, accepted=accepted, detail=detail, state=self.rt.state,
                            generation=self.rt.generation, config_error=config_error)

    def _chosen(self, req: CommandRequest) -> list[ReplicaDriver] | str:
        """The replicas a command is for, or why there is no such replica."""
        ds = self.rt.drivers
        if req.replica is None:
            return list(ds)
        if req.replica >= len(ds):
            return f"no replica {req.replica} (this runtime has {len(ds)}: 0..{len(ds) - 1})"
        return [ds[req.replica]]

    def _dry(self, d: ReplicaDriver, event: Event) -> tuple[bool, str]:
        """Would `d` accept `event` now? (decide is pure: nothing happens)"""
        import time

        reply = decide(d.view(self.rt.facts(d)), event, time.monotonic()).reply
        return (reply.accepted, reply.detail) if reply is not None else (False, "no answer")

    async def _each(self, chosen: Sequence[ReplicaDriver], event: Event) -> list[str]:
        out = []
        for d in chosen:
            decision = await d.handle(event, lambda d=d: self.rt.facts(d))  # type: ignore[misc]
            if decision.reply is not None:
                out.append(decision.reply.detail)
        return out

    async def recycle(self, req: CommandRequest) -> CommandReply:
        """Drain-and-replace, rolling: each replica in turn (the strategy is chosen as each begins,
        unless the command names one)."""
        chosen = self._chosen(req)
        if isinstance(chosen, str):
            return self._reply(req, False, chosen)
        event = RecycleCmd(req.reason, req.ledger_class() or EndClass.SCHEDULED,
                           req.strategy.value if req.strategy else None)
        for d in chosen:
            ok, why = self._dry(d, event)
            if not ok:
                return self._reply(req, False, why)
        return self._reply(req, True, "; ".join(await self._each(chosen, event)))

    async def restart(self, req: CommandRequest) -> CommandReply:
        chosen = self._chosen(req)
        if isinstance(chosen, str):
            return self._reply(req, False, chosen)
        event = RestartCmd(req.reason, req.ledger_class() or EndClass.UNPLANNED)
        dry = [(d, *self._dry(d, event)) for d in chosen]
        targets = [d for d, ok, _ in dry if ok]
        if not targets:
            return self._reply(req, False, dry[0][2])
        return self._reply(req, True, "; ".join(await self._each(targets, event)))

    async def reload(self, req: CommandRequest) -> CommandReply:
        """Re-read the configuration as `serve` composed it; apply it through a recycle of every
        replica (rolling), or refuse it whole: a bad file or a restart-only key (`config_error`),
        or a replica that cannot take a recycle now (held, starting, a recycle under way)."""
        plan = await self.rt.plan_reload()
        if plan.verdict == "refused":
            log.warning("reload_refused", reason=req.reason, detail=plan.detail, config=plan.config_hash)
            self.rt.note_reload(req.reason, "refused", plan.detail)
            return self._reply(req, False, plan.detail, config_error=True)
        if plan.verdict == "unchanged":
            log.info("reload_unchanged", reason=req.reason, detail=plan.detail)
            self.rt.note_reload(req.reason, "unchanged", plan.detail)
            return self._reply(req, True, plan.detail)
        event = RecycleCmd(RELOAD_REASON, req.ledger_class() or EndClass.SCHEDULED, None)
        for d in self.rt.drivers:
            ok, why = self._dry(d, event)
            if not ok:
                detail = f"not applied: {why}; reload again once it is over"
                log.warning("reload_refused", reason=req.reason, detail=detail, config=plan.config_hash)
                self.rt.note_reload(req.reason, "refused", detail)
                return self._reply(req, False, detail)
        self.rt.apply_config(plan)
        for d in self.rt.drivers:  # a standby parked with the old configuration is replaced first
            await d.tick(lambda d=d: self.rt.facts(d))  # type: ignore[misc]
        self.rt.note_reload(req.reason, "applied", plan.detail)
        recycled = await self._each(self.rt.drivers, event)
        return self._reply(req, True, "; ".join([plan.detail, *recycled]))

    async def upgrade(self, req: CommandRequest) -> CommandReply:
        """Hand over to the next runtime (`runtime/handover.py`): stop taking connections, let
        the requests in flight finish, exit leaving the serving generations for the next
        `vllm-guard serve` on the same socket (systemd starts it on the next connection)."""
        if not self.rt.can_hand_over():
            return self._reply(req, False, "this runtime did not get its listening socket from systemd "
                               "(vllm-guard.socket): its port would close with it; use systemctl restart")
        if self.stop_requests:
            return self._reply(req, False, "the runtime is already stopping")
        self.stop_requests += 1
        self.rt.begin_stop(second=False, hand_over=True)
        return self._reply(req, True, "handing over: new connections wait for the next runtime; this one exits "
                           "once its requests in flight are done, leaving vLLM running")

    async def hold(self, req: CommandRequest) -> CommandReply:
        return self._reply(req, True, await self.rt.set_hold(req.reason))

    async def release(self, req: CommandRequest) -> CommandReply:
        detail = await self.rt.release()
        if detail is None:
            return self._reply(req, False, "not held")
        return self._reply(req, True, detail)


__all__ = ["Commands", "Pending", "Runtime", "Stop"]
