"""A replica's weight holder, seen from the runtime: start it, ask it, drop its copy, stop it.

The holder (`patches.holder`, the contract in `core.holder`) belongs to the replica, not to a
generation: it is started before the replica's first generation that uses it and stopped after
the last one is gone. Its own process group and session, so a signal meant for a generation
never reaches it; it exits by itself when this runtime is gone and no new one adopts it within
`LEASE_S` (a hand-over passes its socket, key and pid on, like the generation's).

Only control messages here (JSON over the socket): the runtime never imports torch.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from multiprocessing.connection import Client
from pathlib import Path

import structlog

from vllm_guard.core import holder as contract
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.protocol import HolderStatus

log = structlog.get_logger("vllm_guard.supervisor")

START_TIMEOUT_S = 120.0  # torch's import on a cold page cache
STOP_TIMEOUT_S = 10.0


class HolderProcess:
    """One replica's holder: a child process and its last known state."""

    def __init__(self, replica: int, state_dir: Path, python: str, env: dict[str, str], device: str) -> None:
        self.replica, self.state_dir, self.python, self.device = replica, state_dir, python, device
        self.env = env
        self.path = state_dir / f"holder-{replica}.sock"
        self.key = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.last: contract.HolderState | None = None
        self.error = ""
        self.restarts = 0  # copies dropped (a restart each)
        self.last_drop = ""

    # -- the generation's side ------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """What a generation needs to find it (`patches.held`)."""
        return {contract.HOLDER_VAR: str(self.path), contract.HOLDER_KEY_VAR: self.key}

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start it (not waiting: the first engine that wants it connects when it loads)."""
        self._spawn()

    async def ensure(self) -> bool:
        """Started and answering (start it if it is not); False: generations load from disk."""
        if self.alive and self.last is not None:
            return True
        if not self.alive:
            self._spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.alive:
                self.error = f"the holder exited ({self.proc.returncode if self.proc else '?'}); see its log"
                log.error("holder_failed", replica=self.replica, error=self.error, log=str(self._log_path()))
                return False
            if await self.stat() is not None:
                log.info("holder_ready", replica=self.replica, pid=self.pid, device=self.device, socket=str(self.path))
                return True
            await asyncio.sleep(0.2)
        self.error = f"the holder did not answer within {START_TIMEOUT_S:.0f} s"
        return False

    def _log_path(self) -> Path:
        return self.state_dir / "logs" / f"holder-{self.replica}.log"

    def _spawn(self) -> None:
        self.path.unlink(missing_ok=True)  # a generation waiting for the socket waits for this process
        self._log_path().parent.mkdir(parents=True, exist_ok=True)
        env = {**self.env, contract.HOLDER_KEY_VAR: self.key}
        with open(self._log_path(), "ab") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", "vllm_guard.patches.holder", "--socket", str(self.path), "--device", self.device],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid, self.last = self.proc.pid, None
        log.info("holder_starting", replica=self.replica, pid=self.pid, device=self.device)

    def adopt(self, pid: int, key: str) -> None:
        """A previous runtime's holder (a hand-over): the same socket, its key and pid."""
        self.pid, self.key, self.proc = pid, key, None

    async def stop(self) -> None:
        """After the replica's last generation: its memory goes back."""
        pid = self.pid
        if pid is None or not self.alive:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.alive and time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()
            await asyncio.sleep(0.05)
        if self.alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            await asyncio.to_thread(self.proc.wait)
        self.path.unlink(missing_ok=True)
        log.info("holder_stopped", replica=self.replica, pid=pid)

    # -- control ------------------------------------------------------------------------------
    def _ask(self, req: contract.HolderRequest) -> contract.HolderReply:
        conn = Client(str(self.path), family="AF_UNIX", authkey=bytes.fromhex(self.key))
        try:
            conn.send_bytes(contract.write(req))
            if not conn.poll(30.0):
                raise TimeoutError("the holder did not answer within 30 s")
            return contract.read(contract.HolderReply, conn.recv_bytes())
        finally:
            conn.close()

    async def ask(self, req: contract.HolderRequest) -> contract.HolderReply | None:
        try:
            reply = await asyncio.to_thread(self._ask, req)
        except (OSError, EOFError, TimeoutError, ProtocolError) as e:
            self.error = f"{type(e).__name__}: {e}"
            return None
        self.last, self.error = reply.state, ""
        return reply

    async def stat(self) -> contract.HolderState | None:
        reply = await self.ask(contract.HolderRequest(op=contract.Op.STAT))
        return reply.state if reply is not None else None

    async def retire(self) -> bool:
        """Ask it to hand nothing out from now on; refused while a live engine maps its copy."""
        reply = await self.ask(contract.HolderRequest(op=contract.Op.RETIRE))
        return reply is not None and reply.ok

    async def restart(self, reason: str) -> None:
        """Drop the held copy: a fresh holder on the same socket with the same key (generations
        already given its address find the new one). Only after `retire` said yes (or it is dead)."""
        before = self.last
        await self.stop()
        self.restarts += 1
        self.last_drop = reason
        self._spawn()
        log.warning("holder_dropped", replica=self.replica, reason=reason, pid=self.pid,
                    freed_bytes=before.bytes if before is not None else None)

    async def take_over(self, owner: int) -> bool:
        """ADOPT: this runtime (`owner`) is the one the holder follows now."""
        return await self.ask(contract.HolderRequest(op=contract.Op.ADOPT, owner=owner)) is not None

    def status(self, pending: str = "") -> HolderStatus:
        s = self.last
        base = HolderStatus(pid=self.pid, alive=self.alive, drops=self.restarts, last_drop=self.last_drop,
                            pending_drop=pending, error=self.error)
        if s is None:
            return base
        return base.model_copy(update={"state": s.state, "tensors": s.tensors, "bytes": s.bytes,
                                       "handed": s.handed, "stale": s.stale, "kv_bytes": s.kv_bytes,
                                       "kv_mappers": list(s.kv_mappers)})


