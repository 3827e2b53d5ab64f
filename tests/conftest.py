"""Shared fixtures: the embedded tiny model and a real guarded vLLM server as a subprocess."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from vllm_guard.core.admin import AdminError, fetch_status

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# The console script where a venv has it; `python -m vllm_guard.cli` elsewhere (the GPU box
# installs the project with `pip install --target`).
GUARD = str(VENV_BIN / "vllm-guard") if (VENV_BIN / "vllm-guard").exists() else None
GUARD_CMD = [GUARD] if GUARD else [sys.executable, "-m", "vllm_guard.cli"]
# vLLM on 2 CPU cores: small KV cache, eager mode, short context.
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16"]
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


# `make test` runs two xdist workers that take whole files in collection order (`--dist loadfile
# --no-loadscope-reorder`): the longest files go first so both workers finish near together.
LONGEST_FIRST = ["test_strategies_real.py", "test_failures.py", "test_recycle.py", "test_strategies.py",
                 "test_faults_guard.py", "test_resume_real.py", "test_lifecycle.py", "test_reload.py",
                 "test_patches_server.py", "test_fleet_haproxy.py", "test_soak_real.py", "test_watchdog_e2e.py",
                 "test_watchdog_replicas.py", "test_held_weights.py", "test_cancel_leak.py", "test_triggers.py", "test_typecheck.py",
                 "test_patches_unit.py", "test_gate_unit.py", "test_patches_plain.py", "test_watchdog_probe_key.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


class FreezeWitness:
    """Notes when this whole process was not scheduled for a while.

    The 2-core test box sometimes stops every process at once for 10-40 s (seen at the same
    instants in unrelated processes, with no memory pressure); a bound on how often the runtime
    does something cannot hold across such a pause. Tests subtract what this thread saw."""

    def __init__(self, tick: float = 0.05, least: float = 0.5) -> None:
        self.tick, self.least = tick, least
        self.freezes: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="freeze-witness", daemon=True)
        self._t.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            if now - last - self.tick >= self.least:
                self.freezes.append((last, now))
            last = now

    def frozen_within(self, a: float, b: float) -> float:
        """Seconds of [a, b] this process was frozen."""
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.freezes)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)


def event_mono(event: dict[str, Any]) -> float:
    """An event's wall-clock timestamp on this process's monotonic clock."""
    from datetime import datetime

    at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    return at - (time.time() - time.monotonic())


def loop_stalls(events: list[dict[str, Any]]) -> list[tuple[float, float, dict[str, Any]]]:
    """The runtime's own account of its event loop's stalls (runtime/loopwatch.py): (from, to)
    on this process's monotonic clock, and the event with `cpu_s` (the loop busy with code of
    its own), `asleep_s` (waiting in a call) and `starved_s` (not scheduled: the box)."""
    out = []
    for e in events:
        if e.get("event") == "event_loop_resumed":
            shift = time.time() - time.monotonic()  # the loop's own stamps, not the log line's time
            out.append((float(e["began"]) - shift, float(e["ended"]) - shift, e))
    return out


def within(windows: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of [a, b] covered by `windows`."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in windows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One VLLM_CACHE_ROOT for every vLLM this session starts.

    The runtime keeps vLLM's cache in each state dir, so in the field only a state dir's first
    generation pays for vLLM's model-class inspection (a subprocess that imports torch and vLLM
    again: ~20 s of CPU here). Every test has a fresh state dir, so without this every start in
    the suite paid it. The runtime only sets the variable where the environment has none.
    """
    old = os.environ.get("VLLM_CACHE_ROOT")
    path = old or str(tmp_path_factory.mktemp("vllm-cache"))
    os.environ["VLLM_CACHE_ROOT"] = path
    yield path
    if old is None:
        os.environ.pop("VLLM_CACHE_ROOT", None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded model, built once per session (or reused from VLLM_GUARD_TINY_MODEL)."""
    pre = os.environ.get("VLLM_GUARD_TINY_MODEL")
    out = Path(pre) if pre else tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([*GUARD_CMD, "model", "tiny", str(out)], check=True, capture_output=True)
    return str(out)


# fd N onto fd 3, LISTEN_PID = this pid, then exec the command (exec keeps the pid): sd_listen_fds(3)
_LISTEN_EXEC = ("import os,sys\n"
                "fd=int(sys.argv[1]);os.dup2(fd,3);os.close(fd)\n"
                "os.environ.update(LISTEN_PID=str(os.getpid()),LISTEN_FDS='1')\n"
                "os.execvp(sys.argv[2],sys.argv[2:])\n")


class GuardServer:
    """`vllm-guard serve` as a real subprocess; talks to it over HTTP and the admin socket."""

    def __init__(self, model: str, state_dir: Path, args: list[str] | None = None,
                 env: dict[str, str] | None = None, vllm_args: list[str] | None = None,
                 listen: socket.socket | None = None) -> None:
        self.model = model
        self.state_dir = state_dir
        # `listen`: a listening socket this test holds as systemd's vllm-guard.socket would, handed
        # to the runtime as fd 3 with LISTEN_FDS/LISTEN_PID (sd_listen_fds(3))
        self.listen = listen
        self.port = free_port() if listen is None else int(listen.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args or []
        self.env = {**os.environ, **CHILD_ENV, **(env or {})}
        self.vllm_args = VLLM_ARGS if vllm_args is None else vllm_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = state_dir / "guard.log"

    def start(self) -> GuardServer:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Tests written for the drain-stop-start recycle pin it; tests/test_strategies*.py choose.
        pin = [] if "--recycle-strategy" in self.args else ["--recycle-strategy", "cold"]
        # no load balancer in front of a test's box: no lead before a stop, unless the test asks for one
        cfg_text = Path(self.args[self.args.index("--config") + 1]).read_text() if "--config" in self.args else ""
        if "--unready-lead" not in self.args and "unready_lead" not in cfg_text:
            pin += ["--unready-lead", "0s"]
        # a standby doubles every start's CPU on this 2-core box: only the tests about it keep one
        if "--standby" not in self.args and "standby" not in cfg_text:
            pin += ["--standby", "off"]
        cmd = [*GUARD_CMD, "serve", "--model", self.model, "--port", str(self.port),
               "--state-dir", str(self.state_dir), *pin, *self.args, "--", *self.vllm_args]
        self.log = open(self.log_path, "ab")
        if self.listen is None:
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
            return self
        # the socket lands on fd 3 and LISTEN_PID is the runtime's own pid (exec keeps it), as systemd does
        fd = fcntl.fcntl(self.listen.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
        try:
            wrap = [sys.executable, "-S", "-c", _LISTEN_EXEC, str(fd)]
            self.proc = subprocess.Popen(wrap + cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                         pass_fds=(fd,))
        finally:
            os.close(fd)
        return self

    def status(self) -> dict[str, Any]:
        """What `vllm-guard status --json` prints, fetched over the admin socket in-process: the
        waits below poll twice a second, and a CLI process per poll (~0.6 s of CPU each) took
        half a core from the vLLM starts they wait for (tests/test_status_contract.py runs the CLI)."""
        try:
            return json.loads(json.dumps(asyncio.run(fetch_status(self.state_dir, 30.0)).to_json()))
        except AdminError as e:
            raise RuntimeError(str(e)) from e

    def admin(self, command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*GUARD_CMD, command, "--state-dir", str(self.state_dir), *extra],
                              capture_output=True, text=True, timeout=300)

    def wait_for(self, pred: Any, timeout: float = 300.0, what: str = "condition") -> dict[str, Any]:
        end = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"guard exited with {self.proc.returncode}; log:\n{self.tail()}")
            try:
                last = self.status()
                if pred(last):
                    return last
            except (RuntimeError, ValueError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what}; last status: {json.dumps(last)[:2000]}\n{self.tail()}")

    def wait_serving(self, generation: int = 1, timeout: float = 600.0) -> dict[str, Any]:
        return self.wait_for(lambda s: s["state"] == "serving" and s["generation"] >= generation,
                             timeout, f"generation {generation} serving")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        """The runtime's structlog JSON events so far."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def guard_factory(tiny_model: str, tmp_path: Path) -> Iterator[Any]:
    """Start guarded servers in a test; all are stopped at the end."""
    servers: list[GuardServer] = []

    def make(**kw: Any) -> GuardServer:
        s = GuardServer(tiny_model, tmp_path / f"state{len(servers)}", **kw)
        servers.append(s)
        return s.start()

    yield make
    for s in servers:
        s.stop()


def processes_of(state_dir: Path) -> list[int]:
    """Every live process on the box started for this state dir: the members of each
    generation's process group (led by its API server, pid and start time in the ledger) that
    started no earlier than it, and any process with the state dir in its environment.

    Not by environment alone: vLLM renames EngineCore and its workers with setproctitle, which
    overwrites their environment area (/proc/PID/environ reads as NUL bytes)."""
    import sqlite3

    import psutil

    groups: list[tuple[int, float]] = []
    db = state_dir / "ledger.sqlite"
    if db.exists():
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            groups = [(p, s) for p, s in conn.execute("SELECT pid, pid_started FROM generations") if p and s]
        finally:
            conn.close()
    needle = f"VLLM_GUARD_STATE_DIR={state_dir.resolve()}".encode()
    found = set()
    for proc in psutil.process_iter(["pid", "create_time", "status"]):
        pid = proc.info["pid"]
        if pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            pgid = os.getpgid(pid)
        except OSError:
            continue
        if any(pgid == g and proc.info["create_time"] >= started - 0.05 for g, started in groups):
            found.add(pid)
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.add(pid)
    return sorted(found)
