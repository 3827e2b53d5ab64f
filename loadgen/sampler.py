"""Memory samples from the guard's status, for the leak report when no watchdog runs.

Polls `GET /status` on the admin socket of a guard on the same box and stores each new
`memory.current` reading (one row per process: rss/uss/gpu MB) with the generation and the
request counts. A recycle starts new processes; the generation column keeps them apart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import psutil

from vllm_guard.runtime import admin
from vllm_guard.runtime.ledger import utcnow

# kept from the status once per generation and every STATUS_EVERY_S: what the report lists beside
# the leak (patch states) and the guard's own counters
STATUS_KEYS = ("state", "generation", "requests_total", "completed", "failed_requests", "rejected_requests",
               "retried_requests", "client_disconnects", "failures", "patches", "vllm_version", "gpu_name", "model")
STATUS_EVERY_S = 60.0


def rows_from_status(run_id: int, status: dict[str, Any], host_available_mb: float | None) -> list[dict[str, Any]]:
    """One row per process of the guard's current memory reading (empty while none)."""
    cur = (status.get("memory") or {}).get("current") or {}
    base = {
        "run_id": run_id, "at": cur.get("at"), "generation": status.get("generation"),
        "state": status.get("state"), "requests_total": status.get("requests_total"),
        "requests_generation": cur.get("requests"), "host_available_mb": host_available_mb,
    }
    rows = []
    for pid, m in (cur.get("per_process") or {}).items():
        rows.append({**base, "role": m.get("role"), "pid": int(pid), "rss_mb": m.get("rss_mb"),
                     "uss_mb": m.get("uss_mb"), "gpu_mb": m.get("gpu_mb")})
    return rows


class StatusSampler:
    def __init__(self, state_dir: str | Path, run_id: int, put: Callable[[list[dict[str, Any]]], None],
                 interval_s: float = 2.0, put_status: Callable[..., None] | None = None) -> None:
        self.put_status = put_status
        self._status_gen: Any = None
        self._status_t = 0.0
        self.state_dir = state_dir
        self.run_id = run_id
        self.put = put
        self.interval_s = interval_s
        self.last_at: str | None = None
        self.samples = 0
        self.errors = 0
        self.last_status: dict[str, Any] = {}

    async def poll_once(self) -> None:
        try:
            status = await admin.request(self.state_dir, "GET", "/status", timeout=5.0)
        except admin.AdminError:
            self.errors += 1
            return
        self.last_status = status
        now = asyncio.get_running_loop().time()
        if self.put_status and (status.get("generation") != self._status_gen or now - self._status_t >= STATUS_EVERY_S):
            self._status_gen, self._status_t = status.get("generation"), now
            self.put_status(self.run_id, utcnow(), status.get("generation"), {k: status.get(k) for k in STATUS_KEYS})
        at = ((status.get("memory") or {}).get("current") or {}).get("at")
        if not at or at == self.last_at:
            return
        self.last_at = at
        avail = psutil.virtual_memory().available / 2**20
        rows = rows_from_status(self.run_id, status, round(avail, 1))
        if rows:
            self.put(rows)
            self.samples += 1

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)
