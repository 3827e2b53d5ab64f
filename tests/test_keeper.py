"""The keeper kills a dead runtime's vLLM processes by pid and start time, never by environment
(vLLM's setproctitle wipes /proc/PID/environ of EngineCore and workers), and never a stranger.

Real processes, no vLLM: a stand-in "runtime" starts the real keeper (runtime/child/keeper.py), a
process group like a generation's (a leader with a child and a grandchild whose environment is
emptied, as setproctitle leaves it), tells the keeper about the group, and is then SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from vllm_guard.runtime.child.keeper import Watch, start_ticks

# A stand-in runtime: starts the keeper, a "generation" (its own session: leader -> child ->
# grandchild, the descendants with an empty environment), tells the keeper the group only (not
# the descendants: the keeper must find them itself), prints the pids, then sleeps.
RUNTIME = textwrap.dedent("""
    import os, subprocess, sys, time
    from vllm_guard.runtime.child.keeper import Keeper
    keeper = Keeper("VLLM_GUARD_STATE_DIR=/nowhere")
    leaf = "import os,time; os.execve('/bin/sleep', ['sleep', '300'], {})"
    mid = ("import os,subprocess,sys,time; p = subprocess.Popen([sys.executable, '-c', %r], env={}); "
           "print(p.pid, flush=True); os.execve('/bin/sleep', ['sleep', '300'], {})" % leaf)
    lead = ("import subprocess,sys,time; p = subprocess.Popen([sys.executable, '-c', %r], env={}, "
            "stdout=sys.stdout); print(p.pid, flush=True); time.sleep(300)" % mid)
    gen = subprocess.Popen([sys.executable, "-c", lead], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child = int(gen.stdout.readline()); grandchild = int(gen.stdout.readline())
    keeper.watch(gen.pid)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    print(gen.pid, child, grandchild, stranger.pid, keeper.proc.pid, flush=True)
    time.sleep(300)
""")


def _alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkill_of_the_runtime_kills_every_process_of_its_generation_and_no_stranger() -> None:
    rt = subprocess.Popen([sys.executable, "-c", RUNTIME], stdout=subprocess.PIPE, text=True)
    try:
        assert rt.stdout is not None
        leader, child, grandchild, stranger, keeper = (int(x) for x in rt.stdout.readline().split())
        tree = {pid: psutil.Process(pid).create_time() for pid in (leader, child, grandchild)}
        # the descendants' environment is empty, as vLLM's renamed processes leave it
        assert Path(f"/proc/{grandchild}/environ").read_bytes() == b""
        time.sleep(1.2)  # the keeper looks at its groups twice a second
        rt.send_signal(signal.SIGKILL)
        rt.wait(10)
        end = time.monotonic() + 5
        while time.monotonic() < end and any(_alive(p, t) for p, t in tree.items()):
            time.sleep(0.05)
        left = [p for p, t in tree.items() if _alive(p, t)]
        assert not left, f"outlived the runtime by 5 s: {left}"
        assert psutil.pid_exists(stranger) and psutil.Process(stranger).status() != psutil.STATUS_ZOMBIE
        end = time.monotonic() + 10
        while time.monotonic() < end and psutil.pid_exists(keeper) and \
                psutil.Process(keeper).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        assert not psutil.pid_exists(keeper) or psutil.Process(keeper).status() == psutil.STATUS_ZOMBIE
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()
        subprocess.run(["pkill", "-KILL", "-f", "sleep 300"], check=False)


def test_a_group_whose_leader_is_gone_counts_only_through_a_remembered_member() -> None:
    """The API server dies with the runtime (its parent-death signal), so at EOF the group has no
    leader: its members are killed only if one of them is provably the generation's."""
    me = os.getpid()
    member = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        pgid = member.pid  # a group led by `member`; pretend its leader (another pid) is gone
        started = start_ticks(member.pid)
        assert started is not None
        w = Watch()
        w.line(f"+{pgid} {started - 1}")  # the "leader" is `member` with another start: not it
        assert w.scan(me) == []
        w.line(f"={pgid} {member.pid} {started}")  # told by the runtime: now provably ours
        assert w.scan(me) == [member.pid]
        w.line(f"-{pgid}")
        assert w.scan(me) == [] and not w.procs
    finally:
        member.kill()
        member.wait()


def test_malformed_lines_change_nothing() -> None:
    w = Watch()
    for line in ("", "+x", "=1 2", "-", "?", "+12 abc", "=a b c"):
        w.line(line)
    assert w.groups == {} and w.procs == {}
