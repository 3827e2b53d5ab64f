"""The live progress bar (rich): elapsed/total, requests, error rate, p50/p99 TTFT.

On a terminal it redraws twice a second; elsewhere (CI logs, systemd) it prints one plain line
every 30 s so a 24 h log stays small.
"""

from __future__ import annotations

import asyncio
import sys
import time
from rich.console import Console
from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

from .live import Live


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


class Progress:
    def __init__(self, live: Live, duration_s: float, offset0: float, mono0: float, enabled: bool) -> None:
        self.live, self.duration, self.offset0, self.mono0 = live, duration_s, offset0, mono0
        self.console = Console(stderr=True)
        self.tty = enabled and self.console.is_terminal
        self.enabled = enabled
        self._bar: RichProgress | None = None

    def _line(self) -> str:
        L = self.live
        err = 100.0 * L.failed / L.done if L.done else 0.0
        return (f"req {L.done}/{L.sent} sent, in flight {L.sent - L.done}, errors {err:.2f}%, "
                f"TTFT p50 {_ms(L.ttft.quantile(0.5))} ms p99 {_ms(L.ttft.quantile(0.99))} ms")

    def _elapsed(self) -> float:
        return self.offset0 + time.monotonic() - self.mono0

    async def run(self) -> None:
        if not self.enabled:
            return
        if not self.tty:
            while True:
                await asyncio.sleep(30)
                print(f"soak {self._elapsed():.0f}/{self.duration:.0f}s  {self._line()}", file=sys.stderr, flush=True)
        self._bar = RichProgress(TextColumn("soak"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}s"),
                                 TimeElapsedColumn(), TextColumn("{task.fields[line]}"), console=self.console,
                                 refresh_per_second=2)
        task = self._bar.add_task("soak", total=self.duration, completed=int(self.offset0), line="")
        with self._bar:
            while True:
                self._bar.update(task, completed=min(self.duration, self._elapsed()), line=self._line())
                await asyncio.sleep(0.5)

    def final(self) -> None:
        if self.enabled:
            print(f"soak finished at {self._elapsed():.0f}s run time: {self._line()}", file=sys.stderr, flush=True)
