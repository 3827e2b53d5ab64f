"""Processes of a vLLM generation: the tree and its roles, liveness, reaping, orphans.

Every function here reads /proc and may take milliseconds (a process-tree walk lists every
process on the box): the supervisor calls them through `asyncio.to_thread`, never on its loop.

The runtime is a child subreaper (PR_SET_CHILD_SUBREAPER), so an EngineCore orphaned by a dying
API server is reparented to it; `Reaper` collects such grandchildren, which may die after
their generation was stopped. A runtime that was killed cannot stop its vLLM; the next one finds
the tree through the ledger (pid and process start time of each open generation) and kills it
(`kill_recorded_tree`), after checking the start time so a reused pid is never touched.

Process identity is the keeper's rule (`keeper.same_process`: pid and start time in clock ticks
since boot, exactly): the ledger keeps the start as epoch seconds (`start_time`, what psutil's
create_time says), read back into ticks on the same boot clock before it is compared.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Iterable

import psutil

from vllm_guard.core.protocol import ChildProcess, Role

from .keeper import born_in, same_process, start_ticks

_PR_SET_CHILD_SUBREAPER = 36
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def become_subreaper() -> bool:
    """Orphaned grandchildren are reparented to this process (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def role_of(proc: psutil.Process, root_pid: int) -> Role:
    if proc.pid == root_pid:
        return Role.API_SERVER
    try:
        name = proc.name() + " " + " ".join(proc.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return Role.WORKER
    if "EngineCore" in name:
        return Role.ENGINE_CORE
    if "Worker" in name:
        return Role.WORKER
    return Role.HELPER  # e.g. multiprocessing's resource tracker: stopped with the rest, not listed


def tree(root_pid: int) -> list[ChildProcess]:
    """Every live (non-zombie) process under `root_pid`, itself included, with its role."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    out = []
    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out.append(ChildProcess(pid=p.pid, role=role_of(p, root_pid)))
    return out


def set_affinity(pids: Iterable[int], cpus: set[int], proc: str = "/proc") -> int:
    """Every thread of these processes may run on `cpus` (sched_setaffinity is per thread: a
    process's is its main thread's); how many threads took it. Gone ones are skipped."""
    moved = 0
    for pid in pids:
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                moved += 1
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return moved


def group_members(pgid: int) -> set[int]:
    out = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.add(p.pid)
        except OSError:
            continue
    return out


def alive(pids: Iterable[int], pgid: int | None = None) -> list[int]:
    """Which of `pids` (and of process group `pgid`) still exist, zombies excluded."""
    candidates = set(pids) | (group_members(pgid) if pgid else set())
    out = []
    for pid in candidates:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(out)


def dead(pids: Iterable[int]) -> int | None:
    """The first of `pids` that is gone or a zombie, else None."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        return pid
    return None


def signal_pids(pids: Iterable[int], sig: int, pgid: int | None = None) -> None:
    """Signal a process group and every pid given (never this process)."""
    if pgid:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap(pids: Iterable[int]) -> list[int]:
    """Collect the exit status of those of `pids` that are our (subreaper) children and done."""
    done = []
    for pid in pids:
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got:
            done.append(pid)
    return done


def start_time(pid: int) -> float | None:
    """`pid`'s start time as the ledger keeps it (epoch s: boot time + start ticks); None if gone."""
    ticks = start_ticks(pid)
    return None if ticks is None else psutil.boot_time() + ticks / CLOCK_TICKS


def ticks_of(started: float) -> int:
    """A recorded `start_time` back in clock ticks since boot (the keeper's identity)."""
    return round((started - psutil.boot_time()) * CLOCK_TICKS)


class Reaper:
    """Pids of stopped generations that may still die and reach us as orphans: reaped for a
    while so no zombie outlives its generation."""

    def __init__(self, give_up_s: float = 60.0) -> None:
        self.give_up_s = give_up_s
        self.later: dict[int, float] = {}  # pid -> since when (monotonic)

    def add(self, pids: Iterable[int], now: float) -> None:
        for pid in pids:
            self.later.setdefault(pid, now)

    def poll(self, now: float) -> None:
        """Blocking (/proc): call through asyncio.to_thread."""
        for pid, since in list(self.later.items()):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) our child: gone, or still with its parent
                done = 0 if psutil.pid_exists(pid) and now - since < self.give_up_s else pid
            if done:
                self.later.pop(pid, None)


def kill_recorded_tree(pid: int, started: float | None, timeout: float = 10.0) -> list[int]:
    """Kill the vLLM tree of a generation whose runtime died (its API server led its own process
    group). Only when `pid` still is that process (same start time). Returns the pids killed."""
    if started is None:
        return []
    known, now = ticks_of(started), start_ticks(pid)
    if now is None:
        # The API server is gone (its parent-death signal), its EngineCore and workers may not
        # be: the rest of its process group, every member started after it (`keeper.born_in`).
        members = {p for p in group_members(pid) if (t := start_ticks(p)) is not None and born_in(t, known)}
        if not members:
            return []
    elif not same_process(now, known):
        return []  # the pid was reused by something else
    else:
        try:
            members = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            members = {pid}
        members |= group_members(pid)
    signal_pids(members, signal.SIGKILL, pgid=pid)
    end = time.monotonic() + timeout
    while time.monotonic() < end and alive(members):
        reap(members)
        time.sleep(0.05)
    reap(members)
    return sorted(members)
