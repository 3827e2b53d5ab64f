"""Why a generation that never served died: one typed cause from its log and its exit.

On vLLM-CPU the process that dies is seldom the API server: a worker (`VLLM::Worker`) or
EngineCore dies — of SIGILL on a CPU without an instruction its kernels use, of SIGSEGV, of the
OOM killer's SIGKILL, of an exception — and the API server then exits by itself, often with 0 or
1. The most specific account is in the generation's log, so it is read from there:
- which process died, and how: vLLM's own line for it ("Worker proc VllmWorker-0 died
  unexpectedly (exit code: -4)", "Failed core proc(s): {'EngineCore_DP0': -4}", "engine core
  exited unexpectedly"), else the API server's own exit (a negative return code is a signal);
- the first error line: faulthandler's "Fatal Python error: Illegal instruction" with the top frame
  of its current thread (vLLM runs with PYTHONFAULTHANDLER=1), else the first Python exception line
  that is not a wrapper pointing elsewhere ("See root cause above"), else the first vLLM ERROR line
  that is not one.

`read` is pure (text in, `Death` out) and tested on literal logs (tests/test_start_failure_unit.py);
`same_cause` is the rule that makes two deaths one deterministic start failure: the same process,
signal or exit code, phase, error line (numbers aside) and frame, and a cause the log names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_guard.core.fatal import first_dump, signal_name
from vllm_guard.core.protocol import Role

ERROR_MAX = 300  # the error part of the line, at most

_NAMES = {Role.API_SERVER: "api server", Role.ENGINE_CORE: "engine core", Role.WORKER: "worker",
          Role.HELPER: "a vLLM process"}


@dataclass(frozen=True)
class Death:
    """How a generation died before it ever served."""

    process: Role  # the process whose death is known first (HELPER: one the log does not name)
    signal: str | None = None  # SIGILL, SIGSEGV, SIGBUS, SIGKILL, ...
    exit_code: int | None = None  # its exit code when no signal killed it (None: unknown)
    phase: str = ""  # the start phase under way (`anatomy.Anatomy.under_way`)
    error: str = ""  # the first error line of its log
    frame: str = ""  # faulthandler's top frame: "vllm/_custom_ops.py:3927 cpu_attention_with_kv_cache"

    @property
    def how(self) -> str:
        who = _NAMES[self.process]
        if self.signal:
            return f"{who} killed by {self.signal}"
        return f"{who} exited with {self.exit_code}" if self.exit_code is not None else f"{who} died"

    def line(self, generation: int) -> str:
        """The one line status, the ledger, the log and the exit message carry."""
        out = f'generation {generation} died before serving: {self.how} in phase "{self.phase or "starting"}"'
        if self.error:
            out += f": {self.error}"
        if self.frame:
            out += f" at {self.frame}"
        return out

    @property
    def named(self) -> bool:
        """The log names a cause: a signal, an error line or a frame (not just an exit code)."""
        return bool(self.signal or self.error or self.frame)

    def key(self) -> tuple[object, ...]:
        """What must match for two deaths to be the same cause: the process, its signal or exit
        code, the start phase, the error line (numbers aside: addresses, pids, byte counts) and
        the frame."""
        return self.process, self.signal, self.exit_code, self.phase, _DIGITS.sub("#", self.error), self.frame


def same_cause(last: Death | None, now: Death | None) -> bool:
    """Two deaths before serving, one after the other, of the same named cause: a start that
    fails deterministically (restarting cannot help). A death whose log names nothing (an exit
    code alone) is never called the same as another: the failure window decides then."""
    return last is not None and now is not None and now.named and last.key() == now.key()


# -- reading the log ------------------------------------------------------------------------------
_DIGITS = re.compile(r"0x[0-9a-fA-F]+|\d+")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# vLLM's prefix: "(EngineCore_DP0 pid=7) " / "(Worker pid=9) " / "(APIServer pid=5) "
_PROC = re.compile(r"^\((?:(?P<proc>[\w.-]+) )?pid=\d+\) ?")
_LEVEL = re.compile(r"^(?P<level>ERROR|CRITICAL|WARNING|INFO|DEBUG) +\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? +\[[^\]]*\] ?")
_EXC = re.compile(r"^(?:[\w.]*(?:Error|Exception|Exit|Interrupt|Failure)|AssertionError)(?::\s*(?P<msg>.*))?$")
_WORKER_DIED = re.compile(r"Worker proc \S+ died unexpectedly \(exit code: (?P<code>-?\d+|None)\)")
_CORE_FAILED = re.compile(r"Failed core proc\(s\): \{'[^']+': (?P<code>-?\d+)")
_CORE_DIED = re.compile(r"Process EngineCore\S* \(PID: \d+\) died with exit code (?P<code>-?\d+)"
                        r"|Engine core process \S+ died unexpectedly|engine core exited unexpectedly")
_PYDANTIC = re.compile(r"ValidationError: \d+ validation errors? for ")
_PYDANTIC_TAIL = re.compile(r"\s*\[type=.*$")
# Lines that only point at a cause elsewhere or report a death the rest of the log explains
_NOT_A_CAUSE = ("See root cause above", "See stack trace for root cause", "for the root cause",
                "Engine core initialization failed", "EngineCore failed to start", "Engine process failed to start",
                "WorkerProc failed to start", "WorkerProc initialization failed", "died unexpectedly",
                "died with exit code", "EngineDeadError", "EngineCore encountered", "shutting down")
@dataclass(frozen=True)
class _Line:
    proc: str  # vLLM's process tag ("Worker", "EngineCore_DP0", "APIServer"), "" none
    level: str | None
    text: str  # without colour, prefix and level header; leading spaces kept


def _parse(raw: str) -> _Line:
    s = _ANSI.sub("", raw).rstrip()
    proc = ""
    m = _PROC.match(s)
    if m:
        proc, s = m.group("proc") or "", s[m.end():]
    lv = _LEVEL.match(s)
    return _Line(proc, lv.group("level") if lv else None, s[lv.end():] if lv else s)


def _direct(text: str) -> bool:
    return not any(w in text for w in _NOT_A_CAUSE)


def _first_error(lines: list[_Line]) -> str:
    """The first exception line that is a cause, else the first such ERROR line, else the first
    wrapper exception (it is all the log says); '' when the log says nothing."""
    wrapper = ""
    for i, ln in enumerate(lines):
        t = ln.text.strip()
        if not t or ln.level in ("WARNING", "INFO", "DEBUG") or not _EXC.match(t):
            continue
        if not _direct(t):
            wrapper = wrapper or t
            continue
        if _PYDANTIC.search(t):  # vLLM's config checks say what is wrong on the next line
            detail = next((d.text.strip() for d in lines[i + 1:i + 4] if d.text.strip()
                           and d.level not in ("WARNING", "INFO", "DEBUG") and not _EXC.match(d.text.strip())), "")
            if detail:
                t = f"{t}: {_PYDANTIC_TAIL.sub('', detail)}"
        return t
    for ln in lines:
        t = ln.text
        if ln.level not in ("ERROR", "CRITICAL") or not t.strip() or t.startswith(" "):
            continue  # indented: a traceback's frame or code line
        t = t.strip()
        if t.startswith(("Traceback (most recent call last)", "File \"")) or not _direct(t):
            continue
        return t
    return wrapper


def _died(lines: list[_Line]) -> tuple[Role, int | None] | None:
    """The child process vLLM reports dead, with its exit code: a worker before EngineCore (a
    worker's death takes its EngineCore with it)."""
    core: tuple[Role, int | None] | None = None
    for ln in lines:
        m = _WORKER_DIED.search(ln.text)
        if m:
            code = m.group("code")
            return Role.WORKER, None if code == "None" else int(code)
        if core is None:
            c = _CORE_FAILED.search(ln.text) or _CORE_DIED.search(ln.text)
            if c:
                code = c.groupdict().get("code")
                core = Role.ENGINE_CORE, int(code) if code else None
    return core


def _bounded(text: str) -> str:
    return text if len(text) <= ERROR_MAX else text[:ERROR_MAX - 3] + "..."


def root_cause(log_text: str) -> str:
    """vLLM's root-cause line of a generation that died (`exit_detail`, a crash's failure): the
    first error line of its log as `read` finds it, bounded; '' when the log says nothing."""
    lines = [_parse(raw) for raw in log_text.splitlines()]
    dump = first_dump([ln.text for ln in lines])
    return _bounded(dump.error if dump is not None else _first_error(lines))


def read(log_text: str, api_exit: int | None, phase: str = "") -> Death:
    """Why the generation whose log is `log_text` and whose API server exited with `api_exit`
    (None: still running) died, in start phase `phase`."""
    lines = [_parse(raw) for raw in log_text.splitlines()]
    dump = first_dump([ln.text for ln in lines])
    error, frame, fatal_signal = (dump.error, dump.frame, dump.signal) if dump else (_first_error(lines), "", None)
    died = _died(lines)
    if died is not None:
        process, code = died
    elif api_exit is not None and api_exit >= 0 and fatal_signal is not None:
        process, code = Role.HELPER, None  # a dump, no vLLM line naming the process: some child of it
    else:
        process, code = Role.API_SERVER, api_exit
    sig = signal_name(code)
    if sig is None and code is None and fatal_signal is not None:
        sig = fatal_signal
    return Death(process=process, signal=sig, exit_code=None if sig is not None else code, phase=phase,
                 error=_bounded(error), frame=frame)
