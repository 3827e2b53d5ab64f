"""Where the slowest first tokens waited (report/tail.py): each request's wait, from its arrival
to its first token, set beside the moments the runtime recorded. The rules on a history built by
hand (milliseconds), then the same through `vllm-guard report` on a ledger the runtime's own
writer filled."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from conftest import GUARD_CMD
from vllm_guard.core.ledger import FailureRow, GenerationRow, RecycleRow, RuntimeHistory
from vllm_guard.core.timefmt import iso_from_epoch
from vllm_guard.report.ledgerread import Waits
from vllm_guard.report.tail import label, moments, tail_report

T0 = 1_800_000_000.0


def at(s: float | None) -> str | None:
    return iso_from_epoch(None if s is None else T0 + s)


def gen(n: int, started: float, ready: float | None, ended: float | None, phases: list[tuple[str, float]] | None = None,
        replica: int = 0) -> GenerationRow:
    return GenerationRow(id=n, generation=n, started_at=at(started) or "", ready_at=at(ready), ended_at=at(ended),
                         end_reason=None, end_class=None, requests_served=0, pid=None, vllm_version=None,
                         gpu_name=None, model=None, host=None, boot_id=None, replica=replica,
                         start_phases=None if phases is None else json.dumps(phases))


def recycle(g: int, ready: float, downtime: float, strategy: str, replica: int = 0) -> RecycleRow:
    return RecycleRow(id=g, generation=g, trigger="max_requests", cls="scheduled", started_at=at(ready - 10) or "",
                      in_flight=0, queued=0, max_queued=0, drained_at=None, stopped_at=None, ready_at=at(ready),
                      duration_s=None, downtime_s=downtime, strategy=strategy, replica=replica)


# a standby that starts beside generation 1, parks ready, and takes over by an overlap at 100 s:
# its engine work is from its weights (20 s after its spawn) until its engine is up (30 s)
STANDBY = [("spawned", 0.0), ("weights_loaded", 20.0), ("kv_allocated", 22.0), ("graphs_captured", 29.0),
           ("engine_up", 30.0), ("parked", 29.9), ("gate_opened", 50.0), ("api_up", 50.5), ("ready", 50.6)]
HISTORY = RuntimeHistory(
    generations=[gen(1, 0.0, 40.0, 100.5), gen(2, 49.4, 100.0, 170.0, STANDBY), gen(3, 120.0, 175.0, None)],
    recycles=[recycle(1, 100.0, 0.0, "overlap"), recycle(2, 175.0, 5.0, "gated")],
    failures=[],
)


def waits(rows: list[tuple[float, float]], replica: int = 0) -> Waits:
    a = np.array([T0 + r[0] for r in rows])
    t = np.array([r[1] for r in rows])
    return Waits(a, t, np.full(a.size, replica), np.ones(a.size, dtype=int))


def kinds_of(rows: list[tuple[float, float]], h: RuntimeHistory = HISTORY, replica: int = 0) -> list[str]:
    ms = moments(h)
    return [ms[i].kind if i >= 0 else "none" for i in label(waits(rows, replica), ms)]


def test_each_wait_takes_the_moment_it_overlapped() -> None:
    rows = [
        (45.0, 0.02),    # generation 1 serves alone: nothing of the runtime's
        (55.0, 0.02),    # the standby imports (spawned at 49.4, its weights at 69.4)
        (70.0, 0.05),    # its profile run and KV cache, on the GPU
        (78.9, 0.02),    # its graph capture done at 78.4, its warm-up until it parks at 79.3: still engine work
        (85.0, 0.02),    # parked ready: no engine work of its own
        (100.2, 0.09),   # the switch: from 100.0 until generation 1's processes were gone (100.5)
        (99.95, 0.1),    # arrived before the switch, waited into it
        (172.0, 4.0),    # the gated recycle's 5 s without a serving generation (170-175)
        (169.0, 0.02),   # before that gap: generation 3 starting beside 2, no phases in the ledger yet
        (110.0, 0.02),   # generation 2 serves alone
    ]
    assert kinds_of(rows) == ["none", "beside", "standby", "standby", "beside", "switch", "switch", "gap", "beside",
                              "none"]


def test_a_gap_outranks_a_start_beside_and_the_first_start_is_nobodys() -> None:
    h = RuntimeHistory(generations=[gen(1, 0.0, 40.0, 60.0), gen(2, 50.0, 70.0, None, STANDBY)],
                       recycles=[], failures=[FailureRow(1, 1, "crash", "unplanned", at(60.0) or "", -9, None,
                                                         at(61.0))])
    # generation 2's weights at 70 s: a wait from 59.5 s to 62 s overlaps the crash and its start
    assert kinds_of([(5.0, 0.1), (59.5, 2.5), (65.0, 0.01)], h) == ["none", "gap", "beside"]
    # the first generation started with nothing serving: its start is nobody's tail
    assert [m for m in moments(h) if "generation 1 starting" in m.what] == []


def test_another_replicas_moments_are_not_this_ones() -> None:
    h = RuntimeHistory(generations=[gen(1, 0.0, 40.0, None, replica=1), gen(2, 0.0, 40.0, 80.0, replica=0),
                                    gen(3, 50.0, 80.0, None, STANDBY, replica=0)],
                       recycles=[recycle(2, 80.0, 3.0, "cold", replica=0)], failures=[])
    assert kinds_of([(78.0, 1.0), (72.0, 0.05)], h, replica=1) == ["none", "none"]
    assert kinds_of([(78.0, 1.0), (72.0, 0.05)], h, replica=0) == ["gap", "standby"]


def test_the_tail_is_the_slowest_percent_beside_every_request() -> None:
    rng = np.random.default_rng(3)
    quiet = [(float(t), float(rng.uniform(0.015, 0.03))) for t in rng.uniform(0.0, 44.0, 980)]
    slow = [(70.1, 0.048), (70.2, 0.047), (100.1, 0.088), (171.0, 3.9), (172.0, 2.5)]
    f = tail_report(waits(quiet + slow + [(85.0, 0.02)] * 15), HISTORY)
    assert f.present and f.requests == 1000 and f.slowest == 10
    got = {c.kind: (c.tail, c.all) for c in f.kinds}
    assert got["gap"] == (2, 2) and got["switch"] == (1, 1) and got["standby"][0] == 2
    assert sum(t for t, _ in got.values()) == 10 and sum(a for _, a in got.values()) == 1000
    assert [r.kind for r in f.slowest_requests[:5]] == ["gap", "gap", "switch", "standby", "standby"]
    assert f.slowest_requests[0].ttft_s == 3.9 and "gated recycle of generation 2" in f.slowest_requests[0].what
    assert f.threshold_s is not None and f.threshold_s <= 0.047
    parts = {(c.kind, c.part): (c.tail, c.all) for c in f.parts}
    assert parts[("standby", "compiling and profiling")] == (2, 2)
    assert parts[("beside", "parked at its startup gate")] == (0, 15)


def test_no_rows_and_unreadable_phases_say_so() -> None:
    f = tail_report(Waits.empty(), HISTORY)
    assert not f.present and "per-request rows" in f.note
    bad = RuntimeHistory(generations=[gen(1, 0.0, 5.0, None), GenerationRow(**{
        **gen(2, 10.0, None, None).__dict__, "start_phases": "{not json"})], recycles=[], failures=[])
    (m,) = moments(bad)
    assert m.kind == "beside" and "no phases in the ledger yet" in m.what and kinds_of([(20.0, 0.1)], bad) == ["beside"]


def test_the_report_says_where_the_slowest_waited(tmp_path: Path) -> None:
    """A ledger whose requests the runtime's own recorder wrote (as its proxy ends them), its
    generations and a gated recycle as the runtime's schema holds them: `report` names the gap
    in its verdict, its text and its JSON."""
    import sqlite3

    from test_runtime_traffic import _done
    from vllm_guard.runtime.records.traffic import TrafficRecorder
    from vllm_guard.runtime.records.writer import RuntimeLedger

    db = tmp_path / "l.sqlite"
    led = RuntimeLedger(db)
    rec = TrafficRecorder(led, retention_s=86400.0, clock=lambda: T0 + 200.0)
    for i in range(200):
        rec.record(_done(T0 + 41.0 + i * 0.25, 0.02))
    rec.record(_done(T0 + 101.0, 4.0))
    rec.record(_done(T0 + 102.0, 3.0))
    rec.flush(everything=True)
    assert led.close(30.0)
    with sqlite3.connect(db) as c:
        c.executemany("INSERT INTO generations (generation, started_at, ready_at, ended_at, replica, start_phases) "
                      "VALUES (?, ?, ?, ?, 0, ?)",
                      [(1, at(0.0), at(40.0), at(100.0), None), (2, at(49.4), at(105.0), None, json.dumps(STANDBY))])
        c.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight, ready_at, downtime_s, "
                  "strategy, replica) VALUES (1, 'max_requests', 'scheduled', ?, 0, ?, 5.0, 'gated', 0)",
                  (at(90.0), at(105.0)))
    out = subprocess.run([*GUARD_CMD, "report", "--db", str(db), "--format", "json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    t = json.loads(out.stdout)["tail"]
    assert t["present"] and t["requests"] == 202 and t["slowest"] == 2
    assert {k["kind"]: k["tail"] for k in t["kinds"]}["gap"] == 2
    assert t["slowest_requests"][0]["ttft_s"] == 4.0
    text = subprocess.run([*GUARD_CMD, "report", "--db", str(db)], capture_output=True, text=True, timeout=120).stdout
    assert "TTFT tail (the slowest 1 %, 2 of 202 requests" in text and "2 in a gap without a serving generation" in text
    assert "TTFT TAIL" in text and "gated recycle of generation 1 (5.00 s without a serving generation)" in text
