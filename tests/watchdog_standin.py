"""The runtime's side of the admin protocol on a real unix socket, for watchdog tests that
need no vLLM: `GET /status` answers a `core.protocol.StatusSnapshot`, `POST /command` decodes
a `CommandRequest`, records it and answers a `CommandReply` (409 and accepted=false when the
command does not apply, as the runtime does). The watchdog under test speaks to it through
`vllm_guard.core.admin`, exactly as it speaks to `vllm-guard serve`.

Hold moves it to HELD; recycle and restart are refused while held, or always with
`refuse=True` (a runtime that says no).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aiohttp import web

from vllm_guard.core.admin import socket_path
from vllm_guard.core.protocol import (
    Command, CommandReply, CommandRequest, ErrorReply, RuntimeState, StatusSnapshot, decode,
)
from vllm_guard.core.errors import ProtocolError


class StandInRuntime:
    def __init__(self, state_dir: Path, state: RuntimeState = RuntimeState.SERVING, generation: int = 3,
                 refuse: bool = False, **status: Any) -> None:
        self.state_dir = state_dir
        self.refuse = refuse
        self.received: list[CommandRequest] = []
        self.status = StatusSnapshot(state=state, state_for_s=1.0, generation=generation, pid=os.getpid(),
                                     port=0, model="stand-in", **status)
        self._runner: web.AppRunner | None = None

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self.status.to_json())

    async def _command(self, request: web.Request) -> web.Response:
        try:
            req: CommandRequest = decode(CommandRequest, await request.json())
        except ProtocolError as e:
            return web.json_response(ErrorReply(error=str(e)).model_dump(), status=400)
        self.received.append(req)
        held = self.status.state is RuntimeState.HELD
        if req.command is Command.HOLD:
            self.status = self.status.model_copy(update={"state": RuntimeState.HELD, "hold": req.reason})
            return self._reply(req, True, "held")
        if req.command is Command.RELEASE:
            self.status = self.status.model_copy(update={"state": RuntimeState.SERVING, "hold": None})
            return self._reply(req, True, "released")
        if self.refuse or held:
            return self._reply(req, False, "held" if held else "a recycle is already in progress")
        return self._reply(req, True, "queued")

    def _reply(self, req: CommandRequest, accepted: bool, detail: str) -> web.Response:
        reply = CommandReply(command=req.command, accepted=accepted, detail=detail, state=self.status.state,
                             generation=self.status.generation)
        return web.json_response(reply.model_dump(mode="json"), status=200 if accepted else 409)

    async def start(self) -> StandInRuntime:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/command", self._command)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        path = socket_path(self.state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        await web.UnixSite(self._runner, str(path)).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
