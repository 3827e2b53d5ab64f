"""The report on the core's contracts, one test per disagreement the copies had:
- its MTBF is core.reliability's on the same ledger (also when an older runtime reused
  generation numbers: two unplanned ends of two "generation 1" rows are two failures);
- a power-capped GPU is not throttled (core.gpu's rule), and the cap is shown apart;
- a watchdog sample or soak status record with a renamed key is reported, not read as zeros;
- the runtime's served requests show without a soak;
- a file that is not a ledger, an --out it cannot write, a --run-id it lacks: one line, exit 2.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import GUARD
from vllm_guard.core import ledger as L
from vllm_guard.core.protocol import StatusSnapshot
from vllm_guard.core.reliability import service_figures
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading, SoakStatusRecord, StatusBrief
from vllm_guard.core.timefmt import iso

BASE = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)


def _t(s: float) -> str:
    return iso(BASE + dt.timedelta(seconds=s))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GUARD, "report", *args], capture_output=True, text=True, timeout=300)


def report_json(db: Path) -> dict[str, Any]:
    out = run("--db", str(db), "--format", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def generation(conn: sqlite3.Connection, gen: int, start: float, end: float | None, cls: str | None,
               served: int = 0, boot: str = "boot-a") -> None:
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, "
                 "requests_served, boot_id, gpu_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'NVIDIA H200')",
                 (gen, _t(start), _t(start + 60), None if end is None else _t(end), cls,
                  cls and ("crash" if cls == "unplanned" else "max_requests"), served, boot))


def test_report_mtbf_is_the_core_one_with_reused_generation_numbers(tmp_path: Path) -> None:
    """Two runtime processes that both numbered from 1 (before numbers persisted in the ledger):
    each one's generation 1 crashed. Two unplanned ends, two failures; the report's `service`
    is core.reliability's figures for the same rows, in JSON and in text."""
    db = tmp_path / "l.sqlite"
    conn = L.connect(db)
    for off in (0.0, 20000.0):  # runtime process A, then B (both start at generation 1)
        generation(conn, 1, off, off + 3660, "unplanned", served=300)
        generation(conn, 2, off + 3700, off + 10000, "scheduled", served=900)
        conn.execute("INSERT INTO failures (generation, kind, class, at, exit_code, restored_at) VALUES "
                     "(1, 'crash', 'unplanned', ?, -9, ?)", (_t(off + 3660), _t(off + 3760)))
        conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight) VALUES "
                     "(2, 'max_requests', 'scheduled', ?, 1)", (_t(off + 9990),))
    conn.close()
    ro = L.open_readonly(db)
    core = service_figures(L.read_runtime(ro), now=BASE.timestamp() + 1e6)
    ro.close()
    assert core.failures_unplanned == 2 and core.mtbf is not None and core.mtbf.failures == 2
    f = report_json(db)
    assert f["service"] == json.loads(json.dumps(core.to_dict()))  # every key, the MTBF included
    assert f["service"]["failures_unplanned"] == 2 and f["service"]["requests_served"] == 2400
    text = run("--db", str(db)).stdout
    assert f"unplanned failures 2; MTBF {core.mtbf.mtbf_h:.4g} h" in text


def _tick(conn: sqlite3.Connection, at: str, sources: dict[str, Any]) -> None:
    conn.executemany("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)",
                     [(at, src, json.dumps(data)) for src, data in sources.items()])


def _nvml(t: float, reasons: int) -> dict[str, Any]:
    return NvmlRecord.model_validate({"at_s": (BASE + dt.timedelta(seconds=t)).timestamp(), "gpus": [{
        "index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "temp_c": 70.0, "sm_clock_mhz": 1980.0,
        "sm_clock_max_mhz": 1980.0, "clock_reasons": reasons}]}).model_dump(mode="json")


def test_power_cap_alone_is_not_throttling(tmp_path: Path) -> None:
    """A busy GPU at its power limit (SW power cap, 0x4) the whole run: throttled 0 %, power
    capped 100 %. Heat (SW thermal, 0x20) on a quarter of the ticks is throttling."""
    db = tmp_path / "l.sqlite"
    conn = L.connect(db)
    generation(conn, 1, 0, None, None)
    for i in range(40):
        _tick(conn, _t(100 + 10 * i), {"nvml": _nvml(100 + 10 * i, 0x4 | (0x20 if i % 4 == 0 else 0))})
    conn.close()
    g = report_json(db)["thermal"]["gpus"][0]
    assert g["power_capped_share"] == 1.0 and g["throttled_share_by_reason"]["sw_power_cap"] == 1.0
    assert g["throttled_share"] == pytest.approx(0.25) and g["throttled_share_by_reason"]["sw_thermal"] == 0.25
    db2 = tmp_path / "capped.sqlite"
    conn = L.connect(db2)
    generation(conn, 1, 0, None, None)
    for i in range(40):
        _tick(conn, _t(100 + 10 * i), {"nvml": _nvml(100 + 10 * i, 0x4)})
    conn.close()
    g = report_json(db2)["thermal"]["gpus"][0]
    assert g["throttled_share"] == 0.0 and g["power_capped_share"] == 1.0
    assert g["throughput_throttled_rps"] is None  # no throttled window at all
    assert "throttled 0.0 %, power capped 100.0 %" in run("--db", str(db2)).stdout


def _good_tick(i: int) -> dict[str, Any]:
    req = 30 + 10 * i
    return {
        "procs": {"4242": ProcReading.model_validate({"role": "engine_core", "rss_mb": 600.0 + 0.2 * req})
                  .model_dump(mode="json")},
        "status": StatusBrief(state="serving", generation=1, requests_total=req, requests_generation=req,
                              in_flight=0, queued=0, failures=0).model_dump(mode="json"),
        "host": HostReading(mem_total_mb=16000.0, mem_available_mb=9000.0, swap_used_mb=0.0).model_dump(mode="json"),
    }


def test_a_renamed_sample_key_is_reported_not_read_as_zero(tmp_path: Path) -> None:
    """The watchdog writes `rss` where the schema says `rss_mb` (a renamed key): the report says
    how many ticks do not match and why, and fits no leak from them, rather than skipping them
    in silence. The same ledger with the right key gives the slope."""
    good, bad = tmp_path / "good.sqlite", tmp_path / "bad.sqlite"
    for db, rename in ((good, False), (bad, True)):
        conn = L.connect(db)
        generation(conn, 1, 0, None, None)
        for i in range(40):
            src = _good_tick(i)
            if rename:
                for m in src["procs"].values():
                    m["rss"] = m.pop("rss_mb")
            _tick(conn, _t(100 + 10 * i), src)
        conn.close()
    f = report_json(good)
    assert f["watchdog_samples"]["invalid"] == 0 and f["leak"]["source"] == "watchdog"
    eng = next(p for p in f["leak"]["processes"] if p["metric"] == "rss_mb")
    assert eng["per_100_requests"]["slope"] == pytest.approx(20.0)
    f = report_json(bad)
    ws = f["watchdog_samples"]
    assert ws["invalid"] == 40 and ws["count"] == 0 and "rss_mb" in ws["first_error"], ws
    assert f["leak"]["source"] is None and f["leak"]["processes"] == []
    text = run("--db", str(bad)).stdout
    assert "40 of 40 watchdog sample ticks do not match the sample schema" in text and "rss_mb" in text


def test_a_renamed_soak_status_key_is_reported(tmp_path: Path) -> None:
    """`soak_status` rows are SoakStatusRecord JSON: patch states are listed from good rows; a
    row whose key was renamed is counted and named in the report."""
    db = tmp_path / "l.sqlite"
    conn = L.connect(db)
    generation(conn, 1, 0, None, None)
    snap = StatusSnapshot.from_json({
        "state": "serving", "state_for_s": 3.0, "generation": 1, "pid": 7, "port": 8000, "model": "tiny",
        "patches": {"11": {"process": "engine_core", "pid": 11, "patches": {
            "idle-release": {"state": "applied", "reason": "ok"}, "fault-injection": {"state": "skipped", "reason": "off"}}}}})
    rec = json.loads(SoakStatusRecord.from_snapshot(snap).model_dump_json())
    renamed = {**{k: v for k, v in rec.items() if k != "requests"}, "request_counters": rec["requests"]}
    conn.execute("INSERT INTO runs (token, started_at, params) VALUES ('t', ?, '{}')", (_t(0),))
    for data in (rec, renamed):
        conn.execute("INSERT INTO soak_status (run_id, at, generation, data) VALUES (1, ?, 1, ?)",
                     (_t(100), json.dumps(data)))
    conn.close()
    f = report_json(db)
    assert f["patches"]["1"]["11"]["patches"]["idle-release"]["state"] == "applied"
    assert f["soak_status"]["count"] == 1 and f["soak_status"]["invalid"] == 1
    assert "requests" in f["soak_status"]["first_error"]
    text = run("--db", str(db)).stdout
    assert "engine_core: idle-release" in text and "1 of 2 soak status records do not match" in text


def test_runtime_requests_show_without_a_soak(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    conn = L.connect(db)
    generation(conn, 1, 0, 3600, "scheduled", served=1200)
    generation(conn, 2, 3700, None, None, served=345)
    conn.close()
    f = report_json(db)
    assert f["service"]["requests_served"] == 1545 and f["traffic"]["requests"] == 0
    text = run("--db", str(db)).stdout
    assert "requests served 1545 in 2 generations" in text
    assert "no requests recorded: the runtime writes every request it serves" in text


def test_bad_inputs_are_one_line_and_exit_2(tmp_path: Path) -> None:
    notledger = tmp_path / "notledger.txt"
    notledger.write_text("hello\n" * 100)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE t (x)")
    good = tmp_path / "l.sqlite"
    conn = L.connect(good)
    generation(conn, 1, 0, None, None)
    conn.close()
    cases = {
        "not sqlite": (["--db", str(notledger)], "not a vllm-guard ledger"),
        "other sqlite": (["--db", str(other)], "not a vllm-guard ledger"),
        "no file": (["--db", str(tmp_path / "none.sqlite")], "no ledger at"),
        "out dir": (["--db", str(good), "--format", "html", "--out", "/nonexistent/x.html"], "--out"),
        "run id": (["--db", str(good), "--run-id", "7"], "--run-id has value 7"),
        "compare": (["--compare", str(good), str(other)], "not a vllm-guard ledger"),
        "confidence": (["--db", str(good), "--confidence", "1.5"], "--confidence"),
    }
    for name, (args, says) in cases.items():
        out = run(*args)
        assert out.returncode == 2, (name, out.returncode, out.stderr)
        assert out.stderr.count("\n") == 1 and says in out.stderr, (name, out.stderr)
        assert out.stdout == "", name
    assert not Path("/nonexistent").exists()
    before = other.read_bytes()
    for db, says in ((notledger, "not a vllm-guard ledger"), (other, "not a vllm-guard ledger")):
        out = subprocess.run([GUARD, "soak", "--resume", "--db", str(db)], capture_output=True, text=True, timeout=600)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert other.read_bytes() == before  # the soak did not add its tables to someone else's file


def test_clock_drop_is_one_figure_for_the_watchdog_and_the_report(tmp_path: Path) -> None:
    """The watchdog alarmed on the mean busy drop, the report showed 1 - p5/max: on a card at
    its max clock 90 % of the time and at 60 % of it otherwise, they said 4 % and 40 %. Now
    both are core.gpu.clock_drop_pct (over the watchdog's window for the report): one number."""
    from vllm_guard.core import gpu
    from vllm_guard.core.samples import GpuReading
    from vllm_guard.watchdog.base import Sample
    from vllm_guard.watchdog.thermal import ThermalDetector

    from test_watchdog_units import cfg_of

    clocks = [1980.0 * (0.6 if i % 10 == 0 else 1.0) for i in range(40)]  # 400 s: inside one window
    det = ThermalDetector(cfg_of({}))
    db = tmp_path / "l.sqlite"
    conn = L.connect(db)
    generation(conn, 1, 0, None, None)
    for i, c in enumerate(clocks):
        rec = NvmlRecord.model_validate({"at_s": (BASE + dt.timedelta(seconds=100 + 10 * i)).timestamp(), "gpus": [{
            "index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "temp_c": 70.0, "sm_clock_mhz": c,
            "sm_clock_max_mhz": 1980.0, "clock_reasons": 0}]})
        res = det.check(Sample(at=_t(100 + 10 * i), t=100.0 + 10 * i, nvml=rec))
        _tick(conn, _t(100 + 10 * i), {"nvml": rec.model_dump(mode="json")})
    conn.close()
    watchdog = res.data["gpus"][0]["clock_drop_pct"]
    core = gpu.clock_drop_pct((c, 1980.0, 0) for c in clocks)
    report = report_json(db)["thermal"]["gpus"][0]["clock_drop_pct"]
    assert core == pytest.approx(4.0) and watchdog == pytest.approx(core, abs=0.05)
    assert report == pytest.approx(core, abs=1e-9), report
    assert GpuReading  # the record the detector and the report read
