"""Progress that fits its output: one line rewritten in place (`\\r`) on a terminal; elsewhere
(a pipe, a file, CI, the journal) a full line per interval and a summary, with no `\\r` and no
escape sequence. The shared rule (`core.progress.ProgressLine`) on an injected clock and
stream, then what the demo's load and the soak's progress print through it, then the real
`vllm-guard soak` CLI with its stderr on a pipe (against the synthetic upstream: seconds)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from test_soak_client import soak_cmd, upstream_factory  # noqa: F401 - the fixture
from vllm_guard.core import admin
from vllm_guard.core.progress import ProgressLine, is_terminal
from vllm_guard.core.protocol import Command, CommandReply, RuntimeState
from vllm_guard.core.stream import Result
from vllm_guard.loadgen import progress as soak_progress
from vllm_guard.loadgen.live import Live
from vllm_guard.runtime import demo


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def plain(out: str) -> None:
    """What a log may hold: whole lines, no carriage return, no escape sequence."""
    assert "\r" not in out and "\x1b" not in out, repr(out)
    assert out == "" or out.endswith("\n"), repr(out)


# -- the rule ---------------------------------------------------------------------------------

def test_on_a_terminal_every_update_rewrites_one_line() -> None:
    s, clock = io.StringIO(), Clock()
    p = ProgressLine(s, tty=True, clock=clock)
    p.update("streamed 9")
    p.update("streamed 10")
    p.update("done")  # shorter: the rest of the old line is blanked
    assert s.getvalue() == "\rstreamed 9\rstreamed 10\rdone       "
    p.close()
    assert s.getvalue().endswith("\rdone       \n") and s.getvalue().count("\n") == 1


def test_on_a_terminal_a_note_ends_the_rewritten_line_first() -> None:
    s = io.StringIO()
    p = ProgressLine(s, tty=True, clock=Clock())
    p.note("-> before any progress")  # nothing to end: no blank line
    p.update("streamed 3")
    p.note("-> forced a recycle")
    p.update("streamed 4")
    p.close("streamed 4, finished")
    assert s.getvalue() == ("-> before any progress\n\rstreamed 3\n-> forced a recycle\n"
                            "\rstreamed 4\rstreamed 4, finished\n")


def test_off_a_terminal_one_full_line_per_interval_and_a_summary() -> None:
    s, clock = io.StringIO(), Clock()
    p = ProgressLine(s, tty=False, interval_s=5.0, clock=clock)
    for dt, text in ((0.0, "a"), (1.0, "b"), (4.9, "c"), (5.0, "d"), (6.0, "e"), (9.9, "f"), (10.1, "g"),
                     (11.0, "h")):
        clock.t = 1000.0 + dt
        p.update(text)
    p.note("-> an event")
    p.close("summary")
    assert s.getvalue() == "d\ng\n-> an event\nsummary\n"
    plain(s.getvalue())


def test_off_a_terminal_many_updates_in_one_interval_print_at_most_one_line() -> None:
    s, clock = io.StringIO(), Clock()
    p = ProgressLine(s, tty=False, interval_s=5.0, clock=clock)
    for i in range(1000):  # 1 000 updates in 4.995 s: none is due yet
        clock.t = 1000.0 + i * 0.005
        p.update(f"streamed {i}")
    assert s.getvalue() == ""
    for i in range(1000, 3400):  # on to 17 s: lines at 5, 10 and 15 s, never two within 5 s
        clock.t = 1000.0 + i * 0.005
        p.update(f"streamed {i}")
    assert s.getvalue() == "streamed 1000\nstreamed 2000\nstreamed 3000\n"
    p.close()  # no summary given: the latest update, which is not out yet
    assert s.getvalue().splitlines()[-1] == "streamed 3399"
    plain(s.getvalue())


def test_off_a_terminal_close_does_not_repeat_a_line_already_out() -> None:
    s, clock = io.StringIO(), Clock()
    p = ProgressLine(s, tty=False, interval_s=5.0, clock=clock)
    clock.t += 5
    p.update("streamed 7")
    p.close()
    assert s.getvalue() == "streamed 7\n"


def test_the_decision_is_the_stream_being_a_terminal() -> None:
    main, sub = os.openpty()
    r, w = os.pipe()
    try:
        with open(sub, "w", closefd=False) as tty, open(w, "w", closefd=False) as pipe:
            assert is_terminal(tty) and ProgressLine(tty).tty
            assert not is_terminal(pipe) and not ProgressLine(pipe).tty
        assert not is_terminal(io.StringIO())
        closed = io.StringIO()
        closed.close()
        assert not is_terminal(closed)
    finally:
        for fd in (main, sub, r, w):
            os.close(fd)


# -- the demo's load --------------------------------------------------------------------------

def _demo_load(monkeypatch: pytest.MonkeyPatch, tty: bool) -> str:
    """`demo._load` with its streams and the admin socket faked: 2 clients, 40 streams of 0.5 s
    (fake clock), a new generation every 12, the forced recycle refused once."""
    clock, s = Clock(), io.StringIO()
    n = 0

    async def stream(*_: Any) -> tuple[Result, float]:
        nonlocal n
        await asyncio.sleep(0)
        clock.t += 0.5
        n += 1
        return Result(status=200, output_tokens=demo.MAX_TOKENS, generation=1 + n // 12), clock.t

    sends = 0

    async def send(*_: Any, **__: Any) -> CommandReply:
        nonlocal sends
        sends += 1
        reply = CommandReply(command=Command.RECYCLE, accepted=sends > 1, detail="a recycle is under way",
                             state=RuntimeState.SERVING, generation=1)
        if sends == 1:
            raise admin.CommandRefused(reply)
        return reply

    monkeypatch.setattr(demo, "stream_completion", stream)
    monkeypatch.setattr(demo.admin, "send", send)
    monkeypatch.setattr(demo, "RECYCLE_RETRY_S", 0.0)
    line = ProgressLine(s, tty=tty, interval_s=demo.PROGRESS_LOG_S, clock=clock)
    res = asyncio.run(demo._load("http://127.0.0.1:1", "m", 40, 2, Path("unused"), line))
    assert res["failed"] == 0 and res["streams"] >= 40 and len(res["per_generation"]) >= 3
    return s.getvalue()


def test_the_demo_off_a_terminal_logs_lines_and_its_notes_without_blank_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _demo_load(monkeypatch, tty=False)
    plain(out)
    lines = out.splitlines()
    assert "" not in lines, out  # no leading "\n" before the notes
    notes = [x for x in lines if x.startswith("  -> ")]
    assert notes == ["  -> forced recycle refused for now (a recycle is under way): trying again",
                     "  -> forced a graceful recycle through the admin socket"], out
    progress = [x for x in lines if x.startswith("  streamed ")]
    # 40 streams of 0.5 s: ~20 s, a line per 5 s and the last state at the end
    assert 3 <= len(progress) <= 6, out
    assert progress[-1].startswith("  streamed 4") and "failed 0" in progress[-1] and "'3'" in progress[-1], out


def test_the_demo_on_a_terminal_rewrites_its_line_and_breaks_it_for_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _demo_load(monkeypatch, tty=True)
    assert out.count("\r  streamed ") >= 40 and out.endswith("\n"), out
    assert "\n  -> forced recycle refused for now" in out and "\n  -> forced a graceful recycle" in out
    for part in out.split("\n")[:-1]:  # each line holds one note or a rewritten progress line
        assert part.startswith("  -> ") or part.startswith("\r  streamed "), repr(part)


# -- the soak's progress ----------------------------------------------------------------------

def _live(done: int) -> Live:
    L = Live()
    for i in range(done):
        L.sent += 1
        L.add(Result(status=200, ttft_s=0.05 + i / 1e4, output_tokens=8), 0.0, 0.1)
    return L


def test_the_soak_off_a_terminal_logs_a_line_per_interval_and_a_summary() -> None:
    s, clock = io.StringIO(), Clock()
    live = _live(0)
    p = soak_progress.Progress(live, 120.0, 0.0, clock.t, True, stream=s, clock=clock, interval_s=30.0)
    assert not p.tty
    for i in range(1, 181):  # 90 s of ticks every 0.5 s: lines at 30, 60 and 90 s
        clock.t += 0.5
        live.sent += 1
        live.add(Result(status=200, ttft_s=0.05, output_tokens=8), 0.0, 0.1)
        p.tick()
    p.final()
    out = s.getvalue()
    plain(out)
    lines = out.splitlines()
    assert [x.split("  ")[0] for x in lines[:3]] == ["soak 30/120s", "soak 60/120s", "soak 90/120s"], out
    assert lines[-1] == "soak finished at 90s run time: req 180/180 sent, in flight 0, errors 0.00%, " \
                        "TTFT p50 50 ms p99 50 ms", out
    assert len(lines) == 4


def test_the_soak_with_progress_off_prints_nothing() -> None:
    s = io.StringIO()
    p = soak_progress.Progress(_live(3), 10.0, 0.0, 0.0, False, stream=s)
    asyncio.run(p.run())
    p.final()
    assert s.getvalue() == ""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_soak_on_a_terminal_keeps_its_rich_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak_progress, "TICK_S", 0.01)
    s = _Tty()
    p = soak_progress.Progress(_live(5), 10.0, 0.0, time.monotonic(), True, stream=s)
    assert p.tty

    async def briefly() -> None:
        task = asyncio.create_task(p.run())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(briefly())
    p.final()
    out = s.getvalue()
    assert "\x1b[" in out and "req 5/5 sent" in out  # rich drew (and hid the cursor meanwhile)
    assert "soak finished at 0s run time: req 5/5 sent" in out.splitlines()[-1], repr(out[-300:])


def test_the_soak_cli_on_a_pipe_writes_plain_lines(upstream_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    """The real CLI, progress on, stderr a pipe: rich draws nothing, the summary is a plain line."""
    up = upstream_factory()
    cmd = [x for x in soak_cmd(up.url, tmp_path / "l.sqlite", "--output-tokens", "4", "--rate", "20",
                               "--duration", "2s") if x != "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plain(out.stderr)
    assert any(x.startswith("soak finished at ") for x in out.stderr.splitlines()), out.stderr
