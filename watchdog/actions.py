"""Actions through the runtime's admin socket, and alerts to the optional hooks.

Commands are typed `CommandRequest`s (`core.admin.send`); a command the runtime understood
but refused in its current state (`CommandRefused`, HTTP 409) is an outcome, not an error.
The alert command gets the incident as JSON on stdin (and VLLM_GUARD_ALERT_* variables); the
webhook gets it as a JSON POST. A failing hook is logged, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from vllm_guard.core import admin
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import Command, CommandRequest

from .base import Action, Finding

log = structlog.get_logger("vllm_guard.watchdog")

COMMANDS = {Action.RECYCLE: Command.RECYCLE, Action.RESTART: Command.RESTART, Action.HOLD: Command.HOLD}
CLASSES = {Action.RECYCLE: EndClass.PREVENTIVE, Action.RESTART: EndClass.UNPLANNED}


@dataclass(frozen=True)
class Outcome:
    result: str  # ok | refused | error
    detail: str = ""

    def __str__(self) -> str:
        return self.result if not self.detail else f"{self.result}: {self.detail}"


def reason_of(f: Finding) -> str:
    return f.kind.replace("_", "-")


def request_for(action: Action, f: Finding) -> CommandRequest:
    """The command for a finding: a recycle or restart goes to the finding's replica (None: all,
    rolling); a hold holds the whole runtime."""
    replica = f.replica if action in (Action.RECYCLE, Action.RESTART) else None
    return CommandRequest(command=COMMANDS[action], reason=reason_of(f), cls=CLASSES.get(action), replica=replica)


async def act(state_dir: str | Path, action: Action, f: Finding, timeout: float = 10.0) -> Outcome:
    """Send the action; never raises."""
    try:
        await admin.send(state_dir, request_for(action, f), timeout)
        return Outcome("ok")
    except admin.CommandRefused as e:
        return Outcome("refused", e.reply.detail)
    except admin.AdminError as e:
        return Outcome("error", str(e))


async def alert(command: str, webhook: str, payload: dict[str, Any], timeout: float = 10.0) -> None:
    text = json.dumps(payload, default=str)
    if command:
        env = {**os.environ, "VLLM_GUARD_ALERT_KIND": str(payload["kind"]),
               "VLLM_GUARD_ALERT_CAUSE": str(payload["cause"]), "VLLM_GUARD_ALERT_ACTION": str(payload["action"])}
        try:
            p = await asyncio.create_subprocess_shell(command, stdin=asyncio.subprocess.PIPE, env=env,
                                                      stdout=asyncio.subprocess.DEVNULL)
            await asyncio.wait_for(p.communicate(text.encode()), timeout)
            if p.returncode:
                log.warning("alert_command_failed", returncode=p.returncode)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("alert_command_failed", error=str(e))
    if webhook:
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(webhook, data=text, headers={"Content-Type": "application/json"},
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    if r.status >= 400:
                        log.warning("alert_webhook_failed", status=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("alert_webhook_failed", error=str(e))
