"""A vLLM API server this runtime did not start: the one a previous runtime handed over.

It is not our child, so there is no exit status to wait for: it is alive while its pid still
carries the start time recorded at hand-over (the keeper's identity rule), and gone after. What
reads `Backend.proc` (its pid, `returncode`, `wait()`) sees the same shape as an asyncio child.
"""

from __future__ import annotations

import asyncio

from .keeper import same_process, start_ticks

GONE = -1  # the exit status of a process that is not ours is not known: it is "gone"


class AdoptedProcess:
    def __init__(self, pid: int, ticks: int) -> None:
        self.pid = pid
        self.ticks = ticks
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        """None while it lives; GONE once its pid no longer carries its start time."""
        if self._code is None and not same_process(start_ticks(self.pid), self.ticks):
            self._code = GONE
        return self._code

    async def wait(self) -> int:
        while (code := self.returncode) is None:
            await asyncio.sleep(0.1)
        return code
