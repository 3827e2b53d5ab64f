"""Reading Python's faulthandler dumps: which fatal signal, and the frame it hit.

A vLLM process (or the runtime's attention probe) killed by SIGILL, SIGSEGV, SIGBUS, SIGFPE or
SIGABRT with PYTHONFAULTHANDLER=1 writes "Fatal Python error: Illegal instruction", then each
thread's frames, innermost first, the crashed one headed "Current thread ...". The frame that
names the cause is the innermost of the crashed thread that is not torch's op dispatch
(`torch/_ops.py` `__call__` calls every custom op); where a kernel's own OpenMP thread crashed,
the caller of the op that thread was running for. Pure: lines in, a `Dump` out; used by
`runtime.child.death` (a generation's log) and `core.attn_isa` (the probe's stderr).
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from typing import Sequence

# faulthandler's words for the fatal signals
SIGNALS = {"Illegal instruction": "SIGILL", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
           "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE", "Aborted": "SIGABRT"}
DISPATCH = ("torch/_ops.py",)  # frames that only pass a call on: the caller names the op
LOOK_AHEAD = 400  # lines of a dump read after its first

_FATAL = re.compile(r"^Fatal Python error: (?P<what>.+)$")
_CURRENT = re.compile(r"^(?:Current thread 0x[0-9a-fA-F]+.*?|Stack) \(most recent call first\):")
_THREAD = re.compile(r"^Thread 0x[0-9a-fA-F]+.*? \(most recent call first\):")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(frozen=True)
class Dump:
    error: str  # "Fatal Python error: Illegal instruction"
    frame: str  # "vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache"; "" when none was printed
    signal: str | None  # SIGILL, ... (None: a fatal error that is not a signal)


def signal_name(code: int | None) -> str | None:
    """The signal a negative exit code (Python's `returncode`, multiprocessing's `exitcode`) names."""
    if code is None or code >= 0:
        return None
    try:
        return _signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def short_path(path: str) -> str:
    """A frame's file as a reader knows it: from the package dir (vllm/_custom_ops.py)."""
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            return path.rsplit(mark, 1)[1]
    i = path.rfind("/vllm/")
    return path[i + 1:] if i >= 0 else path


def first_dump(lines: Sequence[str]) -> Dump | None:
    """The first dump in `lines` (prefixes such as vLLM's "(Worker pid=9) " already removed),
    else None. Its frame is the innermost non-dispatch frame of the thread that crashed. A kernel
    that crashes in one of its OpenMP threads crashes in a thread Python does not know (no
    "Current thread", or one with "<no Python frame>"): then the frame is the op's caller in the
    thread that is inside a custom op (it passed through torch's dispatch), else the first
    thread's innermost frame."""
    for i, text in enumerate(lines):
        m = _FATAL.match(text.strip())
        if m is None:
            continue
        threads: list[tuple[bool, list[str], bool]] = []  # (crashed, frames, inside an op)
        for nxt in lines[i + 1:i + LOOK_AHEAD]:
            t = nxt.strip()
            if _FATAL.match(t) or (threads and t.startswith("Extension modules")):
                break  # the next dump, or the end of this one
            if _CURRENT.match(t) or _THREAD.match(t):
                threads.append((_CURRENT.match(t) is not None, [], False))
                continue
            f = _FRAME.match(nxt)
            if f is None or not threads:
                continue
            crashed, frames, in_op = threads[-1]
            path = short_path(f.group("path"))
            if path in DISPATCH:
                threads[-1] = (crashed, frames, in_op or not frames)
                continue
            frames.append(f"{path}:{f.group('line')} {f.group('func')}")
        what = m.group("what").strip()
        return Dump(f"Fatal Python error: {what}", _cause(threads), SIGNALS.get(what))
    return None


def _cause(threads: list[tuple[bool, list[str], bool]]) -> str:
    crashed = [frames for cur, frames, _ in threads if cur]
    if crashed and crashed[0]:
        return crashed[0][0]
    in_op = [frames for cur, frames, op in threads if op and frames and not cur]
    if in_op:
        return in_op[0][0]
    listed = [frames for _, frames, _ in threads if frames]
    return listed[0][0] if listed and not crashed else ""
