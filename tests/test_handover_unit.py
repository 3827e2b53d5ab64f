"""The hand-over's parts in milliseconds to seconds, each the real thing: the keeper's lease (a
real keeper process and a real process group), the socket systemd hands over (a real listening
socket on fd 3), the record, and the reading of systemd's job list. The end-to-end upgrade under
load against real vLLM is tests/test_upgrade.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from vllm_guard.core.protocol import Command, CommandReply, CommandRequest, RuntimeState
from vllm_guard.runtime.commands import Commands, Stop
from vllm_guard.runtime.child import handover
from vllm_guard.runtime.child.keeper import Keeper, start_ticks
from vllm_guard.runtime.frontdoor import listen


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture()
def group() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in generation: a process leading its own group, with a child in it."""
    p = subprocess.Popen([sys.executable, "-c", "import subprocess,time;subprocess.Popen(['sleep','600']);"
                          "time.sleep(600)"], preexec_fn=os.setpgrp)
    time.sleep(0.3)
    yield p
    try:
        os.killpg(p.pid, 9)
    except OSError:
        pass
    p.wait()


def members(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid and alive(int(d.name)):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def keeper_for(p: subprocess.Popen[bytes]) -> Keeper:
    k = Keeper("test-handover")
    k.watch(p.pid)
    for pid in members(p.pid):
        k.process(p.pid, pid)
    return k


def test_a_lease_nobody_takes_ends_in_the_kill(group: subprocess.Popen[bytes]) -> None:
    k = keeper_for(group)
    assert len(members(group.pid)) == 2
    k.lease(1.0, "/nonexistent/handover-mark")
    k.detach()
    time.sleep(0.5)
    assert members(group.pid), "killed before its lease ran out"
    k.proc.wait(15)
    group.wait(5)
    end = time.monotonic() + 5
    while members(group.pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not members(group.pid)


def test_a_taken_lease_leaves_the_generation_running(group: subprocess.Popen[bytes], tmp_path: Path) -> None:
    k = keeper_for(group)
    mark = tmp_path / "adopted"
    k.lease(30.0, str(mark))
    k.detach()
    time.sleep(0.5)
    mark.touch()
    assert k.proc.wait(5) == 0
    assert not mark.exists(), "the mark is read once and removed"
    assert len(members(group.pid)) == 2, "the keeper killed a generation that was adopted"


def test_without_a_lease_eof_kills_at_once(group: subprocess.Popen[bytes]) -> None:
    k = keeper_for(group)
    k.detach()  # the runtime died: no lease line was sent
    k.proc.wait(10)
    group.wait(5)
    assert not [p for p in members(group.pid) if alive(p)]


# -- the socket systemd hands over (in a child process: fd 3 of the test process is not ours) ------
CHILD = """
import os, sys
from vllm_guard.core.errors import ConfigError
from vllm_guard.core.protocol import Command, CommandReply, CommandRequest, RuntimeState
from vllm_guard.runtime.commands import Commands, Stop
from vllm_guard.runtime.frontdoor import listen
fd = int(sys.argv[1])
if fd >= 0:
    os.dup2(fd, 3)
env = {"LISTEN_FDS": sys.argv[2], "LISTEN_PID": str(os.getpid())}
try:
    s = listen.inherited(env)
    print("none" if s is None else f"ok {listen.address(s)[1]} {s.get_inheritable()}")
except ConfigError as e:
    print(f"error {e}")
"""


def inherit(sock: socket.socket | None, count: str = "1") -> str:
    fds = (sock.fileno(),) if sock is not None else ()
    out = subprocess.run([sys.executable, "-c", CHILD, str(sock.fileno() if sock else -1), count],
                         pass_fds=fds, capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_no_variables_no_socket() -> None:
    assert listen.inherited({}) is None
    assert listen.inherited({"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}) is None  # another process's


def test_the_listening_socket_on_fd_3_is_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        assert inherit(s) == f"ok {s.getsockname()[1]} False"  # vLLM's processes do not inherit it


@pytest.mark.parametrize("count", ["2", "x"])
def test_anything_but_one_socket_is_a_config_error(count: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        assert inherit(s, count).startswith(f"error LISTEN_FDS has value '{count}'")


def test_a_socket_that_does_not_listen_is_a_config_error() -> None:
    with socket.socket() as s:
        assert "not a listening stream socket" in inherit(s)


# -- the record and systemd's job list ---------------------------------------------------------
def test_the_record_round_trips_once_and_a_bad_one_is_ignored(tmp_path: Path) -> None:
    me = handover.Proc(pid=os.getpid(), ticks=start_ticks(os.getpid()) or 0)
    g = handover.HandedGeneration(replica=0, generation=3, row=3, api=me, procs=[me], model="m", vllm_args=["--x"],
                                  host="", port=0, uds=None, log_path="/l", config_hash="abc", served=7)
    rec = handover.Record(state_dir=str(tmp_path), runtime_pid=1, written_at="t", lease_s=60, mark="/m",
                          generations=[g])
    handover.write(tmp_path, rec)
    assert handover.take(tmp_path) == rec
    assert handover.take(tmp_path) is None  # acted on once
    assert handover.holds(g) is None and handover.live_procs(g) == [os.getpid()]
    gone = g.model_copy(update={"api": handover.Proc(pid=me.pid, ticks=me.ticks + 1)})
    assert "is gone" in (handover.holds(gone) or "")
    handover.record_path(tmp_path).write_text('{"version": "vllm-guard-handover/9"}')
    assert handover.take(tmp_path) is None and not handover.record_path(tmp_path).exists()


def test_the_units_restart_job_is_read_from_systemds_list() -> None:
    jobs = "812 vllm-guard.service restart running\n813 other.service start waiting\n"
    assert handover.job_of("vllm-guard.service", jobs) == "restart"
    assert handover.job_of("other.service", jobs) == "start"
    assert handover.job_of("vllm-guard@a.service", jobs) is None
    assert handover.own_unit("0::/system.slice/vllm-guard@gpu0.service\n") == "vllm-guard@gpu0.service"
    assert handover.own_unit("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert not handover.systemd_restarting({})  # outside systemd: a stop is a stop


# -- the command and the signal ------------------------------------------------------------------
class StopRecorder:
    """The part of the supervisor `Commands` reaches for a stop or an upgrade."""

    def __init__(self, socket_from_systemd: bool) -> None:
        self.socket_from_systemd = socket_from_systemd
        self.stops: list[tuple[bool, bool]] = []
        self.drivers: list[object] = []
        self.hold = None

    state = RuntimeState.SERVING
    generation = 1

    def wake(self) -> None: ...

    def can_hand_over(self) -> bool:
        return self.socket_from_systemd

    def begin_stop(self, second: bool, hand_over: bool = False) -> None:
        self.stops.append((second, hand_over))


def _upgrade(rt: StopRecorder) -> CommandReply:
    return asyncio.run(Commands(rt).upgrade(CommandRequest(command=Command.UPGRADE)))  # type: ignore[arg-type]


def test_upgrade_is_refused_where_the_port_would_close_with_the_runtime() -> None:
    rt = StopRecorder(socket_from_systemd=False)
    reply = _upgrade(rt)
    assert not reply.accepted and "vllm-guard.socket" in reply.detail and rt.stops == []


def test_upgrade_hands_over_once() -> None:
    rt = StopRecorder(socket_from_systemd=True)
    cmds = Commands(rt)  # type: ignore[arg-type]
    first = asyncio.run(cmds.upgrade(CommandRequest(command=Command.UPGRADE)))
    again = asyncio.run(cmds.upgrade(CommandRequest(command=Command.UPGRADE)))
    assert first.accepted and "handing over" in first.detail and rt.stops == [(False, True)]
    assert not again.accepted and "already stopping" in again.detail


def test_sigterm_outside_systemd_is_a_plain_stop_even_on_a_handed_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    rt = StopRecorder(socket_from_systemd=True)
    cmds = Commands(rt)  # type: ignore[arg-type]

    async def two_signals() -> None:
        cmds.put(Stop("SIGTERM"))
        cmds.put(Stop("SIGTERM"))
        await cmds.handle()

    asyncio.run(two_signals())
    assert rt.stops == [(False, False), (True, False)]
