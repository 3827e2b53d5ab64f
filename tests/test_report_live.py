"""A report of a running service shows what its status shows. The runtime's writer and
recorder (the proxy's listener: every request status counts reaches it too) on a real ledger,
no vLLM: 60 requests served a moment ago, the runtime still running and the minute still
open, and `vllm-guard report` on the live ledger counts the 60. It said "SLA: no requests
recorded" while a minute's row waited for the minute to close (up to 65 s)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from vllm_guard.report.build import figures
from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone
from vllm_guard.runtime.records.traffic import ROWS_EVERY_S, TrafficRecorder
from vllm_guard.runtime.records.writer import RuntimeLedger


def done(i: int, ended: float, outcome: Outcome = Outcome.COMPLETED) -> RequestDone:
    return RequestDone(request_id=f"r{i}", counted=True, outcome=outcome, status=200, reason="", arrived=ended - 0.3,
                       e2e_s=0.3, ttft_s=0.05, generation=1, replica=0, chunks=8, max_gap_s=0.04, stream=True,
                       prompt_tokens=12, completion_tokens=8)


async def settle(led: RuntimeLedger, seconds: float) -> None:
    """Let the recorder's timer fire, then the writer thread write what it queued."""
    await asyncio.sleep(seconds)
    end = time.monotonic() + 10.0
    while led.health().pending_writes and time.monotonic() < end:
        await asyncio.sleep(0.02)


def test_the_report_of_a_running_service_counts_the_requests_status_counts(tmp_path: Path) -> None:
    async def scenario() -> None:
        led = RuntimeLedger(tmp_path)
        row = led.generation_started(1, 4_000_001, None, "m")
        led.generation_ready(row, "0.0", "")
        rec = TrafficRecorder(led, retention_s=3600.0)
        now = time.time()
        for i in range(60):
            rec.record(done(i, now))
        await settle(led, ROWS_EVERY_S + 0.3)
        r, _ = figures(tmp_path / "ledger.sqlite")
        assert r.traffic.present and (r.traffic.requests, r.traffic.completed, r.traffic.failed) == (60, 60, 0)
        assert r.sla.present, r.sla.note
        for i in range(60, 75):  # more in the same minute: its one row is rewritten, not doubled
            rec.record(done(i, now, Outcome.FAILED if i % 5 == 0 else Outcome.COMPLETED))
        await settle(led, ROWS_EVERY_S + 0.3)
        r, _ = figures(tmp_path / "ledger.sqlite")
        assert (r.traffic.requests, r.traffic.completed, r.traffic.failed) == (75, 72, 3)
        led.close()

    asyncio.run(scenario())
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    try:
        assert db.execute("SELECT COUNT(*), SUM(requests) FROM edge_minutes").fetchone() == (1, 75)
    finally:
        db.close()
