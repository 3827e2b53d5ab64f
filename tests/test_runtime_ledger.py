"""The runtime's ledger writer on a real SQLite file: persistent generation numbers, served
counts written as a generation goes (so a killed runtime's generation keeps them), and writes
that wait out a locked database in order instead of blocking or killing the runtime."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from vllm_guard.core import ledger as L
from vllm_guard.core.reliability import service_figures
from vllm_guard.core.timefmt import parse_iso
from vllm_guard.runtime.records.writer import RuntimeLedger


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path / L.LEDGER_NAME)
    try:
        return [tuple(r) for r in db.execute(sql).fetchall()]
    finally:
        db.close()


def test_generation_numbers_continue_across_runtime_processes(tmp_path: Path) -> None:
    first = RuntimeLedger(tmp_path)
    assert first.first_generation == 1
    for n in (1, 2, 3):
        row = first.generation_started(n, pid=1000 + n, pid_started=None, model="m")
        first.generation_ended(row, "max_requests", L.SCHEDULED, 10)
    assert first.close()
    second = RuntimeLedger(tmp_path)
    assert second.first_generation == 4
    row = second.generation_started(4, pid=2000, pid_started=None, model="m")
    assert second.close()
    assert rows(tmp_path, "SELECT id, generation FROM generations ORDER BY id") == [(1, 1), (2, 2), (3, 3), (row, 4)]


def test_a_killed_runtimes_generation_keeps_its_served_count_and_last_seen_time(tmp_path: Path) -> None:
    led = RuntimeLedger(tmp_path)
    row = led.generation_started(1, pid=1234, pid_started=None, model="m")
    led.generation_ready(row, "0.32.0", "")
    for served in (5, 17, 42):
        time.sleep(0.02)
        led.generation_progress(row, served)
    assert led.close()  # ...and then the runtime is killed: nothing ends the generation
    (ready_at, updated_at), = rows(tmp_path, "SELECT ready_at, updated_at FROM generations")
    assert str(updated_at) > str(ready_at)

    again = RuntimeLedger(tmp_path)
    assert [g.generation for g in again.open_generations()] == [1]
    again.close_open_generations("runtime_lost")
    assert again.close()
    (ended_at, reason, cls, served), = rows(
        tmp_path, "SELECT ended_at, end_reason, end_class, requests_served FROM generations")
    assert (reason, cls, served) == ("runtime_lost", "unplanned", 42)
    assert ended_at == updated_at != ready_at
    # the up time MTBF counts is ready -> last seen (not zero), and the end is one unplanned event
    assert parse_iso(str(ended_at)) > parse_iso(str(ready_at))
    figs = service_figures(L.read_runtime(L.open_readonly(tmp_path)), now=parse_iso(str(ended_at)).timestamp() + 60)
    assert figs.failures_unplanned == 1 and figs.requests_served == 42


def test_progress_never_reopens_an_ended_generation(tmp_path: Path) -> None:
    led = RuntimeLedger(tmp_path)
    row = led.generation_started(1, pid=1, pid_started=None, model="m")
    led.generation_ended(row, "shutdown", L.SCHEDULED, 7)
    led.generation_progress(row, 99)  # a late sample after the end
    assert led.close()
    assert rows(tmp_path, "SELECT requests_served, end_reason FROM generations") == [(7, "shutdown")]


def test_writes_wait_out_a_locked_ledger_in_order_without_blocking_the_caller(tmp_path: Path) -> None:
    led = RuntimeLedger(tmp_path, busy_timeout_s=0.1)
    outside = sqlite3.connect(tmp_path / L.LEDGER_NAME, isolation_level=None)
    outside.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        t0 = time.monotonic()
        row = led.generation_started(1, pid=1, pid_started=None, model="m")
        led.generation_ready(row, "v", "")
        rec = led.recycle_started(1, "max_requests", L.SCHEDULED, 3, 2)
        led.recycle_update(rec, drained_at="2026-01-01T00:00:00.000Z")
        led.generation_ended(row, "max_requests", L.SCHEDULED, 50)
        assert time.monotonic() - t0 < 0.1, "the caller waited for SQLite"
        end = time.monotonic() + 30
        while led.health().ok and time.monotonic() < end:
            time.sleep(0.05)
        h = led.health()
        assert not h.ok and h.pending_writes == 5 and h.last_error and "locked" in h.last_error
    finally:
        outside.execute("COMMIT")
        outside.close()
    end = time.monotonic() + 30
    while led.health().pending_writes and time.monotonic() < end:
        time.sleep(0.05)
    h = led.health()
    assert h.ok and h.pending_writes == 0 and h.failed_writes == 0
    assert led.close()
    assert rows(tmp_path, "SELECT requests_served, end_reason FROM generations") == [(50, "max_requests")]
    assert rows(tmp_path, "SELECT in_flight, queued, drained_at FROM recycles") == [
        (3, 2, "2026-01-01T00:00:00.000Z")]


def test_close_gives_up_on_a_ledger_that_stays_locked_and_counts_the_lost_writes(tmp_path: Path) -> None:
    led = RuntimeLedger(tmp_path, busy_timeout_s=0.05)
    outside = sqlite3.connect(tmp_path / L.LEDGER_NAME, isolation_level=None)
    outside.execute("BEGIN IMMEDIATE")
    try:
        led.generation_started(1, pid=1, pid_started=None, model="m")
        led.failure(1, "crash", 0, "x", L.UNPLANNED)
        assert led.close(timeout=0.5) is False
        assert led.health().failed_writes == 2
    finally:
        outside.execute("ROLLBACK")
        outside.close()


def test_an_older_ledger_gains_the_updated_at_column(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / L.LEDGER_NAME)
    db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "INSERT INTO meta VALUES ('schema_version', '1');"
                     "CREATE TABLE generations (id INTEGER PRIMARY KEY, generation INTEGER NOT NULL, "
                     "started_at TEXT NOT NULL, ready_at TEXT, ended_at TEXT, end_reason TEXT, end_class TEXT, "
                     "requests_served INTEGER NOT NULL DEFAULT 0, pid INTEGER, vllm_version TEXT, gpu_name TEXT, "
                     "model TEXT, host TEXT, boot_id TEXT);"
                     "INSERT INTO generations (generation, started_at, ready_at) VALUES "
                     "(7, '2026-01-01T00:00:00.000Z', '2026-01-01T00:01:00.000Z');")
    db.commit()
    db.close()
    led = RuntimeLedger(tmp_path)
    assert led.first_generation == 8
    led.close_open_generations("runtime_lost")
    assert led.close()
    # no incremental update known: the old rule (ready_at) is all there is
    assert rows(tmp_path, "SELECT ended_at FROM generations") == [("2026-01-01T00:01:00.000Z",)]


def test_a_lost_generation_is_a_failure_restored_only_when_its_replica_serves_again(tmp_path: Path) -> None:
    """A killed runtime's open generation is a `runtime_lost` failure of its own. A next runtime
    stopped before it ever served restores nothing; the one after, once it serves, does."""
    from vllm_guard.runtime.records.books import RuntimeBooks

    a = RuntimeLedger(tmp_path)
    row = a.generation_started(1, pid=1234, pid_started=None, model="m")
    a.generation_ready(row, "0.32.0", "")
    a.generation_progress(row, 7)
    assert a.close()  # killed: generation 1 is left open

    b = RuntimeLedger(tmp_path)
    books = RuntimeBooks(b, failure_window=600.0)
    lost = b.close_open_generations("runtime_lost")
    assert [(x.generation, x.replica) for x in lost] == [(1, 0)]
    for x in lost:
        books.lost(x.generation, x.replica, x.failure_id, x.at)
    row2 = b.generation_started(2, pid=2345, pid_started=None, model="m")
    time.sleep(0.05)
    b.generation_ended(row2, "shutdown", L.SCHEDULED, 0)  # stopped while it was still starting
    assert b.close()
    assert rows(tmp_path, "SELECT generation, kind, class, restored_at FROM failures") == \
        [(1, "runtime_lost", "unplanned", None)]
    figs = service_figures(L.read_runtime(L.open_readonly(tmp_path)), now=time.time())
    (ev,) = figs.unplanned_events
    assert ev.kind == "runtime_lost" and ev.restored_at is None and ev.restore_s is None
    assert figs.mttr_s is None, "a restore that never happened"

    c = RuntimeLedger(tmp_path)
    books = RuntimeBooks(c, failure_window=600.0)
    assert c.close_open_generations("runtime_lost") == []
    row3 = c.generation_started(3, pid=3456, pid_started=None, model="m")
    time.sleep(0.05)
    c.generation_ready(row3, "0.32.0", "")
    assert c.close()
    figs = service_figures(L.read_runtime(L.open_readonly(tmp_path)), now=time.time())
    (ev,) = figs.unplanned_events
    ready3 = rows(tmp_path, "SELECT ready_at FROM generations WHERE generation = 3")[0][0]
    assert ev.restored_at == ready3 and ev.restore_s is not None and ev.restore_s > 0
