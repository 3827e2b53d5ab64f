"""Kernel messages: pure parsers for OOM and Xid lines, and three sources of lines.

Sources: `/dev/kmsg` (needs CAP_SYSLOG where kernel.dmesg_restrict=1), `journalctl -k -f`
(the systemd-journal group), or a file to replay. Parsers accept kmsg records
(`6,123,456,-;msg`), dmesg lines (`[  12.345] msg`), journal lines (`... kernel: msg`) and bare
messages, so fixtures are plain text copied from real machines.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

_KMSG = re.compile(r"^\d+,\d+,\d+,[^;]*;")
_DMESG = re.compile(r"^\[\s*\d+\.\d+\]\s?")
_JOURNAL = re.compile(r"^\w{3} +\d+ [\d:]+ \S+ kernel: ")
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
_KILLED = re.compile(r"(Memory cgroup )?[Oo]ut of memory: Killed process (\d+) \(([^)]*)\)")
_PID = re.compile(r"pid=(\d+)")


def message(line: str) -> str:
    """The kernel message without its kmsg / dmesg / journal prefix."""
    line = line.rstrip("\n")
    for pat in (_KMSG, _DMESG, _JOURNAL):
        m = pat.match(line)
        if m:
            return line[m.end():]
    return line


@dataclass(frozen=True)
class KernelEvent:
    """An Xid or OOM line, parsed. `type`: xid | oom_context (the `oom-kill:` line with the
    victim's memcg) | oom_killed (`Out of memory: Killed process N`)."""

    type: Literal["xid", "oom_context", "oom_killed"]
    line: str
    pid: int | None = None
    xid: int | None = None
    pci: str | None = None
    detail: str = ""
    task: str | None = None
    task_memcg: str | None = None
    oom_memcg: str | None = None
    constraint: str | None = None
    memcg_oom: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse(line: str) -> KernelEvent | None:
    """The event of an Xid or OOM line; None for anything else."""
    msg = message(line)
    m = _XID.search(msg)
    if m:
        pid = _PID.search(m.group(3))
        return KernelEvent("xid", msg, pid=int(pid.group(1)) if pid else None, xid=int(m.group(2)),
                           pci=m.group(1), detail=m.group(3))
    if "oom-kill:" in msg:
        fields = _kv(msg.split("oom-kill:", 1)[1])
        pid_text = fields.get("pid", "")
        return KernelEvent("oom_context", msg, pid=int(pid_text) if pid_text.isdigit() else None,
                           task=fields.get("task"), task_memcg=fields.get("task_memcg"),
                           oom_memcg=fields.get("oom_memcg"), constraint=fields.get("constraint"))
    m = _KILLED.search(msg)
    if m:
        return KernelEvent("oom_killed", msg, pid=int(m.group(2)), task=m.group(3), memcg_oom=bool(m.group(1)))
    return None


def _kv(text: str) -> dict[str, str]:
    """`a=1,b=(null),c=/x,y` -> dict; values may hold '/' but not ','."""
    out: dict[str, str] = {}
    for part in text.strip().split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


class KernelSource:
    """Base: `poll()` returns the new lines since the last call, never blocks."""

    name = "off"
    error = ""
    active = False  # True for a source that can deliver lines

    def poll(self) -> list[str]:
        return []

    def close(self) -> None:
        return None


class KmsgSource(KernelSource):
    name = "kmsg"
    active = True

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # PermissionError: dmesg_restrict
        os.lseek(self.fd, 0, os.SEEK_END)  # only what happens from now on

    def poll(self) -> list[str]:
        out = []
        while True:
            try:
                rec = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # ring buffer overran us: continue with what is there
                    continue
                raise
            if not rec:
                break
            out.append(rec.decode(errors="replace").split("\n", 1)[0])
        return out

    def close(self) -> None:
        os.close(self.fd)


class JournalSource(KernelSource):
    name = "journal"
    active = True

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["journalctl", "-k", "-f", "-n", "0", "-o", "cat"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = b""

    def poll(self) -> list[str]:
        assert self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"journalctl exited with {self.proc.returncode}")
        chunk = self.proc.stdout.read() or b""
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.decode(errors="replace") for ln in lines]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=5)


class FileSource(KernelSource):
    """Replay: hands out a kernel-log file's lines, `per_poll` at a time."""

    name = "replay"
    active = True

    def __init__(self, path: str | Path, per_poll: int = 1000) -> None:
        self.lines = Path(path).read_text().splitlines()
        self.pos = 0
        self.per_poll = per_poll

    def poll(self) -> list[str]:
        out = self.lines[self.pos:self.pos + self.per_poll]
        self.pos += len(out)
        return out


def open_source(kind: str) -> KernelSource:
    """`auto` tries /dev/kmsg then journalctl; failing both is one clear line, not an error."""
    if kind == "off":
        return KernelSource()
    if kind not in ("auto", "kmsg", "journal"):
        return FileSource(kind)
    errors = []
    if kind in ("auto", "kmsg"):
        try:
            return KmsgSource()
        except OSError as e:
            errors.append(f"/dev/kmsg: {e.strerror} (needs CAP_SYSLOG where kernel.dmesg_restrict=1)")
    if kind in ("auto", "journal"):
        try:
            return JournalSource()
        except OSError as e:
            errors.append(f"journalctl: {e.strerror}")
    src = KernelSource()
    src.error = "kernel messages unavailable: " + "; ".join(errors)
    return src
