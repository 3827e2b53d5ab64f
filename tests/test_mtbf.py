"""MTBF maths against the textbook values (GUIDE.md §3), the service figures from a ledger, and
one MTBF wherever it is shown: the watchdog's exporter gives what core.reliability gives."""

from __future__ import annotations

import asyncio
import datetime as dt
import urllib.request
from pathlib import Path

import pytest

from vllm_guard.core import ledger as L
from vllm_guard.core.config import WatchdogConfig, section_from_table
from vllm_guard.core.reliability import availability, mtbf, service_figures
from vllm_guard.core.timefmt import iso

FIX = Path(__file__).parent / "fixtures" / "watchdog"


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
    assert a.two_sided_high_h and a.two_sided_low_h and b.two_sided_high_h and b.two_sided_low_h
    assert (a.two_sided_high_h / a.two_sided_low_h) < (b.two_sided_high_h / b.two_sided_low_h)
    with pytest.raises(ValueError):
        mtbf(-1, 0)
    with pytest.raises(ValueError):
        mtbf(1, 0, 1.5)
    assert availability(0, 0) is None and availability(99, 1) == pytest.approx(0.99)


def test_point_estimate_without_bounds_needs_no_scipy() -> None:
    """The watchdog's exporter asks for the point estimate alone (scipy would add ~40-85 MB of
    RSS to the light process); it is the same number as with bounds."""
    a, b = mtbf(720.0, 3, bounds=False), mtbf(720.0, 3)
    assert a.mtbf_h == b.mtbf_h == pytest.approx(240.0)
    assert mtbf(720.0, 0, bounds=False).mtbf_h is None


def _ts(base: dt.datetime, s: float) -> str:
    return iso(base + dt.timedelta(seconds=s))


B = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _gen(conn: object, g: int, s: float, r: float | None, e: float | None, cls: str | None, boot: str = "boot-a",
         reason: str | None = None) -> None:
    conn.execute(  # type: ignore[attr-defined]
        "INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, boot_id, "
        "gpu_name) VALUES (?, ?, ?, ?, ?, ?, ?, 'NVIDIA H200')",
        (g, _ts(B, s), _ts(B, r) if r is not None else None, _ts(B, e) if e is not None else None, cls,
         reason or (cls and "x"), boot))


def _failure(conn: object, g: int, kind: str, at: float, restored: float, cls: str = "unplanned") -> None:
    conn.execute(  # type: ignore[attr-defined]
        "INSERT INTO failures (generation, kind, class, at, exit_code, restored_at) VALUES (?, ?, ?, ?, -9, ?)",
        (g, kind, cls, _ts(B, at), _ts(B, restored)))


def test_service_figures_from_a_ledger(tmp_path: Path) -> None:
    """4 generations: a planned recycle, a crash, a host reboot; up time and classes add up."""
    conn = L.connect(tmp_path / "l.sqlite")
    _gen(conn, 1, 0, 60, 3660, "scheduled")
    _gen(conn, 2, 3700, 3760, 7360, "unplanned")
    _gen(conn, 3, 7400, 7460, 10000, "unplanned")  # closed after the host went down
    _gen(conn, 4, 10600, 10660, None, None, boot="boot-b")
    conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight) VALUES (1, 'max_requests', "
                 "'scheduled', ?, 3)", (_ts(B, 3600),))
    _failure(conn, 2, "crash", 7360, 7460)
    h = L.read_runtime(conn)
    conn.close()
    s = service_figures(h, (B + dt.timedelta(seconds=14260)).timestamp())
    up = 3600 + 3600 + 2540 + 3600
    assert s.up_h == pytest.approx(up / 3600, abs=1e-3)
    assert s.observed_h == pytest.approx((14260 - 60) / 3600, abs=1e-3)
    assert s.failures_unplanned == 2  # the crash, and gen 3's end with the reboot; the recycle is planned
    assert s.recycles_scheduled == 1 and s.recycles[0].trigger == "max_requests"
    assert len(s.reboots) == 1 and s.reboots[0]["gap_s"] == pytest.approx(660, abs=1)
    assert s.downtime_planned_s == pytest.approx(100, abs=1)
    assert s.downtime_unplanned_s == pytest.approx(100 + 660, abs=1)
    assert s.mttr_s == pytest.approx((100 + 660) / 2, abs=1)
    assert s.mtbf is not None and s.mtbf.mtbf_h == pytest.approx(up / 3600 / 2, abs=1e-3)
    assert s.gpu_names == ["NVIDIA H200"]


def test_a_successor_that_never_served_opens_no_gap_of_its_own(tmp_path: Path) -> None:
    """The serving generation crashes while its overlap successor is still starting; the runtime
    stops the successor (ended `scheduled`, never ready) and starts another. One outage, counted
    once and unplanned: the successor's end is inside it, not a planned gap beside it."""
    conn = L.connect(tmp_path / "l.sqlite")
    _gen(conn, 1, 0, 60, 1000, "unplanned", reason="crash")
    _gen(conn, 2, 800, None, 1000, "scheduled")
    _gen(conn, 3, 1001, 1033, 2000, "scheduled")
    _failure(conn, 1, "crash", 1000, 1033)
    h = L.read_runtime(conn)
    conn.close()
    s = service_figures(h, (B + dt.timedelta(seconds=2000)).timestamp())
    assert s.downtime_unplanned_s == pytest.approx(33, abs=0.1) and s.downtime_planned_s == 0, s
    assert s.failures_unplanned == 1 and s.mttr_s == pytest.approx(33, abs=0.1)
    assert s.availability == pytest.approx((940 + 967) / (940 + 967 + 33), abs=1e-4)


def test_a_successor_that_fails_to_start_makes_the_rest_of_a_planned_gap_unplanned(tmp_path: Path) -> None:
    """A cold recycle: the old generation stops (planned), its successor dies while starting
    (unplanned, never ready), the next one serves. 40 s planned until the failure, 60 s
    unplanned after it; one unplanned event, restored when the third served."""
    conn = L.connect(tmp_path / "l.sqlite")
    _gen(conn, 1, 0, 60, 1000, "scheduled")
    _gen(conn, 2, 1000, None, 1040, "unplanned", reason="crash")
    _gen(conn, 3, 1041, 1100, 2000, "scheduled")
    h = L.read_runtime(conn)
    conn.close()
    s = service_figures(h, (B + dt.timedelta(seconds=2000)).timestamp())
    assert s.downtime_planned_s == pytest.approx(40, abs=0.1), s
    assert s.downtime_unplanned_s == pytest.approx(60, abs=0.1), s
    assert s.failures_unplanned == 1 and s.unplanned_events[0].generation == 2
    assert s.unplanned_events[0].restore_s == pytest.approx(60, abs=0.1)


def _two_runtime_lives(state: Path) -> None:
    """An older runtime numbered generations 1..3, a newer one started again at 1: reused
    numbers. Unplanned: gen 2 of the first life (crash + its failure row: one event), gen 3
    (ended unplanned, no failure row), gen 2 of the second life (a hang). A scheduled restart
    row and planned recycles do not count."""
    conn = L.connect(state)
    _gen(conn, 1, 0, 60, 3660, "scheduled")
    _gen(conn, 2, 3700, 3760, 9000, "unplanned", reason="crash")
    _failure(conn, 2, "crash", 9000, 9100)
    _gen(conn, 3, 9040, 9100, 20000, "unplanned", reason="runtime_lost")
    _gen(conn, 1, 20500, 20560, 30000, "scheduled")  # the second runtime process: numbers again from 1
    _failure(conn, 1, "restart", 30000, 30050, cls="scheduled")
    _gen(conn, 2, 30000, 30050, 41000, "unplanned", reason="hang")
    _failure(conn, 2, "hang", 41000, 41080)
    _gen(conn, 3, 41020, 41080, 50000, "scheduled")
    conn.close()


def test_exporter_mtbf_is_the_core_mtbf(tmp_path: Path) -> None:
    """`vllm_guard_mtbf_hours`, scraped from the running exporter, equals core.reliability on
    the same ledger (the watchdog once counted failure rows alone and disagreed with the report)."""
    from conftest import free_port
    from vllm_guard.watchdog.loop import Watchdog

    _two_runtime_lives(tmp_path)
    conn = L.connect(tmp_path)
    figs = service_figures(L.read_runtime(conn), (B + dt.timedelta(seconds=50000)).timestamp())
    naive = conn.execute("SELECT COUNT(*) FROM failures WHERE class = 'unplanned'").fetchone()[0]
    conn.close()
    assert figs.mtbf is not None and figs.failures_unplanned == 3 and naive == 2
    port = free_port()
    cfg: WatchdogConfig = section_from_table("watchdog", {"kernel": "off", "prometheus_port": port,
                                                          "nvml_trace": str(FIX / "nvml_h200_steady.jsonl")})

    async def one_tick() -> str:
        wd = Watchdog(cfg, tmp_path)
        await wd.start()
        try:
            await wd.tick()
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
        finally:
            await wd.close()

    text = asyncio.run(one_tick())
    got = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
           if ln.startswith(("vllm_guard_mtbf_hours ", "vllm_guard_availability "))}
    assert got["vllm_guard_mtbf_hours"] == pytest.approx(figs.mtbf.mtbf_h, rel=1e-12)
    assert got["vllm_guard_availability"] == pytest.approx(figs.availability, rel=1e-12)
