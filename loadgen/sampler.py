"""Memory samples from the guard's status, for the leak report when no watchdog runs.

Polls `GET /status` on the admin socket of a guard on the same box (a typed StatusSnapshot)
and stores each new `memory.current` reading (one `soak_samples` row per process: rss/uss/gpu
MB) with the generation and the request counts. A recycle starts new processes; the
generation column keeps them apart. Once per generation and every STATUS_EVERY_S it also
keeps a `SoakStatusRecord` (counters and patch states) in `soak_status`.

A status that does not match this client's schema (runtime and soak of different versions)
is not read as zeros: the sampler says so once on stderr and counts it (`status_errors` in the
summary).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Callable

import psutil

from vllm_guard.core.admin import AdminError, fetch_status
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.protocol import StatusSnapshot
from vllm_guard.core.samples import SoakStatusRecord
from vllm_guard.core.timefmt import utcnow

from .store import MemoryRow

STATUS_EVERY_S = 60.0


def rows_from_status(run_id: int, st: StatusSnapshot, host_available_mb: float | None) -> list[MemoryRow]:
    """One row per process of the guard's current memory reading (empty while none)."""
    cur = st.memory.current if st.memory is not None else None
    if cur is None:
        return []
    return [MemoryRow(run_id=run_id, at=cur.at, generation=st.generation, state=st.state.value,
                      requests_total=st.requests.total, requests_generation=cur.requests, role=p.role.value,
                      pid=p.pid, rss_mb=p.rss_mb, uss_mb=p.uss_mb, gpu_mb=p.gpu_mb,
                      host_available_mb=host_available_mb) for p in cur.per_process]


def is_protocol_error(e: BaseException) -> bool:
    """An AdminError that says the status did not decode (not that the runtime is away)."""
    return isinstance(e, ProtocolError) or isinstance(e.__cause__, ProtocolError)


class StatusSampler:
    def __init__(self, state_dir: str | Path, run_id: int, put: Callable[[list[MemoryRow]], None],
                 interval_s: float = 2.0, put_status: Callable[[int, str, SoakStatusRecord], None] | None = None
                 ) -> None:
        self.state_dir = state_dir
        self.run_id = run_id
        self.put = put
        self.put_status = put_status
        self.interval_s = interval_s
        self.last_at: str | None = None
        self.samples = 0
        self.errors = 0  # polls that got no status (runtime away, socket busy)
        self.protocol_errors = 0  # polls whose status did not match the schema
        self.last_error: str | None = None
        self._status_gen: int | None = None
        self._status_t = 0.0

    async def poll_once(self) -> None:
        try:
            st = await fetch_status(self.state_dir, timeout=5.0)
        except AdminError as e:
            if is_protocol_error(e):
                if not self.protocol_errors:
                    print(f"vllm-guard soak: warning: the guard's status at {self.state_dir} does not match this "
                          f"soak's schema, no memory samples are recorded: {e}", file=sys.stderr, flush=True)
                self.protocol_errors += 1
            else:
                self.errors += 1
            self.last_error = str(e)
            return
        self.sample(st)

    def sample(self, st: StatusSnapshot) -> None:
        now = asyncio.get_running_loop().time()
        if self.put_status and (st.generation != self._status_gen or now - self._status_t >= STATUS_EVERY_S):
            self._status_gen, self._status_t = st.generation, now
            self.put_status(self.run_id, utcnow(), SoakStatusRecord.from_snapshot(st))
        cur = st.memory.current if st.memory is not None else None
        if cur is None or cur.at == self.last_at:
            return
        self.last_at = cur.at
        avail = psutil.virtual_memory().available / 2**20
        rows = rows_from_status(self.run_id, st, round(avail, 1))
        if rows:
            self.put(rows)
            self.samples += 1

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)
