"""The supervisor: one loop with explicit states that keeps exactly one vLLM generation serving.

Like gunicorn's Arbiter, signals and admin commands only enqueue; every decision happens in
`run()`, which reads like a runbook: wait, handle commands, step the current state, tell
systemd we are alive. Long actions (draining, a 60-140 s cold start) are states with deadlines,
never blocking calls, so the WATCHDOG=1 pings continue through a planned recycle.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import psutil
import structlog

from . import ledger as L
from .backend import Backend, become_subreaper, free_port
from .config import GuardConfig
from .gpu import Nvml, visible_gpu_name
from .holdfile import HoldFile
from .notify import SYSTEMD_VARS, Notifier
from .proxy import Proxy, Target
from .states import (
    EXIT_BOOT_ERROR, EXIT_FAILURE_LIMIT, EXIT_OK, FailureRecord, RecycleRecord, State,
)

try:  # the patches plugin's runtime side (child env, per-process patch reports)
    from vllm_guard.patches import hooks as patches_hooks
except ImportError:  # pragma: no cover - a build without patches/
    patches_hooks = None  # type: ignore[assignment]

log = structlog.get_logger("vllm_guard.supervisor")

TICK_S = 0.25
OVERRUN_GRACE_S = 60.0
EXTEND_S = 60.0
KEEP_LOGS = 20


def _progressed(before: dict[str, float] | None, after: dict[str, float] | None) -> bool:
    """Did the engine process any token between two /metrics scrapes? (False if unknown.)"""
    if before is None or after is None:
        return False
    done = lambda m: m["generation_tokens"] + m["prompt_tokens"]  # noqa: E731
    return done(after) > done(before)


class Supervisor:
    def __init__(self, cfg: GuardConfig, model: str, python: str = sys.executable) -> None:
        self.cfg = cfg
        self.model = model
        self.python = python
        self.state_dir = Path(cfg.server.state_dir)
        self.state = State.STARTING
        self.state_since = time.monotonic()
        self.deadline: float | None = None
        self.generation = 0
        self.backend: Backend | None = None
        self.target: Target | None = None
        self.gen_row = 0
        self.ready_mono = 0.0
        self.proxy = Proxy(cfg.server, on_limit=self._on_limit, on_error=self._on_error)
        self.notifier = Notifier()
        self.ledger = L.RuntimeLedger(self.state_dir)
        self.holdfile = HoldFile(self.state_dir)
        self.hold: str | None = self.holdfile.read()
        self.nvml = Nvml()
        self.commands: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self.failures: list[FailureRecord] = []
        self.recycles: list[RecycleRecord] = []
        self._failure_times: collections.deque[float] = collections.deque()
        self._consecutive = 0
        self._unrestored: list[FailureRecord] = []
        self._recycle: RecycleRecord | None = None
        self._after_stop = "start"  # start | backoff | hold | exit
        self._end_reason = ("", L.SCHEDULED)
        self._limit_hit = False
        self._hang: str | None = None
        self._kill_sent = False
        self._stop_mark = 0.0
        self._stop_requests = 0
        self._status_sent = 0.0
        self._extend_sent = 0.0
        self._overrun_logged = False
        self.exit_code = EXIT_OK
        self.vllm_version = ""
        self.gpu_name = ""
        self.memory: dict[str, Any] = {}
        self.last_probe: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._reap_later: dict[int, float] = {}  # pid -> since when (old generations' orphans)
        self._ready_task: asyncio.Task[bool] | None = None
        self.http: aiohttp.ClientSession | None = None
        self._admin: Any = None
        self._steps: dict[State, Callable[[], Awaitable[None]]] = {
            State.STARTING: self._step_starting,
            State.SERVING: self._step_serving,
            State.DRAINING: self._step_draining,
            State.STOPPING: self._step_stopping,
            State.BACKOFF: self._step_backoff,
            State.HELD: self._step_held,
        }

    # -- the runbook ---------------------------------------------------------------------------
    async def run(self, admin_start: Callable[[Supervisor], Awaitable[Any]] | None = None) -> int:
        become_subreaper()
        self._install_signals()
        self.http = aiohttp.ClientSession()
        self.gpu_name = await asyncio.to_thread(visible_gpu_name, self.nvml)
        await self.proxy.start()
        if admin_start is not None:
            self._admin = await admin_start(self)  # keep a reference: a dropped runner closes
        lost = self.ledger.close_open_generations("runtime_lost")
        log.info("runtime_started", port=self.cfg.server.port, state_dir=str(self.state_dir),
                 model=self.model, gpu=self.gpu_name or None, hold=self.hold, stale_generations=lost)
        if self.hold:
            await self._enter_held()
        else:
            await self._start_generation()
        while self.state is not State.EXITING:
            await self._sleep()
            await self._handle_commands()
            if self.state in self._steps:
                await self._steps[self.state]()
            self._heartbeat()
        await self._close()
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

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.commands.put_nowait, ("stop", {"signal": "SIGTERM"}))
        loop.add_signal_handler(signal.SIGINT, self.commands.put_nowait, ("stop", {"signal": "SIGINT"}))
        loop.add_signal_handler(
            signal.SIGHUP, self.commands.put_nowait, ("recycle", {"reason": "sighup", "class": L.SCHEDULED})
        )

    def _enter(self, state: State, timeout: float | None = None) -> None:
        old = self.state
        self.state = state
        self.state_since = time.monotonic()
        self.deadline = None if timeout is None else self.state_since + timeout
        self._overrun_logged = False
        log.info("state", old=old.value, new=state.value, generation=self.generation,
                 deadline_s=timeout)
        self._send_status(force=True)

    # -- commands ------------------------------------------------------------------------------
    async def _handle_commands(self) -> None:
        while not self.commands.empty():
            cmd, args = self.commands.get_nowait()
            log.info("command", command=cmd, **args)
            handler = {
                "stop": self._cmd_stop, "recycle": self._cmd_recycle, "restart": self._cmd_restart,
                "hold": self._cmd_hold, "release": self._cmd_release,
            }[cmd]
            await handler(args)

    async def _cmd_stop(self, args: dict[str, Any]) -> None:
        self._stop_requests += 1
        if self._stop_requests == 1:
            self.notifier.stopping()
            await self.proxy.set_reject("vllm-guard is shutting down")
        if self.state in (State.BACKOFF, State.HELD):
            self._enter(State.EXITING)
        elif self.state in (State.SERVING, State.STARTING) and self.backend is not None:
            self._end_reason = ("shutdown", L.SCHEDULED)
            self._after_stop = "exit"
            if self.state is State.SERVING:
                await self._begin_drain()
            else:
                await self._begin_stop(kill=False)
        else:
            self._after_stop = "exit"
            if self._stop_requests > 1:  # a second signal shortens the ladder
                if self.state is State.DRAINING:
                    await self._begin_stop(kill=False)
                elif self.state is State.STOPPING:
                    await self._begin_stop(kill=True)

    async def _cmd_recycle(self, args: dict[str, Any]) -> None:
        if self.state is not State.SERVING or self.hold:
            log.warning("recycle_ignored", state=self.state.value, reason=args.get("reason"), hold=self.hold)
            return
        await self._begin_recycle(args.get("reason") or "admin", args.get("class") or L.SCHEDULED)

    async def _cmd_restart(self, args: dict[str, Any]) -> None:
        if self.backend is None or self.state not in (State.SERVING, State.STARTING, State.DRAINING):
            log.warning("restart_ignored", state=self.state.value)
            return
        await self._fail("restart", self.backend.returncode, args.get("reason") or "admin",
                         args.get("class") or L.UNPLANNED)

    async def _cmd_hold(self, args: dict[str, Any]) -> None:
        self.hold = args.get("reason") or "hold"
        self.holdfile.write(self.hold)
        if self.state is State.BACKOFF:
            await self._enter_held()

    async def _cmd_release(self, args: dict[str, Any]) -> None:
        self.hold = None
        self.holdfile.clear()
        if self.state is State.HELD and self._stop_requests == 0:
            await self.proxy.set_reject(None)
            await self._start_generation()

    # -- generation life -----------------------------------------------------------------------
    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["VLLM_GUARD_STATE_DIR"] = str(self.state_dir.resolve())
        # torch.compile / Triton caches in the state dir: every generation after the first starts
        # warm, so a recycle costs less than a cold start (the user's own setting wins).
        env.setdefault("VLLM_CACHE_ROOT", str(self.state_dir.resolve() / "vllm-cache"))
        env.setdefault("TRITON_CACHE_DIR", str(self.state_dir.resolve() / "triton-cache"))
        env["VLLM_GUARD_GENERATION"] = str(self.generation)
        if patches_hooks is not None:  # the plugin: VLLM_PLUGINS, allocator settings, injection
            env = patches_hooks.child_env(env, self.cfg, list(self.cfg.server.vllm_args))
        return env

    def _patch_states(self) -> dict[str, Any]:
        if patches_hooks is None:
            return {}
        return patches_hooks.read_states(self.state_dir, self.generation)

    async def _start_generation(self) -> None:
        self.generation += 1
        s = self.cfg.server
        logs = self.state_dir / "logs"
        self.backend = Backend(
            generation=self.generation, model=self.model, host=s.backend_host,
            port=free_port(s.backend_host), vllm_args=list(s.vllm_args),
            log_path=logs / f"generation-{self.generation}.log", python=self.python,
            env=self._child_env(),
        )
        r = self.cfg.recycle
        limit = r.max_requests + random.randint(0, r.max_requests_jitter) if r.max_requests else None
        self.target = Target(generation=self.generation, url=self.backend.url, limit=limit)
        self._limit_hit = False
        self._hang = None
        self._engine_pids: list[int] = []
        self.memory = {}
        try:
            await self.backend.start()
        except OSError as e:
            log.error("backend_launch_failed", error=str(e), python=self.python)
            self.exit_code = EXIT_BOOT_ERROR
            self._enter(State.EXITING)
            return
        self._prune_logs(logs)
        self.gen_row = self.ledger.generation_started(self.generation, self.backend.pid, self.model)
        log.info("generation_starting", generation=self.generation, pid=self.backend.pid,
                 backend=self.backend.url, max_requests=limit, log=str(self.backend.log_path))
        self._ready_task = asyncio.create_task(self._wait_ready(self.backend))
        self._enter(State.STARTING, self.cfg.server.startup_timeout)

    def _prune_logs(self, logs: Path) -> None:
        old = sorted(logs.glob("generation-*.log"), key=lambda p: p.stat().st_mtime)[:-KEEP_LOGS]
        for p in old:
            p.unlink(missing_ok=True)

    async def _wait_ready(self, b: Backend) -> bool:
        """Ready means /health 200 *and* a real 1-token completion."""
        assert self.http is not None
        while b.returncode is None:
            if await b.health(self.http):
                res = await b.probe(self.http, self.cfg.probe.prompt, self.cfg.probe.timeout * 3)
                if res.ok:
                    self.vllm_version = await self._vllm_version(b)
                    return True
                log.info("ready_probe_failed", generation=b.generation, error=res.error)
            await asyncio.sleep(1.0)
        return False

    async def _vllm_version(self, b: Backend) -> str:
        assert self.http is not None
        try:
            async with self.http.get(b.url + "/version", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return str((await r.json()).get("version", ""))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return ""

    async def _step_starting(self) -> None:
        b = self.backend
        assert b is not None
        if self._ready_task is not None and self._ready_task.done():
            if self._ready_task.result():
                await self._on_ready()
                return
        if b.returncode is not None:
            await self._fail("start_failed", b.returncode, f"exited with {b.returncode} while loading")
        elif self.deadline is not None and time.monotonic() > self.deadline:
            await self._fail("start_timeout", None, f"not ready after {self.cfg.server.startup_timeout:.0f}s")
        elif not self.notifier.ready_sent and time.monotonic() - self._extend_sent >= 10:
            self._extend_sent = time.monotonic()  # the first model load may outlast TimeoutStartSec
            self.notifier.extend_timeout(EXTEND_S)

    async def _on_ready(self) -> None:
        assert self.backend is not None and self.target is not None
        self.ready_mono = time.monotonic()
        self.target.open(self.cfg.server.request_timeout)
        await self.proxy.set_target(self.target)
        self.ledger.generation_ready(self.gen_row, self.vllm_version, self.gpu_name)
        self._consecutive = 0
        for f in self._unrestored:
            f.restored_at = L.utcnow()
            self.ledger.failure_restored(f.ledger_id)
        self._unrestored.clear()
        if self._recycle is not None:
            rec, self._recycle = self._recycle, None
            rec.duration_s = round(self.ready_mono - rec.started_mono, 3)
            rec.downtime_s = rec.duration_s
            rec.queued = max(rec.queued, self.proxy.counters.max_queued)
            self.ledger.recycle_update(rec.ledger_id, ready_at=L.utcnow(), duration_s=rec.duration_s,
                                       downtime_s=rec.downtime_s, max_queued=rec.queued)
        log.info("generation_ready", generation=self.generation, pid=self.backend.pid,
                 load_s=round(self.ready_mono - self.backend.started_mono, 1), vllm=self.vllm_version,
                 children=self.backend.children())
        self._engine_pids = [c["pid"] for c in self.backend.children() if c["role"] != "api_server"]
        self._enter(State.SERVING)
        if not self.notifier.ready_sent:
            self.notifier.ready(self._status_line())
        self._tasks = [
            asyncio.create_task(self._probe_loop(self.backend, self.target)),
            asyncio.create_task(self._memory_loop(self.backend, self.target)),
        ]

    def _dead_engine(self) -> int | None:
        """A pid of this generation's engine processes that is gone while the API server lives
        (vLLM's API server takes seconds to notice and then exits 0)."""
        for pid in self._engine_pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            return pid
        return None

    async def _step_serving(self) -> None:
        b, t = self.backend, self.target
        assert b is not None and t is not None
        dead = self._dead_engine()
        if b.returncode is not None:
            await self._fail("crash", b.returncode, f"backend exited with {b.returncode}")
        elif dead is not None:
            await self._fail("crash", None, f"engine process {dead} died")
        elif self._hang is not None:
            await self._fail("hang", None, self._hang)
        elif self.hold is None:
            trigger = self._recycle_trigger()
            if trigger is not None:
                await self._begin_recycle(*trigger)

    def _recycle_trigger(self) -> tuple[str, str] | None:
        r, t = self.cfg.recycle, self.target
        assert t is not None
        if self._limit_hit:
            return ("max_requests", L.SCHEDULED)
        up = time.monotonic() - self.ready_mono
        if r.max_uptime and up >= r.max_uptime:
            return ("max_uptime", L.SCHEDULED)
        growth = self.memory.get("growth", {})
        if r.max_gpu_memory_growth_mb and growth.get("gpu_mb", 0.0) >= r.max_gpu_memory_growth_mb:
            return ("gpu_memory_growth", L.PREVENTIVE)
        if r.max_host_rss_growth_mb and growth.get("rss_mb", 0.0) >= r.max_host_rss_growth_mb:
            return ("host_rss_growth", L.PREVENTIVE)
        if r.idle_fraction and self.proxy.idle_for() >= r.idle_after:
            if self._limit_fraction() >= r.idle_fraction:
                return ("idle_opportunistic", L.SCHEDULED)
        return None

    def _limit_fraction(self) -> float:
        """How far the generation is toward its nearest limit (0..1+)."""
        r, t = self.cfg.recycle, self.target
        assert t is not None
        fr = [0.0]
        if t.limit:
            fr.append(t.dispatched / t.limit)
        if r.max_uptime:
            fr.append((time.monotonic() - self.ready_mono) / r.max_uptime)
        growth = self.memory.get("growth", {})
        if r.max_gpu_memory_growth_mb:
            fr.append(growth.get("gpu_mb", 0.0) / r.max_gpu_memory_growth_mb)
        if r.max_host_rss_growth_mb:
            fr.append(growth.get("rss_mb", 0.0) / r.max_host_rss_growth_mb)
        return max(fr)

    def _on_limit(self, target: Target) -> None:
        if target is self.target:
            self._limit_hit = True
            self.wake()

    def _on_error(self, target: Target) -> None:
        self.wake()

    # -- recycle: drain, stop, start -----------------------------------------------------------
    async def _begin_recycle(self, reason: str, cls: str) -> None:
        assert self.target is not None
        q = self.proxy.queued
        rec = RecycleRecord(reason=reason, cls=cls, started=L.utcnow(), in_flight=self.target.in_flight,
                            queued=q, generation=self.generation, started_mono=time.monotonic())
        rec.ledger_id = self.ledger.recycle_started(self.generation, reason, cls, rec.in_flight, q)
        rec.extra["in_flight_at_start"] = rec.in_flight
        self.proxy.counters.max_queued = q
        self.recycles.append(rec)
        self._recycle = rec
        self._end_reason = (reason, cls)
        self._after_stop = "start"
        log.info("recycle_begin", generation=self.generation, reason=reason, cls=cls,
                 in_flight=rec.in_flight, queued=q, served=self.target.dispatched)
        await self._begin_drain()

    async def _begin_drain(self) -> None:
        assert self.target is not None
        await self.proxy.stop_dispatch(self.target)
        self._cancel_tasks()
        self._enter(State.DRAINING, self.cfg.server.drain_timeout)

    async def _step_draining(self) -> None:
        b, t = self.backend, self.target
        assert b is not None and t is not None
        if self._recycle is not None:
            self._recycle.queued = max(self._recycle.queued, self.proxy.counters.max_queued)
        if b.returncode is not None or self._dead_engine() is not None:
            await self._fail("crash", b.returncode, "backend died while draining")
        elif t.in_flight == 0:
            if self._recycle is not None:
                self.ledger.recycle_update(self._recycle.ledger_id, drained_at=L.utcnow())
            await self._begin_stop(kill=False)
        elif self.deadline is not None and time.monotonic() > self.deadline:
            log.warning("drain_timeout", generation=self.generation, in_flight=t.in_flight)
            await self._begin_stop(kill=False)

    async def _begin_stop(self, kill: bool) -> None:
        """SIGTERM (or SIGKILL for a failed generation) to the whole process group."""
        b = self.backend
        assert b is not None
        self._cancel_tasks()
        b.children()  # remember every pid before the tree falls apart
        sig = signal.SIGKILL if kill else signal.SIGTERM
        b.signal_all(sig)
        self._kill_sent = kill
        self._stop_mark = time.monotonic()
        self._enter(State.STOPPING, 10.0 if kill else self.cfg.server.stop_timeout)

    async def _step_stopping(self) -> None:
        b = self.backend
        assert b is not None
        alive = await asyncio.to_thread(b.alive_pids)
        now = time.monotonic()
        if alive:
            if self.deadline is not None and now > self.deadline:
                if not self._kill_sent:
                    log.warning("stop_timeout_sigkill", generation=self.generation, pids=alive)
                    b.signal_all(signal.SIGKILL)
                    self._kill_sent = True
                    self.deadline = now + 10.0
                else:
                    log.error("stop_incomplete", generation=self.generation, pids=alive)
                    await self._finish_stop(leftover=alive)
            return
        gpu_left = await self._gpu_memory_left(b)
        if gpu_left and now - self._stop_mark < self.cfg.server.memory_release_timeout:
            return
        if gpu_left:
            log.error("gpu_memory_not_released", generation=self.generation, pids=gpu_left)
        await self._finish_stop()

    async def _gpu_memory_left(self, b: Backend) -> dict[int, float]:
        if not self.nvml.available:
            return {}
        used = await asyncio.to_thread(self.nvml.process_memory_mb)
        return {pid: mb for pid, mb in used.items() if pid in b.known_pids}

    async def _finish_stop(self, leftover: list[int] | None = None) -> None:
        b, t = self.backend, self.target
        assert b is not None and t is not None
        if b.proc is not None and b.proc.returncode is None and not leftover:
            await b.proc.wait()
        b.reap()
        # A grandchild can die after its parent and reach us (the subreaper) only now: keep
        # reaping this generation's pids for a while so no zombie outlives it.
        now = time.monotonic()
        self._reap_later.update({pid: now for pid in b.known_pids if pid != b.pid})
        await t.close()
        reason, cls = self._end_reason
        self.ledger.generation_ended(self.gen_row, reason, cls, t.completed)
        if self._recycle is not None:
            self.ledger.recycle_update(self._recycle.ledger_id, stopped_at=L.utcnow())
        log.info("generation_stopped", generation=self.generation, reason=reason, cls=cls,
                 served=t.completed, exit_code=b.returncode, stop_s=round(time.monotonic() - self._stop_mark, 2))
        nxt = self._after_stop
        if nxt == "exit":
            self._enter(State.EXITING)
        elif nxt == "hold" or (self.hold and nxt != "exit"):
            await self._enter_held()
        elif nxt == "backoff":
            delay = min(self.cfg.server.backoff_max, self.cfg.server.backoff_initial * 2 ** max(self._consecutive - 1, 0))
            self._enter(State.BACKOFF, delay)
        else:
            await self._start_generation()

    async def _step_backoff(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            await self._start_generation()

    async def _enter_held(self) -> None:
        await self.proxy.set_reject(f"held: {self.hold}")
        self._enter(State.HELD)

    async def _step_held(self) -> None:
        return None  # only `release` (a command) leaves this state

    # -- failures ------------------------------------------------------------------------------
    async def _fail(self, kind: str, exit_code: int | None, detail: str, cls: str = L.UNPLANNED) -> None:
        """Any unexpected end (exit 0 included) is a failure: record it, kill the group, back off."""
        rec = FailureRecord(kind=kind, at=L.utcnow(), exit_code=exit_code, detail=detail,
                            generation=self.generation)
        rec.ledger_id = self.ledger.failure(self.generation, kind, exit_code, detail, cls)
        self.failures.append(rec)
        self._unrestored.append(rec)
        log.error("generation_failed", generation=self.generation, kind=kind, exit_code=exit_code,
                  detail=detail, cls=cls)
        if self.target is not None:
            await self.proxy.stop_dispatch(self.target, dead=True)
        if self._recycle is not None:  # a recycle that ended in a failure is over
            self._recycle = None
        now = time.monotonic()
        self._failure_times.append(now)
        while self._failure_times and now - self._failure_times[0] > self.cfg.server.failure_window:
            self._failure_times.popleft()
        self._consecutive += 1
        self._end_reason = (kind, cls)
        if self._stop_requests:
            self._after_stop = "exit"
        elif self.hold:
            self._after_stop = "hold"
        elif len(self._failure_times) >= self.cfg.server.max_failures:
            log.error("failure_limit", failures=len(self._failure_times),
                      window_s=self.cfg.server.failure_window)
            self.exit_code = EXIT_FAILURE_LIMIT
            self._after_stop = "exit"
        else:
            self._after_stop = "backoff"
        await self._begin_stop(kill=True)

    # -- background checks of a serving generation --------------------------------------------
    def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()

    async def _probe_loop(self, b: Backend, t: Target) -> None:
        """Hang = probe timed out *and* the engine made no progress meanwhile (2 busy cores
        make a slow probe alone meaningless)."""
        assert self.http is not None
        p = self.cfg.probe
        misses = 0
        while True:
            await asyncio.sleep(p.interval)
            before = await b.progress(self.http)
            res = await b.probe(self.http, p.prompt, p.timeout)
            self.last_probe = {"at": L.utcnow(), "ok": res.ok, "latency_s": round(res.latency_s, 3),
                               "error": res.error or None}
            if res.ok:
                misses = 0
                continue
            after = await b.progress(self.http)
            moved = _progressed(before, after)
            if moved:  # it moved during the probe; is it still moving now?
                await asyncio.sleep(min(2.0, p.timeout / 2))
                moved = _progressed(after, await b.progress(self.http))
            log.warning("probe_failed", generation=b.generation, error=res.error, engine_progress=moved)
            if moved:
                misses = 0
                continue
            misses += 1
            if misses >= p.failures:
                self._hang = f"probe failed ({res.error}) and the engine made no progress"
                self.wake()
                return

    async def _memory_loop(self, b: Backend, t: Target) -> None:
        warm = self.cfg.recycle.memory_warmup_requests
        baseline: dict[str, Any] | None = None
        while True:
            cur = await asyncio.to_thread(self._memory_sample, b)
            if baseline is None and t.dispatched >= warm:
                baseline = cur  # after warm-up: allocator pools and caches have settled
            growth = {}
            if baseline is not None:
                growth = {
                    "rss_mb": round(cur["rss_mb"] - baseline["rss_mb"], 1),
                    "uss_mb": round(cur["uss_mb"] - baseline["uss_mb"], 1),
                    "gpu_mb": round(cur["gpu_mb"] - baseline["gpu_mb"], 1),
                }
            self.memory = {"baseline": baseline, "current": cur, "growth": growth,
                           "warmup_requests": warm}
            self.wake()
            end = time.monotonic() + self.cfg.recycle.memory_interval
            while (left := end - time.monotonic()) > 0:
                if baseline is None and t.dispatched >= warm:
                    break  # take the baseline as warm-up ends, not up to an interval later (a fast leak would hide in it)
                await asyncio.sleep(min(0.05, left))

    def _memory_sample(self, b: Backend) -> dict[str, Any]:
        per = b.memory()
        gpu = self.nvml.process_memory_mb()
        for pid, m in per.items():
            m["gpu_mb"] = round(gpu.get(pid, 0.0), 1)
            for k in ("rss_mb", "uss_mb", "swap_mb"):
                m[k] = round(m[k], 1)
        return {
            "at": L.utcnow(),
            "requests": self.target.dispatched if self.target else 0,
            "rss_mb": round(sum(m["rss_mb"] for m in per.values()), 1),
            "uss_mb": round(sum(m["uss_mb"] for m in per.values()), 1),
            "gpu_mb": round(sum(m["gpu_mb"] for m in per.values()), 1),
            "per_process": {str(pid): m for pid, m in per.items()},
        }

    # -- systemd and status --------------------------------------------------------------------
    def _reap_orphans(self) -> None:
        now = time.monotonic()
        for pid, since in list(self._reap_later.items()):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) our child: gone, or still with its parent
                done = 0 if psutil.pid_exists(pid) and now - since < 60 else pid
            if done:
                del self._reap_later[pid]

    def _heartbeat(self) -> None:
        if self._reap_later:
            self._reap_orphans()
        now = time.monotonic()
        overrun = self.deadline is not None and now > self.deadline + OVERRUN_GRACE_S
        if overrun and not self._overrun_logged:
            log.error("state_overrun", state=self.state.value, over_s=round(now - self.deadline, 1))
            self._overrun_logged = True
        if not overrun and self.notifier.watchdog_due(now):
            self.notifier.watchdog(now)
        if now - self._status_sent >= 2.0:
            self._send_status()

    def _status_line(self) -> str:
        t = self.target
        served = t.dispatched if t else 0
        hold = f" HELD({self.hold})" if self.hold else ""
        return (f"{self.state.value} gen={self.generation} served={served} in_flight={self.proxy.in_flight} "
                f"queued={self.proxy.queued} failures={len(self.failures)}{hold}")

    def _send_status(self, force: bool = False) -> None:
        self._status_sent = time.monotonic()
        self.notifier.status(self._status_line())

    def status(self) -> dict[str, Any]:
        t, b, c = self.target, self.backend, self.proxy.counters
        return {
            "state": self.state.value,
            "state_for_s": round(time.monotonic() - self.state_since, 1),
            "generation": self.generation,
            "requests_total": c.requests_total,
            "requests_generation": t.dispatched if t else 0,
            "requests_limit_generation": t.limit if t else None,
            "completed": c.completed,
            "in_flight": self.proxy.in_flight,
            "queued": self.proxy.queued,
            "failed_requests": c.failed_requests,
            "rejected_requests": c.rejected,
            "retried_requests": c.retried,
            "client_disconnects": c.client_disconnects,
            "failures": len(self.failures),
            "failure_log": [f.public() for f in self.failures],
            "recycles": [r.public() for r in self.recycles],
            "hold": self.hold,
            "backend_url": b.url if b and self.state in (State.SERVING, State.DRAINING, State.STARTING) else None,
            "children": b.children() if b and b.returncode is None else [],
            "memory": self.memory,
            "vllm_version": self.vllm_version,
            "gpu_name": self.gpu_name or None,
            "model": self.model,
            "ttft": self.proxy.ttft_quantiles(),
            "last_probe": self.last_probe,
            "patches": self._patch_states(),
            "pid": os.getpid(),
            "port": self.cfg.server.port,
        }

    async def _close(self) -> None:
        self._cancel_tasks()
        if self.backend is not None and self.backend.alive_pids():
            self.backend.signal_all(signal.SIGKILL)
            self.backend.reap()
        await self.proxy.stop()
        if self._admin is not None:
            await self._admin.cleanup()
        if self.http is not None:
            await self.http.close()
        self.ledger.close()
