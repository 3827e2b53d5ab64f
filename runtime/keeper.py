"""The keeper: vLLM processes never outlive the runtime, even one killed with SIGKILL.

The API server is started with a parent-death signal (SIGKILL when the runtime dies, see
`backend`), but that signal is not inherited: vLLM's EngineCore and workers are its children and
have no such signal, so when a runtime is killed they would keep the GPU memory and serve
nothing. The keeper is a small process of the runtime's own (stdlib only, its own session) that
holds the read end of a pipe whose write end only the runtime holds. When the runtime dies for
any reason the pipe reaches EOF; the keeper then SIGKILLs every process of the process groups it
was told about (one per generation, led by its API server) that carries the runtime's state-dir
marker in its environment, and exits. A runtime that exits cleanly stops its generations first
and closes the pipe: the keeper finds nothing left.

Run as a script (`python -I -S keeper.py MARKER`); lines on stdin: `+PGID START_TIME` (watch the
group led by PGID, whose leader started at START_TIME, seconds since boot in /proc ticks) and
`-PGID` (forget it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time



def _stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time in clock ticks since boot) of `pid`, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[1].split()
    return int(fields[2]), int(fields[19])


def start_ticks(pid: int) -> int | None:
    st = _stat(pid)
    return None if st is None else st[1]


def _members(groups: dict[int, int | None], marker: bytes) -> list[int]:
    """Pids in the watched groups that carry the marker (never a stranger that reused a number)."""
    out = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None or st[0] not in groups:
            continue
        leader_start = groups[st[0]]
        if pid == st[0] and leader_start is not None and st[1] != leader_start:
            continue  # the leader's pid was reused by another process
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if marker in env:
            out.append(pid)
    return out


def main(marker: str) -> int:
    groups: dict[int, int | None] = {}
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").strip()
        try:
            if line.startswith("+"):
                pgid, _, start = line[1:].partition(" ")
                groups[int(pgid)] = int(start) if start.strip() else None
            elif line.startswith("-"):
                groups.pop(int(line[1:]), None)
        except ValueError:
            continue
    # EOF: the runtime is gone (or closed the pipe after stopping everything itself)
    mark = marker.encode()
    end = time.monotonic() + 5.0
    while groups and time.monotonic() < end:
        pids = _members(groups, mark)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    return 0


class Keeper:
    """The runtime's side: one keeper process per runtime, told about each generation."""

    def __init__(self, marker: str, python: str = sys.executable) -> None:
        self.marker = marker
        self.proc = subprocess.Popen(
            [python, "-I", "-S", os.path.abspath(__file__), marker], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)

    def _send(self, line: str) -> None:
        stdin = self.proc.stdin
        if stdin is None or self.proc.poll() is not None:
            return
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except OSError:
            pass

    def watch(self, pgid: int) -> None:
        ticks = start_ticks(pgid)
        self._send(f"+{pgid} {'' if ticks is None else ticks}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self, timeout: float = 10.0) -> None:
        """Close the pipe (the caller stopped every generation) and wait for the keeper."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
