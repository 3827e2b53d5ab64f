"""Actions through the runtime's admin socket, and alerts to the optional hooks.

The alert command gets the incident as JSON on stdin (and VLLM_GUARD_ALERT_* variables); the
webhook gets it as a JSON POST. A failing hook is logged, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from vllm_guard.runtime import admin

from .base import Action, Finding

log = structlog.get_logger("vllm_guard.watchdog")


def reason_of(f: Finding) -> str:
    return f.kind.replace("_", "-")


async def act(state_dir: str | Path, action: Action, f: Finding) -> str:
    """Send the action; returns 'ok' or the error (never raises)."""
    body: dict[str, Any] = {"reason": reason_of(f)}
    if action is Action.RECYCLE:
        body["class"] = "preventive"
    elif action is Action.RESTART:
        body["class"] = "unplanned"
    try:
        await admin.request(state_dir, "POST", "/" + action.value, body)
        return "ok"
    except admin.AdminError as e:
        return f"error: {e}"


async def alert(command: str, webhook: str, payload: dict[str, Any], timeout: float = 10.0) -> None:
    text = json.dumps(payload, default=str)
    if command:
        env = {**os.environ, "VLLM_GUARD_ALERT_KIND": str(payload.get("kind")),
               "VLLM_GUARD_ALERT_CAUSE": str(payload.get("cause")), "VLLM_GUARD_ALERT_ACTION": str(payload.get("action"))}
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
