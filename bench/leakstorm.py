"""Cancel, error and completion storms against a real vLLM OpenAI server, with per-process memory.

Shared by bench/bench_cancel_leak.py, bench/bench_host_growth.py and tests/test_cancel_leak.py:
one plain vLLM API server as a subprocess (our plugin loads in it as a general plugin; its
patches are switched by `VLLM_GUARD_PATCHES`), RSS and USS of the API server, EngineCore and
Worker by psutil, Theil-Sen slopes with their 95 % intervals (scipy).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROLES = ("api_server", "engine_core", "worker")
BAD_TEXT = "a\ud800b"  # a lone surrogate: valid JSON, passes vLLM's validation, not UTF-8 encodable


def long_model(src: Path, dst: Path, max_pos: int) -> Path:
    """A copy of the tiny model that accepts `max_pos` tokens (RoPE: the weights do not change)."""
    cfg = dst / "config.json"
    if cfg.exists() and json.loads(cfg.read_text())["max_position_embeddings"] == max_pos:
        return dst
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    data = json.loads(cfg.read_text())
    data["max_position_embeddings"] = max_pos
    cfg.write_text(json.dumps(data, indent=2))
    return dst


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def text_prompt(model: Path, tokens: int, seed: int) -> str:
    """Text that the model's tokenizer encodes to about `tokens` tokens (decoded random ids)."""
    tok = _tokenizer(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    text = tok.decode([rng.randrange(3, tok.get_vocab_size()) for _ in range(tokens)])
    ids = tok.encode(text).ids
    while len(ids) > tokens:  # decoding can merge into fewer tokens or split into more
        text = text[: int(len(text) * tokens / len(ids)) - 1]
        ids = tok.encode(text).ids
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` as a subprocess, with its state dir for the plugin."""

    name: str
    model: Path
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Path:
        return self.root / self.name

    def start(self) -> VllmServer:
        self.state.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
               "VLLM_GUARD_STATE_DIR": str(self.state), "VLLM_GUARD_GENERATION": "1", **self.env}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--port", str(self.port), *self.args]
        log = open(self.state / "vllm.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 900.0) -> None:
        import urllib.error
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vLLM exited {self.proc.returncode}; see {self.state / 'vllm.log'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name}: not ready after {timeout:.0f} s")

    def procs(self) -> dict[str, psutil.Process]:
        """The API server (our child), EngineCore and Worker (found by their process titles)."""
        assert self.proc is not None
        api = psutil.Process(self.proc.pid)
        out = {"api_server": api}
        for c in api.children(recursive=True):
            try:
                title = " ".join(c.cmdline()) or c.name()
            except psutil.Error:
                continue
            if "VLLM::EngineCore" in title:
                out["engine_core"] = c
            elif "VLLM::Worker" in title:
                out["worker"] = c
        return out

    def memory(self, roles: tuple[str, ...] = ROLES) -> dict[str, dict[str, int]]:
        """{role: {"rss": bytes, "uss": bytes}} for the roles that exist."""
        out: dict[str, dict[str, int]] = {}
        for role, p in self.procs().items():
            if role in roles:
                m = p.memory_full_info()
                out[role] = {"rss": int(m.rss), "uss": int(m.uss)}
        return out

    def metric(self, text: str, name: str, label: str = "") -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and label in line)

    async def metrics(self, s: aiohttp.ClientSession) -> str:
        async with s.get(self.url + "/metrics") as r:
            return await r.text()

    async def wait_idle(self, s: aiohttp.ClientSession, timeout: float = 300.0) -> None:
        """Until vLLM reports no running or waiting request (aborted prefills included)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = await self.metrics(s)
            if self.metric(text, "vllm:num_requests_running") + self.metric(text, "vllm:num_requests_waiting") == 0:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.name}: still busy after {timeout:.0f} s")

    def patch_report(self, role: str = "api_server") -> dict[str, Any]:
        """The plugin's report of one of the server's processes (every patch's state and counters)."""
        proc = self.procs().get(role)
        if proc is None:
            return {}
        f = self.state / "patches" / "gen-1" / f"{proc.pid}.json"
        return dict(json.loads(f.read_text())) if f.exists() else {}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def request_bytes(server: VllmServer, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return head + data


async def cancel_one(server: VllmServer, raw: bytes, delay: float) -> bool:
    """Send the whole request, wait `delay` s, then reset the connection; True if no reply came first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(raw)
        await writer.drain()
        try:
            got = await asyncio.wait_for(reader.read(1), timeout=delay)
        except asyncio.TimeoutError:
            got = b""
        return got == b""
    finally:
        writer.transport.abort()  # RST: the server sees the disconnect at once


async def post(s: aiohttp.ClientSession, server: VllmServer, body: dict[str, Any]) -> tuple[int, float]:
    """One request to the end; (status, seconds)."""
    t0 = time.perf_counter()
    async with s.post(server.url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, time.perf_counter() - t0


def theil_sen(x: list[float], y: list[float]) -> dict[str, float]:
    """Slope of y on x with its 95 % interval (Theil-Sen, scipy's Sen-based interval)."""
    from scipy.stats import theilslopes

    r = theilslopes(y, x, 0.95)
    return {"slope": float(r.slope), "lo": float(r.low_slope), "hi": float(r.high_slope), "n": len(x)}
