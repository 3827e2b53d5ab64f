"""The live progress bar (rich): elapsed/total, requests, error rate, p50/p99 TTFT.

On a terminal it redraws twice a second; elsewhere (CI logs, systemd) it prints one plain line
every `LOG_INTERVAL_S` so a 24 h log stays small, and a summary at the end (the decision and
the throttle are `vllm_guard.core.progress.ProgressLine`'s).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

from vllm_guard.core.progress import ProgressLine

from .live import Live

LOG_INTERVAL_S = 30.0  # not a terminal: one progress line per 30 s (2 880 lines a day)
TICK_S = 0.5  # how often the progress is read (the bar redraws, the log line may be due)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


class Progress:
    def __init__(self, live: Live, duration_s: float, offset0: float, mono0: float, enabled: bool, *,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = LOG_INTERVAL_S) -> None:
        self.live, self.duration, self.offset0, self.mono0 = live, duration_s, offset0, mono0
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.log = ProgressLine(self.stream, interval_s=interval_s, clock=clock)
        self.console = Console(file=self.stream)
        self.tty = enabled and self.log.tty
        self.enabled = enabled
        self._bar: RichProgress | None = None

    def _line(self) -> str:
        L = self.live
        err = 100.0 * L.failed / L.done if L.done else 0.0
        return (f"req {L.done}/{L.sent} sent, in flight {L.sent - L.done}, errors {err:.2f}%, "
                f"TTFT p50 {_ms(L.ttft.quantile(0.5))} ms p99 {_ms(L.ttft.quantile(0.99))} ms")

    def _elapsed(self) -> float:
        return self.offset0 + self.clock() - self.mono0

    def tick(self) -> None:
        """Off a terminal: the progress now, logged if a line is due."""
        self.log.update(f"soak {self._elapsed():.0f}/{self.duration:.0f}s  {self._line()}")

    async def run(self) -> None:
        if not self.enabled:
            return
        if not self.tty:
            while True:
                await asyncio.sleep(TICK_S)
                self.tick()
        self._bar = RichProgress(TextColumn("soak"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}s"),
                                 TimeElapsedColumn(), TextColumn("{task.fields[line]}"), console=self.console,
                                 refresh_per_second=2)
        task = self._bar.add_task("soak", total=self.duration, completed=int(self.offset0), line="")
        with self._bar:
            while True:
                self._bar.update(task, completed=min(self.duration, self._elapsed()), line=self._line())
                await asyncio.sleep(TICK_S)

    def final(self) -> None:
        if not self.enabled:
            return
        text = f"soak finished at {self._elapsed():.0f}s run time: {self._line()}"
        if self.tty:  # the bar stopped when `run` was cancelled: the summary goes below it
            print(text, file=self.stream, flush=True)
        else:
            self.log.close(text)
