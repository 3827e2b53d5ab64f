"""The runtime's side of the admin socket (`<state dir>/admin.sock`): status and commands.

`GET /status` answers a `StatusSnapshot`; `POST /command` takes a `CommandRequest` and answers
the loop's `CommandReply` (200 accepted, 409 refused with the reason) or, for a body that is not
a valid request, 400 with one `ErrorReply` line. The socket is mode `[server] admin_mode` and
owned by `[server] admin_group`, so the watchdog (same group, no root) can act and nobody else
can. The client side is `core.admin`.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from vllm_guard.core.admin import socket_path
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.errors import ConfigError, ProtocolError
from vllm_guard.core.protocol import CommandReply, CommandRequest, ErrorReply, StatusSnapshot, decode

MAX_BODY = 64 * 1024
REPLY_TIMEOUT_S = 10.0


def _error(status: int, message: str) -> web.Response:
    return web.json_response(ErrorReply(error=message).model_dump(mode="json"), status=status)


async def start(state_dir: Path, cfg: ServerConfig, status: Callable[[], StatusSnapshot],
                submit: Callable[[CommandRequest, float], Awaitable[CommandReply]]) -> web.AppRunner:
    """Serve the admin API: `status` answers GET /status, `submit` takes commands to the loop;
    returns the runner (the supervisor cleans it up)."""
    app = web.Application(client_max_size=MAX_BODY)

    async def get_status(_: web.Request) -> web.Response:
        return web.json_response(status().to_json())

    async def command(request: web.Request) -> web.Response:
        try:
            data = json.loads(await request.read() or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"body is not JSON: {e}")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body larger than {MAX_BODY} bytes")
        try:
            req: CommandRequest = decode(CommandRequest, data)
            req.ledger_class()
        except ProtocolError as e:
            return _error(400, str(e))
        try:
            reply = await submit(req, REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(503, f"the runtime did not answer within {REPLY_TIMEOUT_S:.0f} s")
        return web.json_response(reply.model_dump(mode="json"), status=200 if reply.accepted else 409)

    app.router.add_get("/status", get_status)
    app.router.add_post("/command", command)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    path = socket_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    old = os.umask(0o177)  # never world-accessible, not even for an instant
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old)
    group = cfg.admin_group
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as e:
            await runner.cleanup()
            raise ConfigError(f"[server] admin_group has value {group!r}: no such group") from e
        # Under the unit the socket is born in its group (Group= is admin_group); chown only when it
        # is not: the unit's SystemCallFilter=~@privileged denies chown(2) with EPERM.
        if os.stat(path).st_gid != gid:
            try:
                os.chown(path, -1, gid)
            except PermissionError as e:
                await runner.cleanup()
                raise ConfigError(f"[server] admin_group has value {group!r}: the admin socket cannot be given that "
                                  f"group ({e.strerror}); make it the runtime's own group (the unit's Group=)") from e
    os.chmod(path, cfg.admin_mode)
    return runner
