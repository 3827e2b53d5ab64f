"""MTBF maths against the textbook values (GUIDE.md §3) and the service figures from a ledger."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from vllm_guard.runtime import ledger as L
from vllm_guard.soak import ledgerread, service
from vllm_guard.soak.mtbf import availability, mtbf


def test_three_failures_in_720_hours() -> None:
    m = mtbf(720.0, 3, 0.90)
    assert m.mtbf_h == pytest.approx(240.0)
    assert m.lower_one_sided_h == pytest.approx(108.0, abs=0.5)
    assert m.two_sided_low_h == pytest.approx(93.0, abs=0.5)
    assert m.two_sided_high_h == pytest.approx(881.0, abs=1.0)


def test_no_failure_gives_only_a_lower_bound() -> None:
    m = mtbf(720.0, 0, 0.90)
    assert m.lower_one_sided_h == pytest.approx(313.0, abs=0.5)
    assert m.mtbf_h is None and m.two_sided_low_h is None and m.two_sided_high_h is None


def test_bounds_widen_with_confidence_and_narrow_with_failures() -> None:
    assert mtbf(720, 3, 0.95).lower_one_sided_h < mtbf(720, 3, 0.90).lower_one_sided_h
    a, b = mtbf(7200, 30), mtbf(720, 3)
    assert (a.two_sided_high_h / a.two_sided_low_h) < (b.two_sided_high_h / b.two_sided_low_h)
    with pytest.raises(ValueError):
        mtbf(-1, 0)
    with pytest.raises(ValueError):
        mtbf(1, 0, 1.5)
    assert availability(0, 0) is None and availability(99, 1) == pytest.approx(0.99)


def _ts(base: dt.datetime, s: float) -> str:
    return L.iso(base + dt.timedelta(seconds=s))


def test_service_figures_from_a_ledger(tmp_path: Path) -> None:
    """3 generations: a planned recycle, a crash, a host reboot; up time and classes add up."""
    b = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    conn = L.connect(tmp_path / "l.sqlite")
    gens = [  # generation, started, ready, ended, class, boot
        (1, 0, 60, 3660, "scheduled", "boot-a"),
        (2, 3700, 3760, 7360, "unplanned", "boot-a"),
        (3, 7400, 7460, 10000, "unplanned", "boot-a"),  # closed after the host went down
        (4, 10600, 10660, 14260, None, "boot-b"),
    ]
    for g, s, r, e, cls, boot in gens:
        conn.execute("INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, "
                     "boot_id, gpu_name) VALUES (?, ?, ?, ?, ?, ?, ?, 'NVIDIA H200')",
                     (g, _ts(b, s), _ts(b, r), _ts(b, e) if cls else None, cls, cls and "x", boot))
    conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight) VALUES (1, 'max_requests', "
                 "'scheduled', ?, 3)", (_ts(b, 3600),))
    conn.execute("INSERT INTO failures (generation, kind, class, at, exit_code, restored_at) VALUES "
                 "(2, 'crash', 'unplanned', ?, -9, ?)", (_ts(b, 7360), _ts(b, 7460)))
    conn.close()
    d = ledgerread.load(tmp_path / "l.sqlite")
    now = (b + dt.timedelta(seconds=14260)).timestamp()
    s = service.service(d.generations, d.recycles, d.failures, now)
    up = 3600 + 3600 + 2540 + 3600
    assert s["up_h"] == pytest.approx(up / 3600, abs=1e-3)
    assert s["observed_h"] == pytest.approx((14260 - 60) / 3600, abs=1e-3)
    assert s["failures_unplanned"] == 2  # the crash and the reboot; the recycle is planned
    assert s["recycles"]["scheduled"] == 1 and s["recycles"]["list"][0]["trigger"] == "max_requests"
    assert len(s["reboots"]) == 1 and s["reboots"][0]["gap_s"] == pytest.approx(660, abs=1)
    assert s["downtime_planned_s"] == pytest.approx(100, abs=1)
    assert s["downtime_unplanned_s"] == pytest.approx(100 + 660, abs=1)
    assert s["mttr_s"] == pytest.approx((100 + 660) / 2, abs=1)
    assert s["mtbf"]["mtbf_h"] == pytest.approx(up / 3600 / 2, abs=1e-3)
    assert s["gpu_names"] == ["NVIDIA H200"]
