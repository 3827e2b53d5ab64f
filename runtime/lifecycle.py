"""How the runtime comes up and goes down, around the supervisor's loop: the steps that need
no supervisor state — signals into the command queue, and the vLLM trees a killed predecessor
left (the ledger has their pids and start times). `Supervisor._open` / `_close` run them.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from typing import Callable

import structlog

from vllm_guard.core.protocol import Command, CommandRequest

from .child import procs
from .commands import Stop
from .records.writer import RuntimeLedger

log = structlog.get_logger("vllm_guard.supervisor")


def install_signals(put: Callable[[CommandRequest | Stop], None]) -> None:
    """Signal handlers only enqueue (gunicorn): the loop decides."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, put, Stop(sig.name))
    # SIGHUP (`systemctl reload`): re-read guard.toml and apply it through a recycle
    loop.add_signal_handler(signal.SIGHUP, put, CommandRequest(command=Command.RELOAD, reason="sighup"))


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
