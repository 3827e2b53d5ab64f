"""The keeper: vLLM processes never outlive the runtime, even one killed with SIGKILL.

The API server is started with a parent-death signal (SIGKILL when the runtime dies, see
`backend`), but that signal is not inherited: vLLM's EngineCore and workers are its children and
have no such signal, so when a runtime is killed they would keep the GPU memory and serve
nothing. The keeper is a small process of the runtime's own (stdlib only, its own session) that
holds the read end of a pipe whose write end only the runtime holds. When the runtime dies for
any reason the pipe reaches EOF; the keeper then SIGKILLs every process of the generations it
was told about, and exits. A runtime that exits cleanly stops its generations first and closes
the pipe: the keeper finds nothing left.

Which processes are a generation's is decided by process identity, never by environment: vLLM
renames EngineCore and its workers with `setproctitle`, which overwrites their environment area
(`/proc/PID/environ` reads as NUL bytes), so an environment marker finds only the API server. A
process is identified by its pid *and* its start time (clock ticks since boot, `/proc/PID/stat`
field 22), which together are never reused:
- the runtime tells the keeper each generation's process group (led by its API server) and every
  process of it that it sees (`backend.remember`);
- the keeper itself looks at the watched groups twice a second while the runtime lives and
  remembers every member it finds (so an EngineCore born a moment before the runtime died is
  known even if the runtime never saw it);
- at EOF it kills exactly the remembered processes whose start time still matches, and the
  members of each group that is provably still the generation's (its leader, or a remembered
  member, is still alive with the same start time) started no earlier than its leader.

A hand-over to the next runtime (`runtime/handover.py`) is the one exception, and it is explicit:
the runtime's last line before a clean exit is `!SECONDS PATH`. At EOF the keeper then waits up to
SECONDS for the next runtime to create PATH (it adopted the generations and its own keeper watches
them) and exits without killing; if PATH does not appear in time, it kills as above. A runtime
that is killed never sends that line, so its vLLM dies with it.

Run as a script (`python -I -S keeper.py MARKER`); lines on stdin: `+PGID START` (watch the
group led by PGID, whose leader started at START ticks), `=PGID PID START` (a process of that
group), `-PGID` (forget the group and its processes) and `!SECONDS PATH` (the hand-over lease).
MARKER names the runtime in `ps`.
Stdlib only and importing nothing of the project (`-I -S`): the identity rule lives here, and the
runtime's `procs` imports it from here.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

SCAN_S = 0.5
KILL_FOR_S = 5.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time in clock ticks since boot) of `pid`, None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[1].split()
    if fields[0] == b"Z":
        return None
    return int(fields[2]), int(fields[19])


def start_ticks(pid: int) -> int | None:
    """`pid`'s start time in clock ticks since boot; None if gone or a zombie."""
    st = _stat(pid)
    return None if st is None else st[1]


def same_process(ticks: int | None, known: int | None) -> bool:
    """The one identity rule (the runtime's `procs` applies it too): the process now at a pid is
    the one known there when its start ticks are the same, exactly; pid and start are never
    reused together within a boot."""
    return ticks is not None and ticks == known


def born_in(ticks: int, leader_ticks: int) -> bool:
    """A member of a generation's process group started no earlier than its leader (a group id
    is not reused while the group has members, so such a member is the generation's)."""
    return ticks >= leader_ticks


class Watch:
    """What the keeper knows: groups (pgid -> leader start) and processes ((pid, start) -> pgid)."""

    def __init__(self) -> None:
        self.groups: dict[int, int | None] = {}
        self.procs: dict[tuple[int, int], int] = {}
        self.lease: tuple[float, str] | None = None  # (seconds, path): a hand-over at EOF

    def line(self, text: str) -> None:
        """Apply one line of the runtime's (malformed lines are ignored)."""
        try:
            if text.startswith("+"):
                head, _, start = text[1:].partition(" ")
                self.groups[int(head)] = int(start) if start.strip() else None
            elif text.startswith("="):
                group, pid, ticks = (int(x) for x in text[1:].split())
                if group in self.groups:
                    self.procs[(pid, ticks)] = group
            elif text.startswith("!"):
                seconds, _, path = text[1:].partition(" ")
                if path.strip():
                    self.lease = (max(0.0, float(seconds)), path.strip())
            elif text.startswith("-"):
                gone = int(text[1:])
                self.groups.pop(gone, None)
                self.procs = {k: g for k, g in self.procs.items() if g != gone}
        except ValueError:
            return

    def scan(self, me: int) -> list[int]:
        """Every live process that is a watched generation's; remembers group members found.
        A group counts only while it is provably the generation's: its leader, or a process
        remembered in it, is alive with the same start time."""
        table: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != me:
                st = _stat(int(name))
                if st is not None:
                    table[int(name)] = st
        ours: set[int] = set()
        for (pid, start), pgid in self.procs.items():
            if pid in table and same_process(table[pid][1], start):
                ours.add(pid)
        for pgid, leader_start in self.groups.items():
            leader = table.get(pgid)
            proven = (leader is not None and same_process(leader[1], leader_start)) or any(
                g == pgid and p in ours for (p, _), g in self.procs.items())
            if not proven or leader_start is None:
                continue
            for pid, (group, start) in table.items():
                if group == pgid and born_in(start, leader_start):
                    ours.add(pid)
                    self.procs[(pid, start)] = pgid
        return sorted(ours)


def adopted(watch: Watch, me: int, seconds: float, path: str) -> bool:
    """A hand-over: wait up to `seconds` for the next runtime's mark at `path` (it adopted the
    generations), remembering group members meanwhile. False: nobody took them over in time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path):
            try:
                os.unlink(path)  # read once: nothing is left behind in the state dir
            except OSError:
                pass
            return True
        if watch.groups:
            watch.scan(me)
        time.sleep(0.1)
    return os.path.exists(path)


def main(marker: str) -> int:
    del marker  # only for `ps`: which runtime this keeper belongs to
    watch = Watch()
    me = os.getpid()
    fd = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], SCAN_S)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                watch.line(raw.decode(errors="replace").strip())
        elif watch.groups:
            watch.scan(me)
    # EOF: the runtime is gone (or closed the pipe after stopping everything itself)
    if watch.lease is not None and adopted(watch, me, *watch.lease):
        return 0
    end = time.monotonic() + KILL_FOR_S
    while watch.groups and time.monotonic() < end:
        pids = watch.scan(me)
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
        self._told: set[tuple[int, int]] = set()

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

    def process(self, pgid: int, pid: int) -> None:
        """A process of the generation led by `pgid` (told once per pid and start time)."""
        ticks = start_ticks(pid)
        if ticks is None or (pid, ticks) in self._told:
            return
        self._told.add((pid, ticks))
        self._send(f"={pgid} {pid} {ticks}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def lease(self, seconds: float, path: str) -> None:
        """A hand-over: at EOF wait up to `seconds` for `path` before killing (see the module)."""
        self._send(f"!{seconds:.1f} {path}")

    def detach(self) -> None:
        """Let this runtime exit while the keeper waits out its lease: close the pipe (EOF starts
        the lease), do not wait for the keeper."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

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
