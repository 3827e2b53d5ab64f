"""Admin API on a unix socket in the state dir: status, recycle, restart, hold, release.

The socket is mode 0660 and owned by a configurable group, so the watchdog (same group, no
root) can act, and nobody else can. Commands only enqueue into the supervisor's loop.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from .ledger import CLASSES, PREVENTIVE, SCHEDULED, UNPLANNED

if TYPE_CHECKING:
    from .supervisor import Supervisor

SOCKET_NAME = "admin.sock"
COMMANDS = ("recycle", "restart", "hold", "release")


class AdminError(RuntimeError):
    """The runtime could not be reached or refused the command."""


def socket_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


def _valid_class(command: str, cls: str | None) -> str | None:
    allowed = {"recycle": (SCHEDULED, PREVENTIVE), "restart": (UNPLANNED, SCHEDULED, PREVENTIVE)}
    if cls is None or command not in allowed:
        return None
    if cls not in allowed[command]:
        raise ValueError(f"class has value {cls!r}: {command} accepts {', '.join(allowed[command])}")
    return cls


async def start(sup: Supervisor) -> web.AppRunner:
    """Serve the admin API for `sup`; returns the runner (cleaned up with the loop)."""
    app = web.Application()

    async def status(_: web.Request) -> web.Response:
        return web.json_response(sup.status())

    async def command(request: web.Request) -> web.Response:
        name = request.match_info["cmd"]
        if name not in COMMANDS:
            return web.json_response({"error": f"unknown command {name!r}"}, status=404)
        try:
            args = await request.json() if request.can_read_body else {}
            if not isinstance(args, dict):
                raise ValueError("body must be a JSON object")
            cls = _valid_class(name, args.get("class"))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        payload = {"reason": str(args.get("reason") or "admin")}
        if cls:
            payload["class"] = cls
        sup.commands.put_nowait((name, payload))
        sup.wake()
        return web.json_response({"accepted": name, **payload, "state": sup.state.value,
                                  "generation": sup.generation})

    app.router.add_get("/status", status)
    app.router.add_post("/{cmd}", command)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    path = socket_path(sup.state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    old = os.umask(0o177)  # never world-accessible, not even for an instant
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old)
    group = sup.cfg.server.admin_group
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as e:
            raise ValueError(f"[server] admin_group has value {group!r}: no such group") from e
        os.chown(path, -1, gid)
    os.chmod(path, sup.cfg.server.admin_mode)
    return runner


async def request(state_dir: str | Path, method: str, path: str, body: dict[str, Any] | None = None,
                  timeout: float = 10.0) -> dict[str, Any]:
    """One admin call over the unix socket (used by the CLI and the watchdog)."""
    sock = socket_path(state_dir)
    if not sock.exists():
        raise AdminError(f"no runtime at {sock} (is `vllm-guard serve --state-dir {state_dir}` running?)")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            async with s.request(method, "http://guard" + path, json=body,
                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                data = await r.json(content_type=None)
                if r.status >= 400:
                    raise AdminError(str(data.get("error", data)))
                return data
    except PermissionError as e:
        raise AdminError(f"permission denied on {sock}: join its group or run as its owner") from e
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, PermissionError):
            raise AdminError(f"permission denied on {sock}: join its group or run as its owner") from e
        raise AdminError(f"cannot connect to {sock}: {e.os_error}") from e
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        raise AdminError(f"admin request to {sock} failed: {e}") from e


__all__ = ["AdminError", "CLASSES", "request", "socket_path", "start"]
