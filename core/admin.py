"""The client side of the admin socket (`<state dir>/admin.sock`): status and commands.

Used by the CLI, the watchdog and the load generator; the runtime serves the other side.
HTTP over a unix socket: `GET /status` -> StatusSnapshot, `POST /command` with a
CommandRequest -> CommandReply (409 when the command does not apply in the current state).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from .errors import GuardError, ProtocolError
from .protocol import CommandReply, CommandRequest, ErrorReply, StatusSnapshot, decode

SOCKET_NAME = "admin.sock"


class AdminError(GuardError):
    """The runtime could not be reached, refused the command, or answered nonsense."""


class CommandRefused(AdminError):
    """The runtime understood the command but it does not apply now (e.g. recycle while held)."""

    def __init__(self, reply: CommandReply) -> None:
        super().__init__(f"{reply.command.value} refused: {reply.detail} (state {reply.state.value}, "
                         f"generation {reply.generation})")
        self.reply = reply


def socket_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


async def _call(state_dir: str | Path, method: str, path: str, body: dict[str, Any] | None,
                timeout: float) -> tuple[int, Any]:
    import aiohttp

    sock = socket_path(state_dir)
    if not sock.exists():
        raise AdminError(f"no runtime at {sock} (is `vllm-guard serve --state-dir {state_dir}` running?)")
    denied = f"permission denied on {sock}: join its group or run as its owner"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            async with s.request(method, "http://guard" + path, json=body,
                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status, await r.json(content_type=None)
    except PermissionError as e:
        raise AdminError(denied) from e
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, PermissionError):
            raise AdminError(denied) from e
        raise AdminError(f"cannot connect to {sock}: {e.os_error}") from e
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        raise AdminError(f"admin request to {sock} failed: {type(e).__name__}: {e}") from e


async def fetch_status(state_dir: str | Path, timeout: float = 10.0) -> StatusSnapshot:
    status, data = await _call(state_dir, "GET", "/status", None, timeout)
    if status != 200:
        raise AdminError(f"status: HTTP {status}: {data}")
    try:
        return StatusSnapshot.from_json(data)
    except ProtocolError as e:
        raise AdminError(str(e)) from e


async def send(state_dir: str | Path, request: CommandRequest, timeout: float = 10.0) -> CommandReply:
    """Send a command; CommandRefused when it does not apply now, AdminError otherwise."""
    status, data = await _call(state_dir, "POST", "/command", request.model_dump(mode="json"), timeout)
    try:
        if status in (200, 409):
            reply: CommandReply = decode(CommandReply, data)
            if not reply.accepted:
                raise CommandRefused(reply)
            return reply
        err: ErrorReply = decode(ErrorReply, data)
    except ProtocolError as e:
        raise AdminError(f"{request.command.value}: HTTP {status}: {e}") from e
    raise AdminError(f"{request.command.value}: {err.error}")
