"""How the runtime comes up and goes down, around the supervisor's loop.

Up: become the subreaper of our grandchildren, route signals into the command queue, open NVML
off the loop, plan the replicas (their GPUs), kill the vLLM trees a killed predecessor left (the
ledger has their pids and start times), close its open generations, then the proxy, the admin
socket and the status monitor, and start every replica.
Down — on every way out, an exception included: no vLLM process of ours survives, then the rest
is closed and the ledger flushed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog

from vllm_guard.core.ledger import FailureKind
from vllm_guard.core.protocol import Command, CommandRequest

from . import metrics, monitors, procs
from .commands import Stop
from .ledger import RuntimeLedger
from .status import visible_gpu_name

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = structlog.get_logger("vllm_guard.supervisor")

KEEP_LOGS = 20


async def open_runtime(sup: Supervisor, admin_start: Callable[[Supervisor], Awaitable[Any]] | None) -> None:
    import aiohttp

    from vllm_guard.core.nvml import NvmlSession

    procs.become_subreaper()
    install_signals(sup)
    sup.http = aiohttp.ClientSession()
    sup.nvml = await asyncio.to_thread(NvmlSession)
    sup.gpu_name = visible_gpu_name(sup.nvml, os.environ)
    plan_replicas(sup)
    orphans = await kill_orphans(sup.ledger)
    sup.ledger.close_open_generations(FailureKind.RUNTIME_LOST.value)
    await sup.proxy.start()
    if admin_start is not None:
        sup.admin = await admin_start(sup)  # keep a reference: a dropped runner closes
    metrics.start(sup)  # the runtime's Prometheus metrics ([server] metrics_port; 0: off)
    sup.tasks.append(asyncio.create_task(monitors.guarded("status", 0, lambda: monitors.status_loop(
        sup.live_generations, sup.state_dir, sup.wake))))
    log.info("runtime_started", port=sup.cfg.server.port, state_dir=str(sup.state_dir), model=sup.model,
             gpu=sup.gpu_name or None, hold=sup.hold, next_generation=sup.last_number + 1, orphans_killed=orphans,
             replicas=len(sup.replicas), recycle_strategy=sup.cfg.server.recycle_strategy)
    await sup.start_all()


def plan_replicas(sup: Supervisor) -> None:
    """One `Replica` per GPU (or TP group) of `[server] gpus`, or `[server] replicas` of them;
    ConfigError when the settings and this machine's GPUs disagree."""
    from .replica import Replica
    from .replicas import plan

    static = sup.nvml.static if sup.nvml is not None and sup.nvml.available else []
    sup.replicas = [Replica(sup, p) for p in plan(sup.cfg, static, os.environ)]
    for rep in sup.replicas:
        rep.gpu_name = visible_gpu_name(sup.nvml, {**os.environ, **rep.plan.env()})


def install_signals(sup: Supervisor) -> None:
    """Signal handlers only enqueue (gunicorn): the loop decides."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sup.commands.put, Stop(sig.name))
    loop.add_signal_handler(signal.SIGHUP, sup.commands.put, CommandRequest(command=Command.RECYCLE, reason="sighup"))


async def kill_orphans(ledger: RuntimeLedger) -> list[int]:
    """The vLLM trees of generations a killed runtime left running: killed before anything
    else starts (a pid whose start time differs from the recorded one is left alone)."""
    try:
        left = ledger.open_generations()
    except sqlite3.Error as e:  # an unreadable ledger must not keep the service down
        log.error("ledger_read_failed", error=f"{type(e).__name__}: {e}")
        return []
    killed: list[int] = []
    for g in left:
        pids = await asyncio.to_thread(procs.kill_recorded_tree, g.pid, g.pid_started) if g.pid else []
        if pids:
            log.warning("orphan_generation_killed", generation=g.generation, pids=pids)
        killed += pids
    return killed


async def close_runtime(sup: Supervisor) -> None:
    """Every way out: no vLLM process of ours survives, then the rest is closed."""
    for task in sup.tasks:
        task.cancel()
    for rep in sup.replicas:
        await rep.kill_for_good()
    await sup.proxy.stop()
    if sup.admin is not None:
        await sup.admin.cleanup()
    if sup.http is not None:
        await sup.http.close()
    if sup.nvml is not None:
        sup.nvml.close()
    await asyncio.to_thread(sup.ledger.close)


def prune_logs(logs: Path) -> None:
    """Keep the last KEEP_LOGS generation logs."""
    old = sorted(logs.glob("generation-*.log"), key=lambda p: p.stat().st_mtime)[:-KEEP_LOGS]
    for p in old:
        p.unlink(missing_ok=True)
