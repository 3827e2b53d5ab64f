"""The demo judges its own run (`make demo` in CI is the check): it passes only when no stream
failed, two recycles were done under load, and none left the replica without a serving
generation or went cold. Pure: a status snapshot in, a verdict line out."""

from __future__ import annotations

from typing import Any

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import RecycleSummary, RequestCounters, RuntimeState, StatusSnapshot
from vllm_guard.runtime.demo import verdict


def recycle(reason: str, generation: int, downtime: float | None, strategy: str = "overlap",
            done: bool = True) -> RecycleSummary:
    return RecycleSummary(reason=reason, cls=EndClass.SCHEDULED, started="2026-12-05T12:00:00Z",
                          generation=generation, in_flight=2, queued=0, duration_s=30.0 if done else None,
                          downtime_s=downtime, strategy=strategy)


def status(*recycles: RecycleSummary, failed: int = 0) -> StatusSnapshot:
    kw: dict[str, Any] = {"state": RuntimeState.SERVING, "state_for_s": 1.0, "generation": 3, "pid": 1, "port": 8000,
                          "model": "m", "requests": RequestCounters(failed=failed), "recent_recycles": list(recycles)}
    return StatusSnapshot(**kw)


def test_two_overlap_recycles_with_no_gap_pass() -> None:
    ok, line = verdict(0, status(recycle("max_requests", 1, 0.0), recycle("demo: forced by operator", 2, 0.0)))
    assert ok and line == ("demo: ok: 2 recycles under load (max_requests, demo: forced by operator), "
                           "0 s without a serving generation, 0 failed")


def test_a_gap_a_cold_recycle_a_failure_or_a_missing_recycle_fails() -> None:
    ok, line = verdict(0, status(recycle("max_requests", 1, 12.5, "gated"), recycle("forced", 2, 31.0, "cold")))
    assert not ok
    assert "the max_requests recycle of generation 1 (gated) left 12.5 s without a serving generation" in line
    assert "the forced recycle of generation 2 (cold) left 31.0 s" in line
    assert verdict(1, status(recycle("a", 1, 0.0), recycle("b", 2, 0.0)))[1] == "demo: FAILED: 1 streams failed"
    assert verdict(0, status(recycle("a", 1, 0.0), failed=2))[1].startswith("demo: FAILED: 2 streams failed")
    ok, line = verdict(0, status(recycle("a", 1, 0.0), recycle("b", 2, None, done=False)))
    assert not ok and line == "demo: FAILED: 1 of 2 recycles done"
