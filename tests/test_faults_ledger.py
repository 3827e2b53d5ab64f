"""Attacks on the runtime's ledger writer, on a real SQLite file: a full disk (a real tmpfs that
returns ENOSPC) and a corrupt page. The thing under test is the writer itself — that the
runtime's calls never wait for SQLite or see its errors, that writes are kept and in order, and
that health says what is wrong — so no vLLM runs here. The same faults against a whole serving
runtime (streams, a recycle, status) are in test_faults_guard.py.

The disk-full case mounts a small tmpfs and so needs root (CAP_SYS_ADMIN); elsewhere it is
skipped with that reason. A held `BEGIN IMMEDIATE` lock is in test_runtime_ledger.py.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from vllm_guard.core import ledger as L
from vllm_guard.runtime.records.writer import RETRY_MAX_S, RuntimeLedger

pytestmark = pytest.mark.faults


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A real, small filesystem of its own (ENOSPC when full), unmounted afterwards."""
    d = Path(tempfile.mkdtemp(prefix="vg-tmpfs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def fill(fs: Path) -> Path:
    """Write until the filesystem says ENOSPC; the filler file is returned (unlink it to free)."""
    path = fs / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC, the real thing
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    os.close(fd)
    return path


def wait(pred: object, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise TimeoutError(f"condition not reached in {timeout} s")


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path / L.LEDGER_NAME)
    try:
        return [tuple(r) for r in db.execute(sql).fetchall()]
    finally:
        db.close()


def test_a_full_disk_delays_the_ledger_never_the_caller_and_nothing_is_lost(capsys: pytest.CaptureFixture[str]) -> None:
    with tmpfs("4m") as fs:
        led = RuntimeLedger(fs)
        row = led.generation_started(1, pid=1234, pid_started=None, model="m")
        led.generation_ready(row, "0.32.0", "")
        wait(lambda: led.health().pending_writes == 0)
        filler = fill(fs)
        t0 = time.monotonic()
        for served in range(1, 201):
            led.generation_progress(row, served)
        rec = led.recycle_started(1, "max_requests", L.SCHEDULED, 2, 1)
        led.failure(1, "crash", 1, "x" * 200, L.UNPLANNED)
        led.generation_ended(row, "max_requests", L.SCHEDULED, 200)
        led.recycle_update(rec, stopped_at="2026-01-01T00:00:00.000Z")
        assert time.monotonic() - t0 < 0.5, "the caller waited for a full disk"
        wait(lambda: not led.health().ok)
        h = led.health()
        assert h.last_error and "full" in h.last_error and h.pending_writes > 0 and h.failed_writes == 0
        time.sleep(2 * RETRY_MAX_S)  # stays full a while: still nothing dropped, the alarm stays
        h = led.health()
        assert not h.ok and h.pending_writes > 0 and h.failed_writes == 0
        freed = time.monotonic()
        filler.unlink()
        wait(lambda: led.health().ok and led.health().pending_writes == 0, 60)
        recovery = time.monotonic() - freed
        assert led.close() and led.health().failed_writes == 0
        assert rows(fs, "SELECT requests_served, end_reason FROM generations") == [(200, "max_requests")]
        assert rows(fs, "SELECT trigger, stopped_at FROM recycles") == [("max_requests", "2026-01-01T00:00:00.000Z")]
        assert rows(fs, "SELECT kind FROM failures") == [("crash",)]
        assert recovery <= RETRY_MAX_S + 5  # the writer's backoff is capped: it notices within one retry
        with capsys.disabled():
            print(f"\n[figure] ledger recovery after a full disk was freed: {recovery:.2f} s")


def test_a_corrupt_page_costs_the_write_that_needs_it_and_nothing_else(tmp_path: Path) -> None:
    first = RuntimeLedger(tmp_path)
    row = first.generation_started(1, pid=1, pid_started=None, model="m")
    for _ in range(3):
        first.recycle_started(1, "max_requests", L.SCHEDULED, 0, 0)
    assert first.close()
    led = RuntimeLedger(tmp_path)  # a running runtime ...
    outside = sqlite3.connect(tmp_path / L.LEDGER_NAME, isolation_level=None)
    try:
        outside.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,), = outside.execute("SELECT rootpage FROM sqlite_master WHERE name = 'recycles'").fetchall()
        (page,), = outside.execute("PRAGMA page_size").fetchall()
        with open(tmp_path / L.LEDGER_NAME, "r+b") as fh:  # ... whose recycles table goes bad under it
            fh.seek((root - 1) * page)
            fh.write(b"\xff" * page)
        outside.execute("UPDATE generations SET model = model")  # (a change: the writer rereads pages)
        led.recycle_started(1, "max_requests", L.SCHEDULED, 0, 0)
        led.generation_progress(row, 9)
        led.failure(1, "crash", 1, "after", L.UNPLANNED)
        wait(lambda: led.health().pending_writes == 0, 60)
        h = led.health()
        assert h.ok and h.failed_writes == 1 and h.last_error and "malformed" in h.last_error
        assert led.close() is True
        assert outside.execute("SELECT requests_served FROM generations").fetchall() == [(9,)]
        assert outside.execute("SELECT detail FROM failures").fetchall() == [("after",)]
    finally:
        outside.close()


def test_a_many_row_write_on_a_full_database_waits_for_room_and_is_not_dropped(tmp_path: Path) -> None:
    """The traffic recorder's batches (request rows, minutes, memory readings) are one
    transaction each. SQLite rolls such a transaction back by itself when the database is full,
    so the writer's own ROLLBACK must not run then: its "no transaction is active" is not
    transient and would get the batch dropped after three tries (seen: `failed_writes` 1 after a
    full disk under load). A real full database: `max_page_count` caps the file, no root needed."""
    led = RuntimeLedger(tmp_path)
    led.put("CREATE TABLE scratch (x BLOB)", (), "scratch table")
    wait(lambda: led.health().pending_writes == 0)
    assert led.conn is not None
    pages = led.conn.execute("PRAGMA page_count").fetchone()[0]
    led.conn.execute(f"PRAGMA max_page_count = {pages + 2}")
    led.put_rows("INSERT INTO scratch (x) VALUES (?)", lambda: [(b"x" * 4000,)] * 50, "50 rows")
    wait(lambda: not led.health().ok)
    h = led.health()
    assert h.last_error and "full" in h.last_error, h
    time.sleep(3 * RETRY_MAX_S)  # more than PERMANENT_TRIES retries while full: still kept
    h = led.health()
    assert not h.ok and h.pending_writes == 1 and h.failed_writes == 0, h
    led.conn.execute("PRAGMA max_page_count = 1073741823")
    wait(lambda: led.health().ok and led.health().pending_writes == 0, 60)
    assert led.close() and led.health().failed_writes == 0
    assert rows(tmp_path, "SELECT COUNT(*) FROM scratch") == [(50,)]
