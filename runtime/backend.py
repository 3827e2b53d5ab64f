"""One vLLM generation as a child process group: spawn, inspect, probe, and stop it for good.

The child is `python -m vllm.entrypoints.openai.api_server` in a session of its own, so the
API server, EngineCore and workers share one process group that a single `killpg` reaches.
The runtime is a child subreaper (PR_SET_CHILD_SUBREAPER), so an EngineCore orphaned by a
dying API server is reparented to us, reaped by us, and never outlives its generation.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

API_SERVER, ENGINE_CORE, WORKER, HELPER = "api_server", "engine_core", "worker", "helper"
RUNTIME_OWNED_ARGS = ("--host", "--port", "--model")
PROBE_ID_PREFIX = "vllm-guard-probe-"
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned grandchildren are reparented to this process (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_owned_arg(args: list[str]) -> str | None:
    """The first runtime-owned flag in `args` (`--port 1` or `--port=1`), else None."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in RUNTIME_OWNED_ARGS:
            return a
    return None


def arg_value(args: list[str], flag: str) -> str | None:
    """Value of `flag` in a vLLM argument list (`--flag v` or `--flag=v`), last one wins."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def role_of(proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return API_SERVER
    try:
        name = proc.name() + " " + " ".join(proc.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return WORKER
    if "EngineCore" in name:
        return ENGINE_CORE
    if "Worker" in name:
        return WORKER
    return HELPER  # e.g. multiprocessing's resource tracker: stopped with the rest, not listed


@dataclass
class ProbeResult:
    ok: bool
    latency_s: float
    error: str = ""


@dataclass
class Backend:
    """A spawned vLLM API server and everything it started."""

    generation: int
    model: str
    host: str
    port: int
    vllm_args: list[str]
    log_path: Path
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    known_pids: set[int] = field(default_factory=set)
    started_mono: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def served_model_name(self) -> str:
        name = arg_value(self.vllm_args, "--served-model-name")
        return name.split(",")[0] if name else self.model

    @property
    def api_key(self) -> str | None:
        return arg_value(self.vllm_args, "--api-key") or self.env.get("VLLM_API_KEY")

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", self.host, "--port", str(self.port),
            *self.vllm_args,
        ]

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                env=self.env, start_new_session=True,
            )
        finally:
            log.close()
        self.started_mono = time.monotonic()
        self.known_pids.add(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def children(self, include_helpers: bool = False) -> list[dict[str, Any]]:
        """Every live process of this generation with its role; remembers pids for the stop."""
        if self.proc is None:
            return []
        out = []
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            self.known_pids.add(p.pid)
            role = role_of(p, self.proc.pid)
            if role != HELPER or include_helpers:
                out.append({"pid": p.pid, "role": role})
        return out

    def signal_all(self, sig: int) -> None:
        """Signal the process group and every pid ever seen in this generation."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in list(self.known_pids):
            try:
                p = psutil.Process(pid)
                if p.create_time() > 0 and pid != os.getpid():
                    p.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def reap(self) -> None:
        """Collect the exit status of reparented (subreaper) children of this generation."""
        for pid in list(self.known_pids):
            if self.proc is not None and pid == self.proc.pid:
                continue  # asyncio's child watcher owns the main pid
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def alive_pids(self) -> list[int]:
        """Pids of this generation that still exist (zombies excluded), group members included."""
        self.reap()
        alive = []
        candidates = set(self.known_pids)
        if self.proc is not None:
            for p in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(p.pid) == self.proc.pid:
                        candidates.add(p.pid)
                except (ProcessLookupError, PermissionError, OSError):
                    continue
        for pid in candidates:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        if self.proc is not None and self.proc.returncode is None and self.proc.pid not in alive:
            alive.append(self.proc.pid)
        return sorted(alive)

    def memory(self) -> dict[int, dict[str, Any]]:
        """RSS/USS/swap (MiB) of every child; USS and swap read smaps, so sample it slowly."""
        out: dict[int, dict[str, Any]] = {}
        for c in self.children(include_helpers=True):
            try:
                info = psutil.Process(c["pid"]).memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out[c["pid"]] = {
                "role": c["role"],
                "rss_mb": info.rss / 2**20,
                "uss_mb": getattr(info, "uss", 0) / 2**20,
                "swap_mb": getattr(info, "swap", 0) / 2**20,
            }
        return out

    def _headers(self) -> dict[str, str]:
        key = self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def health(self, session: aiohttp.ClientSession, timeout: float = 5.0) -> bool:
        try:
            async with session.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def probe(self, session: aiohttp.ClientSession, prompt: str, timeout: float) -> ProbeResult:
        """A real 1-token completion; the only proof that the engine still works."""
        t0 = time.monotonic()
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        # vLLM takes X-Request-Id into the engine's request id: the plugin and the injector know
        # a probe by it, so probes never count toward limits or injected faults.
        headers = {**self._headers(), "X-Request-Id": f"{PROBE_ID_PREFIX}{uuid.uuid4().hex}"}
        try:
            async with session.post(
                self.url + "/v1/completions", json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                text = await r.text()
                if r.status != 200:
                    return ProbeResult(False, time.monotonic() - t0, f"HTTP {r.status}: {text[:200]}")
                return ProbeResult(True, time.monotonic() - t0)
        except asyncio.TimeoutError:
            return ProbeResult(False, time.monotonic() - t0, f"timeout after {timeout:.1f}s")
        except (aiohttp.ClientError, OSError) as e:
            return ProbeResult(False, time.monotonic() - t0, f"{type(e).__name__}: {e}")

    async def progress(self, session: aiohttp.ClientSession, timeout: float = 5.0) -> dict[str, float] | None:
        """Engine progress counters from /metrics; None when the scrape fails."""
        try:
            async with session.get(
                self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        return parse_progress(text)


def parse_progress(text: str) -> dict[str, float]:
    """Sum the counters that prove the engine moves (pure; tested on literal text)."""
    want = {
        "vllm:generation_tokens": "generation_tokens",
        "vllm:prompt_tokens": "prompt_tokens",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
    }
    out = {v: 0.0 for v in want.values()}
    for fam in text_string_to_metric_families(text):
        key = want.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            if s.name.endswith(("_created",)):
                continue
            out[key] += float(s.value)
    return out
