"""A progress line that fits its output: rewritten in place on a terminal, logged elsewhere.

On a terminal every update rewrites one line (`\\r`). Anywhere else (a pipe, a file, CI, the
systemd journal) a rewritten line is one endless line of `\\r`s; there the latest update is
printed as a line of its own at most once per `interval_s`, and `close` prints the summary. Off
a terminal nothing it writes holds a `\\r` or an escape sequence. `note` prints an event on a
line of its own in both modes (on a terminal it first ends the rewritten line).

The clock and the stream are injected so that tests run in milliseconds.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

LOG_INTERVAL_S = 5.0  # off a terminal: at most one progress line per this many seconds


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (what decides rewriting against logging)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


class ProgressLine:
    def __init__(self, stream: TextIO | None = None, *, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.interval_s, self.clock = interval_s, clock
        self._next = clock() + interval_s  # off a terminal: the first line after one interval
        self._last: str | None = None  # the latest update
        self._pending = False  # off a terminal: the latest update is not printed yet
        self._shown = 0  # on a terminal: the width of the rewritten line now on screen (0: none)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _width(self) -> int | None:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            return None

    def update(self, text: str) -> None:
        """The state now: rewritten on a terminal; elsewhere printed if an interval has passed."""
        self._last = text
        if self.tty:
            width = self._width()
            if width:  # a line longer than the terminal wraps, and `\r` would not reach its start
                text = text[: width - 1]
            self._write("\r" + text + " " * max(0, self._shown - len(text)))
            self._shown = len(text)
            return
        now = self.clock()
        if now < self._next:
            self._pending = True
            return
        self._write(text + "\n")
        self._next, self._pending = now + self.interval_s, False

    def note(self, text: str) -> None:
        """An event, on a line of its own; the next update starts a new progress line."""
        if self._shown:
            self._write("\n")
            self._shown = 0
        self._write(text + "\n")

    def close(self, summary: str | None = None) -> None:
        """The end: `summary` (default: the latest update) is left on its own line. On a terminal
        it rewrites the progress line; elsewhere it is printed unless that line is already out."""
        if self.tty:
            if summary is not None:
                self.update(summary)
            if self._shown:
                self._write("\n")
                self._shown = 0
            return
        if summary is not None:
            self._write(summary + "\n")
        elif self._pending and self._last is not None:
            self._write(self._last + "\n")
        self._pending = False
