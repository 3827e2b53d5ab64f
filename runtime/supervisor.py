"""The supervisor: one loop that keeps the service's vLLM replicas serving.

Like gunicorn's Arbiter, signals and admin commands only enqueue; every decision happens in
`run()`, which reads like a runbook: wait, handle commands, let each replica look, tell systemd
we are alive. Each replica is one state machine (`replica.machine`) whose transitions one pure
function decides (`replica.decide`) and a thin driver carries out (`replica.driver`); long
actions (draining, a 60-140 s cold start, a successor starting beside the serving generation)
are states with deadlines, never blocking calls, so the WATCHDOG=1 pings continue through a
planned recycle. What is shared lives here, behind small methods the drivers reach through
`replica.ports.Hub`: the proxy, the books (ledger, failure window), the hold's reason, every
replica's machine (each `decide` applies the rolling rule and the hold's to its peers), what the
runtime learned (a vLLM that cannot park, how long starts take). The supervisor decides nothing a
replica does, the proxy's side of a hold or a stop included: those are effects of `decide`.
`run()` stops every vLLM process group on every way out, an exception included.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal

import structlog

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.errors import EXIT_FAILURE_LIMIT, EXIT_OK, EXIT_START_FAILURE
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.notify import Notifier
from vllm_guard.core.protocol import (
    CommandReply, CommandRequest, ConfigStatus, ProbeSummary, ReloadStatus, RuntimeState, StatusSnapshot,
)
from vllm_guard.core.timefmt import utcnow

from . import lifecycle
from . import reload as reloads
from .child import backend as backends
from .child import handover, procs
from .child.keeper import start_ticks
from .commands import Commands
from .loopwatch import LoopWatch
from .frontdoor.proxy import Proxy
from .frontdoor.target import Target
from .records.books import RuntimeBooks
from .records.holdfile import HoldFile
from .records.writer import RuntimeLedger
from .replica import plan as replicas
from .replica.driver import FAULT_VAR, InjectedFault, ReplicaDriver
from .replica.generation import Generation
from .replica.launch import Launcher
from .replica.machine import aggregate, final
from .replica.monitors import MonitorKit, guarded, status_loop
from .replica.strategy import StartHistory
from .replica.view import Facts, HoldCmd, RecycleCmd, ReleaseCmd, StopCmd
from .servers import metrics
from .status.snapshot import StatusInputs, snapshot, status_line, visible_gpu_name

log = structlog.get_logger("vllm_guard.supervisor")

TICK_S = 0.25
OVERRUN_GRACE_S = 60.0
EXTEND_S = 60.0
SLOW_TURN_S = 5.0  # a loop turn this long is logged (supervisor_turn_slow)
# A turn still not done after this long is wedged (every effect it awaits has a shorter bound of
# its own): the pulse stops, and systemd's watchdog and the liveness probe see it.
WEDGED_TURN_S = 30.0
PULSE_S = 0.5

AdminStart = Callable[[Path, Any, Callable[[], StatusSnapshot],
                       Callable[[CommandRequest, float], Awaitable[CommandReply]]], Awaitable[Any]]

__all__ = ["FAULT_VAR", "InjectedFault", "Supervisor", "TICK_S"]


Compose = Callable[[], tuple[GuardConfig, str]]


class Supervisor:
    def __init__(self, cfg: GuardConfig, model: str, python: str = sys.executable,
                 ledger: RuntimeLedger | None = None, compose: Compose | None = None,
                 listen_sock: socket.socket | None = None, recycle_adopted: bool = False) -> None:
        # the configuration: one value, swapped only by `apply_config` (a reload), never changed in place
        self.cfg = cfg
        self.model = model
        self.compose = compose  # how `serve` composed `cfg` (file, flags): a reload composes it again
        self.config_hash = reloads.config_hash(cfg)
        self.config_applied_at: str | None = None
        self.config_changed: tuple[str, ...] = ()
        self.last_reload: ReloadStatus | None = None
        self.python = python
        self.state_dir = Path(cfg.server.state_dir)
        self.ledger = ledger if ledger is not None else RuntimeLedger(self.state_dir)
        self.books = RuntimeBooks(self.ledger, cfg.server.failure_window)
        self.last_number = self.ledger.first_generation - 1  # numbers continue across runtimes
        # a draining generation's last request ended: it stops now, not up to a loop turn later
        self.proxy = Proxy(cfg.server, on_limit=self._on_limit, on_error=self._on_error,
                           on_drained=lambda _target: self.wake())
        self.notifier = Notifier()
        self.holdfile = HoldFile(self.state_dir)
        self.hold: str | None = self.holdfile.read()  # decide holds the replicas on their first look
        self.commands = Commands(self)
        self._wakeup = asyncio.Event()
        self.exit_code = EXIT_OK
        self.exit_line: str | None = None  # why the runtime ends on its own (exit 3 or 5): one line
        self.stopping = False  # a stop was asked for (signal, failure limit): nothing new starts
        self._stop_pending: bool | None = None  # a shutdown the loop still has to tell the replicas (second?)
        self.vllm_version = ""
        self.gpu_name = ""
        self.gate_unavailable: str | None = None  # learned from a gated start: this vLLM cannot park
        self.starts: dict[int, StartHistory] = {}
        self.standby_failures: dict[int, int] = {}  # per replica: standbys lost in a row
        self.last_probe: ProbeSummary | None = None
        self.reaper = procs.Reaper()
        self.loopwatch = LoopWatch()
        self.http: Any = None  # aiohttp.ClientSession, opened in `_open`
        self.nvml: Any = None  # core.nvml.NvmlSession, opened off the loop in `_open`
        self.admin: Any = None  # the admin socket's runner
        self.tasks: list[asyncio.Task[Any]] = []  # the runtime's own (the status monitor, metrics)
        self.drivers: list[ReplicaDriver] = []
        self.kit: MonitorKit | None = None  # opened in `_open`, with the launcher
        self.launcher: Launcher | None = None
        self._agg: tuple[RuntimeState, float] = (RuntimeState.STARTING, time.monotonic())
        self._status_sent = 0.0
        self._turn_began: float | None = None  # the turn in progress began (monotonic); None: asleep
        self._overrun = False
        self._extend_sent = 0.0
        # the hand-over (runtime/handover.py): possible only on a listening socket systemd holds
        self.listen_sock = listen_sock
        self.recycle_adopted = recycle_adopted  # recycle an adopted generation onto this runtime at once
        self.handing_over = False
        self.handed: list[Generation] = []
        self._adopted: dict[int, str] = {}  # replica -> config hash of the generation it adopts

    # -- what status and the commands see ----------------------------------------------------
    @property
    def state(self) -> RuntimeState:
        return aggregate(d.state for d in self.drivers) if self.drivers else RuntimeState.STARTING

    @property
    def generation(self) -> int:
        """The newest generation that serves or is starting as a replica's own (not a successor)."""
        return max((d.current.number for d in self.drivers if d.current is not None), default=self.last_number)

    def status(self) -> StatusSnapshot:
        return snapshot(StatusInputs(
            cfg=self.cfg, model=self.model, state=self.state, state_for_s=max(0.0, time.monotonic() - self._agg[1]),
            generation=self.generation, vllm_version=self.vllm_version, gpu_name=self.gpu_name, hold=self.hold,
            drivers=self.drivers, books=self.books, proxy=self.proxy, last_probe=self.last_probe,
            ledger=self.ledger.health(), config=ConfigStatus(
                hash=self.config_hash, source=self.cfg.source, applied_at=self.config_applied_at,
                changed=list(self.config_changed), last_reload=self.last_reload)))

    def next_number(self) -> int:
        self.last_number += 1
        return self.last_number

    def live_generations(self) -> list[Generation]:
        return [g for d in self.drivers for g in d.generations()]

    def replica_gpus(self, index: int) -> list[str]:
        static = self.nvml.static if self.nvml is not None and self.nvml.available else []
        p = self.drivers[index].plan
        return replicas.replica_uuids(static, p, {**os.environ, **p.env()})

    def facts(self, d: ReplicaDriver) -> Facts:
        return Facts(
            cfg=self.cfg, index=d.index, peers=tuple(x.machine for x in self.drivers), stopping=self.stopping,
            hold=self.hold, failures_in_window=self.books.in_window(), gate_unavailable=self.gate_unavailable,
            starts=self.starts.get(d.index, StartHistory()), gpu_room=d.gpu_room,
            standby_failures=self.standby_failures.get(d.index, 0), gpu_mb_s=d.gpu_mb_s,
            nvml=self.nvml is not None and self.nvml.available, ready_sent=self.notifier.ready_sent,
            extend_sent_at=self._extend_sent, config_hash=self.config_hash)

    # -- the runbook ---------------------------------------------------------------------------
    async def run(self, admin_start: AdminStart | None = None) -> int:
        try:
            await self._open(admin_start)
            while not self._done():
                t0 = time.monotonic()
                self._turn_began = None
                await self._sleep()
                t1 = self._turn_began = time.monotonic()
                await self.commands.handle()
                await self._tell_stop()
                t2 = time.monotonic()
                for d in self.drivers:
                    await d.tick(lambda d=d: self.facts(d))  # type: ignore[misc]
                await self._tell_stop()
                await self._recycle_adopted()
                if self.launcher is not None and self.launcher.holders:
                    await self.launcher.settle_holders()
                t3 = time.monotonic()
                await self._heartbeat()
                self._note_slow_turn(t0, t1, t2, t3, time.monotonic())
        finally:
            await self._close()
        log.info("runtime_exited", exit_code=self.exit_code)
        return self.exit_code

    async def _open(self, admin_start: AdminStart | None) -> None:
        """Up: become the subreaper of our grandchildren, route signals into the command queue,
        open NVML off the loop, plan the replicas (their GPUs), kill the vLLM trees a killed
        predecessor left and record them as failures, then the proxy, the admin socket, the
        metrics and the status monitor. The replicas start on their first look."""
        import aiohttp

        from vllm_guard.core.nvml import NvmlSession

        self.loopwatch.start()
        procs.become_subreaper()
        lifecycle.install_signals(self.commands.put)
        self.http = aiohttp.ClientSession()
        self.nvml = await asyncio.to_thread(NvmlSession)
        self.gpu_name = visible_gpu_name(self.nvml, os.environ)
        static = self.nvml.static if self.nvml.available else []
        plans = replicas.plan(self.cfg, static, os.environ)
        self.kit = kit = MonitorKit(self.cfg, self.http, self.nvml, self.ledger, self.state_dir, self.replica_gpus,
                                    self._on_probe, self._on_version, self.wake)
        self.launcher = launcher = Launcher(self.cfg, self.model, self.python, self.state_dir, self.ledger, plans,
                                            self.next_number, self.config_hash)
        launcher.gpu_box = bool(static)
        totals = [g["mem_total_mb"] for g in static if g.get("mem_total_mb")]
        launcher.gpu_total_mb = min(totals) if totals else None
        self.books.on_failure = launcher.note_failure
        self.drivers = [ReplicaDriver(p, launcher, self.proxy, self.books, kit, self,
                                      request_timeout=self.cfg.server.request_timeout) for p in plans]
        for d in self.drivers:
            name = visible_gpu_name(self.nvml, {**os.environ, **d.plan.env()})
            d.gpu_name = name
            self.books.set_gpu_name(d.index, name)
        self._take_handover(launcher)
        await launcher.claim_holders()
        orphans = await lifecycle.kill_orphans(self.ledger)
        for lost in self.ledger.close_open_generations(FailureKind.RUNTIME_LOST.value):
            self.books.lost(lost.generation, lost.replica, lost.failure_id, lost.at)
        self.ledger.attach(self.proxy.listeners, self.cfg)  # every request and memory reading to the ledger
        await self.proxy.start(self.listen_sock)
        if admin_start is not None:  # keep a reference: a dropped runner closes
            self.admin = await admin_start(self.state_dir, self.cfg.server, self.status, self.commands.submit)
        task = metrics.start(self.cfg.server, self.state_dir, self.status, self.proxy)
        if task is not None:
            self.tasks.append(task)
        self.tasks.append(asyncio.create_task(self._pulse()))
        self.tasks.append(asyncio.create_task(guarded("status", 0, lambda: status_loop(
            self.live_generations, self.state_dir, self.wake))))
        log.info("runtime_started", port=self.cfg.server.port, state_dir=str(self.state_dir), model=self.model,
                 gpu=self.gpu_name or None, hold=self.hold, next_generation=self.last_number + 1,
                 orphans_killed=orphans, replicas=len(self.drivers), recycle_strategy=self.cfg.server.recycle_strategy,
                 config=self.config_hash, config_file=self.cfg.source)

    async def _close(self) -> None:
        """Every way out: no vLLM process of ours survives, then the rest is closed."""
        for task in self.tasks:
            task.cancel()
        self.loopwatch.stop()
        for d in self.drivers:
            await d.kill_for_good(self._ended_by_error)
        if self.handed:
            await asyncio.to_thread(self._write_handover)
        elif self.launcher is not None:
            await self.launcher.stop_holders()
        await self.proxy.stop()
        if self.admin is not None:
            await self.admin.cleanup()
        if self.http is not None:
            await self.http.close()
        if self.nvml is not None:
            self.nvml.close()
        await asyncio.to_thread(self.ledger.close)

    # -- the hand-over (runtime/handover.py) ----------------------------------------------------
    def _take_handover(self, launcher: Launcher) -> None:
        """What a previous runtime handed over: each generation that still holds is adopted by
        its replica's first start; one that does not is left to the orphan kill."""
        record = handover.take(self.state_dir)
        rows: set[int] = set()
        adoptable: dict[int, handover.HandedGeneration] = {}
        if record is None:
            launcher.hand_over(self.listen_sock is not None, adoptable, None)
            return
        for g in record.generations:
            why = handover.holds(g) if self.listen_sock is not None else "this runtime has no socket from systemd"
            if why is None and self.hold is not None:
                why = f"the service is held ({self.hold})"
            if why is None and g.replica not in launcher.plans:
                why = f"this runtime has no replica {g.replica}"
            if why is not None:
                log.warning("handover_refused", generation=g.generation, replica=g.replica, why=why)
                continue
            adoptable[g.replica] = g
            self._adopted[g.replica] = g.config_hash
            rows.add(g.row)
        self.ledger.adopting(rows)
        launcher.hand_over(self.listen_sock is not None, adoptable, Path(record.mark) if rows else None)
        for h in record.holders:  # a holder outlives its runtime by its lease; this one follows it now
            if h.replica in launcher.plans and handover.same_process(start_ticks(h.proc.pid), h.proc.ticks):
                launcher.adopt_holder(h.replica, h.proc.pid, h.key, h.device)

    def _write_handover(self) -> None:
        """The record for the next runtime, then the keeper's lease: the runtime's last acts."""
        mark = handover.new_mark(self.state_dir)
        gens = []
        for gen in self.handed:
            b = gen.backend
            procs_now = [handover.Proc(pid=p, ticks=t) for p in sorted(b.known_pids)
                         if (t := start_ticks(p)) is not None]
            api_ticks = start_ticks(b.pid)
            if api_ticks is None:
                continue
            gens.append(handover.HandedGeneration(
                replica=gen.replica, generation=gen.number, row=gen.row, api=handover.Proc(pid=b.pid, ticks=api_ticks),
                procs=procs_now, model=b.model, vllm_args=list(b.vllm_args), host=b.host, port=b.port,
                uds=str(b.uds) if b.uds is not None else None, log_path=str(b.log_path), config_hash=gen.config,
                served=gen.target.completed))
            self.ledger.generation_progress(gen.row, gen.target.completed)  # its row, up to date for the next
        holders = []
        for h in (self.launcher.holders.values() if self.launcher is not None else ()):
            ticks = start_ticks(h.pid) if h.pid is not None and h.alive else None
            if h.pid is not None and ticks is not None:
                holders.append(handover.HandedHolder(replica=h.replica, proc=handover.Proc(pid=h.pid, ticks=ticks),
                                                     key=h.key, device=h.device))
        record = handover.Record(state_dir=str(self.state_dir.resolve()), runtime_pid=os.getpid(), written_at=utcnow(),
                                 lease_s=handover.LEASE_S, mark=str(mark.resolve()), generations=gens,
                                 holders=holders)
        handover.write(self.state_dir, record)
        backends.hand_over(handover.LEASE_S, mark.resolve())
        log.info("handover_written", generations=[g.generation for g in gens], lease_s=handover.LEASE_S,
                 record=str(handover.record_path(self.state_dir)))

    async def _recycle_adopted(self) -> None:
        """An adopted generation that serves is recycled onto this runtime's configuration at
        once when it ran another one (or `--recycle-adopted` asks); else it serves on."""
        for d in self.drivers:
            ran = self._adopted.get(d.index)
            if ran is None or self.stopping:
                continue
            if ran == self.config_hash and not self.recycle_adopted:
                del self._adopted[d.index]
                continue
            # asked every turn until `decide` takes it (it refuses while the generation is not yet ready)
            took = await d.handle(RecycleCmd("upgrade", EndClass.SCHEDULED, None), lambda d=d: self.facts(d))  # type: ignore[misc]
            if took.reply is not None and took.reply.accepted:
                del self._adopted[d.index]
                log.info("adopted_recycle", replica=d.index, ran=ran, config=self.config_hash,
                         why="another configuration" if ran != self.config_hash else "--recycle-adopted")

    def drop_holder(self, replica: int | None, reason: str) -> None:
        """The weight holders' drop rule (`core.holder.drop_reason`) said so."""
        if self.launcher is not None:
            self.launcher.drop_holder(replica, reason)

    def can_hand_over(self) -> bool:
        """Only on a socket systemd holds: else the port would close with this runtime."""
        return self.listen_sock is not None

    def handed_over(self, gen: Generation) -> None:
        self.handed.append(gen)

    def _ended_by_error(self, gen: Generation) -> None:
        self.ledger.generation_ended(gen.row, "runtime_error", EndClass.UNPLANNED.value, gen.target.completed)

    def _note_slow_turn(self, *marks: float) -> None:
        parts = slow_turn(*marks)
        if parts is not None:
            log.warning("supervisor_turn_slow", **parts, states=[d.state.value for d in self.drivers])

    def _done(self) -> bool:
        return bool(self.drivers) and all(final(d.state) and not d.retiring for d in self.drivers)

    async def _sleep(self) -> None:
        try:
            await asyncio.wait_for(self._wakeup.wait(), TICK_S)
        except asyncio.TimeoutError:
            pass
        self._wakeup.clear()

    def wake(self) -> None:
        self._wakeup.set()

    # -- the Hub: what the replicas ask of the runtime ---------------------------------------------
    def state_changed(self) -> None:
        st = self.state
        if st is not self._agg[0]:
            self._agg = (st, time.monotonic())
        self.send_status()
        self.wake()  # the new state decides at once (a drain with nothing in flight stops now)

    def ready(self) -> None:
        if not self.notifier.ready_sent:
            self.notifier.ready(status_line(self.status()))

    def extend(self) -> None:
        self._extend_sent = time.monotonic()
        self.notifier.extend_timeout(EXTEND_S)

    def give_up(self) -> None:
        """Too many failures in the window: stop every replica and exit 3 (systemd's StartLimit
        takes over)."""
        if self.exit_code == EXIT_START_FAILURE:
            return  # the more precise end was decided first
        if self.exit_code != EXIT_FAILURE_LIMIT:
            log.error("failure_limit", failures=self.books.in_window() + 1, window_s=self.cfg.server.failure_window)
        self.exit_code = EXIT_FAILURE_LIMIT
        self._begin_stop(second=False)

    def start_failure(self, line: str) -> None:
        """Two starts in a row died before serving of the same cause (`line`): restarting cannot
        help. Stop every replica and exit 5 with that line."""
        if self.exit_code != EXIT_START_FAILURE:
            log.error("start_failure_repeated", why=line, action="not restarted: the same cause twice in a row")
        self.exit_code, self.exit_line = EXIT_START_FAILURE, line
        self._begin_stop(second=False)

    def exit_all(self, code: int) -> None:
        """The backend cannot even be launched: exit at once."""
        self.exit_code = code
        self._begin_stop(second=True)

    def reap_later(self, pids: list[int]) -> None:
        """A grandchild can die after its parent and reach us (the subreaper) only later: keep
        reaping a stopped generation's pids for a while so no zombie outlives it."""
        self.reaper.add(pids, time.monotonic())

    def learn_gate(self, reason: str) -> None:
        self.gate_unavailable = reason

    def learn_standby(self, replica: int, failed: bool) -> None:
        self.standby_failures[replica] = self.standby_failures.get(replica, 0) + 1 if failed else 0

    def learn_start(self, replica: int, beside: bool, seconds: float) -> None:
        h = self.starts.get(replica, StartHistory())
        self.starts[replica] = replace(h, beside_s=seconds) if beside else replace(h, alone_s=seconds)

    # -- callbacks from the proxy and the monitors ---------------------------------------------
    def _on_limit(self, target: Target) -> None:
        self.wake()

    def _on_error(self, target: Target) -> None:
        self.proxy.router.failed(target)  # the retry goes to another replica for a moment
        self.wake()

    def _on_probe(self, summary: ProbeSummary) -> None:
        self.last_probe = summary

    def _on_version(self, version: str) -> None:
        self.vllm_version = version
        self.books.set_version(version)

    # -- stop, hold --------------------------------------------------------------------------
    def begin_stop(self, second: bool, hand_over: bool = False) -> None:
        """SIGTERM/SIGINT (a second one shortens the ladder): the loop tells every replica. A
        hand-over (`handover`) first stops taking connections: they wait for the next runtime."""
        if not self.stopping:
            self.notifier.stopping()
            if hand_over and self.can_hand_over():
                self.handing_over = True
                self.proxy.stop_accepting()
                log.info("handing_over", why="the next runtime takes the serving generations and the socket",
                         in_flight=self.proxy.in_flight)
        self._begin_stop(second)

    def _begin_stop(self, second: bool) -> None:
        self.stopping = True
        self._stop_pending = bool(self._stop_pending) or second
        self.wake()

    async def _tell_stop(self) -> None:
        if self._stop_pending is None:
            return
        second, self._stop_pending = self._stop_pending, None
        for d in self.drivers:
            await d.handle(StopCmd(second, hand_over=self.handing_over), lambda d=d: self.facts(d))  # type: ignore[misc]

    async def set_hold(self, reason: str) -> str:
        """Hold: nothing (re)starts until release; returns what the operator is told. What a
        hold means for each replica and for the proxy is its `decide`'s."""
        self.hold = reason
        detail = "held: no generation will be started until release"
        try:
            await asyncio.to_thread(self.holdfile.write, reason)
        except OSError as e:
            log.error("hold_not_persisted", error=str(e), path=str(self.holdfile.path))
            detail += f" (not persisted, a restarted runtime will not hold: {e.strerror or e})"
        for d in self.drivers:
            await d.handle(HoldCmd(reason), lambda d=d: self.facts(d))  # type: ignore[misc]
        return detail

    async def release(self) -> str | None:
        """Release a hold; None when there was none. Returns what the operator is told."""
        if self.hold is None:
            return None
        self.hold = None
        try:
            await asyncio.to_thread(self.holdfile.clear)
        except OSError as e:
            log.error("hold_file_not_removed", error=str(e), path=str(self.holdfile.path))
        before = self.last_number
        for d in self.drivers:
            await d.handle(ReleaseCmd(), lambda d=d: self.facts(d))  # type: ignore[misc]
        return f"released: starting generation {self.last_number}" if self.last_number > before else "released"

    # -- reload --------------------------------------------------------------------------------
    async def plan_reload(self) -> reloads.ReloadPlan:
        """Compose the configuration again, off the loop (it reads files), and judge it."""
        if self.compose is None:
            return reloads.ReloadPlan("refused", "this runtime has no configuration to re-read", self.config_hash)
        return await asyncio.to_thread(reloads.plan_reload, self.cfg, self.compose)

    def apply_config(self, plan: reloads.ReloadPlan) -> None:
        """Swap in a reload's configuration: the one value here, and what each holder copied of
        it at start (the proxy, the books, the monitors, the launcher, the drivers)."""
        if plan.cfg is None:  # only an `applied` plan carries one (not an assert: -O drops those)
            raise ValueError(f"a reload judged {plan.verdict!r} has no configuration to apply")
        self.cfg, self.model, self.config_hash = plan.cfg, plan.model, plan.config_hash
        self.config_changed, self.config_applied_at = plan.changed, utcnow()
        self.proxy.configure(self.cfg.server)
        self.books.failure_window = self.cfg.server.failure_window
        if self.kit is not None and self.launcher is not None:
            self.kit.cfg = self.cfg
            self.launcher.configure(self.cfg, self.model, self.config_hash, plan.changed)
        for d in self.drivers:
            d.request_timeout = self.cfg.server.request_timeout
        log.info("config_applied", config=self.config_hash, changed=list(plan.changed), model=self.model,
                 vllm_args=list(self.cfg.server.vllm_args))

    def note_reload(self, reason: str, outcome: Literal["applied", "unchanged", "refused"], detail: str) -> None:
        """The last reload, for status and the ledger (`meta` runtime.last_reload)."""
        self.last_reload = ReloadStatus(at=utcnow(), reason=reason, outcome=outcome, detail=detail)
        self.ledger.reload_noted({**self.last_reload.model_dump(), "config": self.config_hash})

    # -- systemd -------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.reaper.later:
            await asyncio.to_thread(self.reaper.poll, now)
        overrun = False
        for d in self.drivers:
            late = d.overdue(now, OVERRUN_GRACE_S)
            if late and not d.overrun_logged:
                log.error("state_overrun", replica=d.index, state=d.state.value,
                          over_s=round(now - (d.machine.deadline or now), 1))
                d.note_overrun()
            overrun = overrun or late
        self._overrun = overrun
        self._beat(now)
        if now - self._status_sent >= 2.0:
            self.send_status()

    def _beat(self, now: float) -> None:
        """WATCHDOG=1 and the liveness beat, unless a state overran its deadline or the loop's
        turn is wedged: that stops both, systemd's watchdog and the kubelet's."""
        if not may_beat(self._overrun, self._turn_began, now):
            return
        self.proxy.beat()
        if self.notifier.watchdog_due(now):
            self.notifier.watchdog(now)

    async def _pulse(self) -> None:
        """Beat on its own clock too, so a turn that awaits a slow effect (a launch on a starved
        box, a generation's last reap) does not hold WATCHDOG=1 back; a blocked event loop
        does, since this runs on it."""
        while True:
            await asyncio.sleep(PULSE_S)
            self._beat(time.monotonic())

    def send_status(self) -> None:
        self._status_sent = time.monotonic()
        self.notifier.status(status_line(self.status()))


def may_beat(overrun: bool, turn_began: float | None, now: float) -> bool:
    """Whether the runtime counts as alive for systemd and the kubelet: no state overran its
    deadline, and the loop's turn in progress (None: asleep between turns) is not wedged."""
    return not overrun and (turn_began is None or now - turn_began < WEDGED_TURN_S)


def slow_turn(t0: float, t1: float, t2: float, t3: float, t4: float) -> dict[str, float] | None:
    """Where a loop turn (sleep, commands, replicas, heartbeat: t0..t4) long enough to delay
    WATCHDOG=1 went; None for a normal turn. A long `sleep_s` is the event loop itself blocked
    or starved of CPU; the others are the turn's own awaits."""
    if t4 - t0 < SLOW_TURN_S:
        return None
    return {"seconds": round(t4 - t0, 2), "sleep_s": round(t1 - t0, 2), "commands_s": round(t2 - t1, 2),
            "replicas_s": round(t3 - t2, 2), "heartbeat_s": round(t4 - t3, 2)}
