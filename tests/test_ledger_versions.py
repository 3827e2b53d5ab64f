"""Versions that share one ledger (core/ledger.py), on real SQLite files and real processes.

A newer guard backs an older ledger up and migrates it in one transaction; an older guard
refuses a newer ledger before it writes a byte (exit 2, one line); a report reads both without
writing. No vLLM runs here: the commands used (watchdog --once, soak --resume, report) open the
ledger before they would need one.
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GUARD_CMD, ROOT
from vllm_guard.core import ledger as L
from vllm_guard.runtime.records.writer import RuntimeLedger
from vllm_guard.watchdog.store import WatchdogLedger

V2_DDL = Path(__file__).parent / "fixtures" / "ledger" / "schema-v2.sql"
V2_EXAMPLE = ROOT / "docs" / "results" / "h200-2026-11-30" / "example-ledgers" / "a100-80g.sqlite"
NEWER = L.SCHEMA_VERSION + 1


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def beside(p: Path) -> set[str]:
    """The files next to the ledger (its -wal, -shm, backups)."""
    return {x.name for x in p.parent.iterdir()}


def snapshot(p: Path) -> dict[str, object]:
    """Every table's columns and rows (and the version), read without writing."""
    uri = f"file:{p}?mode=ro" if p.with_name(p.name + "-wal").exists() else f"file:{p}?immutable=1"
    c = sqlite3.connect(uri, uri=True)
    try:
        out: dict[str, object] = {"version": L.stored_version(c)}
        for t in sorted(L.tables(c)):
            out[t] = ([r[1] for r in c.execute(f"PRAGMA table_info({t})")],
                      sorted(map(tuple, c.execute(f"SELECT * FROM {t}")), key=repr))
        return out
    finally:
        c.close()


def v2_ledger(p: Path) -> Path:
    """A schema-2 ledger as a guard of 2026-11-30 left it (WAL, closed), with rows in the
    tables schema 3 changes (generations, recycles, samples, incidents) and one it keeps."""
    c = sqlite3.connect(p, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.executescript(V2_DDL.read_text())
    c.executescript("""
        BEGIN;
        INSERT INTO meta VALUES ('schema_version', '2');
        INSERT INTO generations (generation, started_at, ready_at, ended_at, end_reason, end_class, requests_served,
                                 pid, replica, strategy)
            VALUES (1, '2026-11-30T10:00:00.000Z', '2026-11-30T10:01:00.000Z', '2026-11-30T11:00:00.000Z',
                    'max_requests', 'scheduled', 500, 4242, 0, 'stop-start'),
                   (2, '2026-11-30T11:00:05.000Z', '2026-11-30T11:01:00.000Z', NULL, NULL, NULL, 17, 4343, 0,
                    'stop-start');
        INSERT INTO recycles (generation, trigger, class, started_at, in_flight, duration_s, downtime_s, strategy)
            VALUES (1, 'max_requests', 'scheduled', '2026-11-30T11:00:00.000Z', 2, 5.0, 5.0, 'stop-start');
        INSERT INTO failures (generation, kind, at, detail) VALUES (2, 'crash', '2026-11-30T11:30:00.000Z', 'exit 1');
        INSERT INTO samples (at, source, data) VALUES ('2026-11-30T10:00:01.000Z', 'host', '{"mem_available_mb": 1}'),
                                                      ('2026-11-30T10:00:02.000Z', 'host', '{"mem_available_mb": 2}');
        INSERT INTO incidents (kind, cause, class, detected_at, action)
            VALUES ('drift', 'rss', 'preventive', '2026-11-30T10:30:00.000Z', 'recycle');
        INSERT INTO runs (token, started_at, params) VALUES ('t1', '2026-11-30T10:00:00.000Z', '{}');
        COMMIT;
    """)
    c.close()
    return p


def newer_ledger(p: Path) -> Path:
    """A ledger a guard of schema SCHEMA_VERSION+1 left: this schema plus a table and a column
    this version does not know, stamped newer; WAL, closed (no -wal beside it)."""
    conn = L.connect(p)
    conn.execute("INSERT INTO generations (generation, started_at) VALUES (1, '2026-12-05T00:00:00.000Z')")
    conn.close()
    c = sqlite3.connect(p, isolation_level=None)
    c.executescript(f"""
        BEGIN;
        ALTER TABLE generations ADD COLUMN shard INTEGER;
        CREATE TABLE future_table (id INTEGER PRIMARY KEY, x TEXT);
        UPDATE meta SET value = '{NEWER}' WHERE key = 'schema_version';
        COMMIT;
    """)
    c.close()
    return p


# -- old -> new -----------------------------------------------------------------------------------
def test_an_older_ledger_is_backed_up_then_migrated_in_place_keeping_every_row(tmp_path: Path) -> None:
    db = v2_ledger(tmp_path / L.LEDGER_NAME)
    before = snapshot(db)
    conn = L.connect(tmp_path)
    conn.close()
    after = snapshot(db)
    assert after["version"] == L.SCHEMA_VERSION
    for table, cols in L._MIGRATIONS.items():
        assert set(cols) <= set(after[table][0]), table  # type: ignore[index]
    for table in ("edge_requests", "edge_minutes", "process_memory"):  # tables schema 3 added
        assert table in after and table not in before
    for table, (cols, rows) in ((t, v) for t, v in before.items() if t not in ("version", "meta")):  # type: ignore[misc]
        n = len(cols)  # the old columns first, the new ones appended with their defaults
        assert after[table][0][:n] == cols  # type: ignore[index]
        assert sorted((r[:n] for r in after[table][1]), key=repr) == rows, table  # type: ignore[index]
    assert [r[-1] for r in sorted(after["samples"][1])] == [None, None]  # type: ignore[index]  # box-wide
    # the backup is the old file: version 2 and the same rows, a single file (no -wal needed)
    bak = L.backup_path(db, 2)
    assert snapshot(bak) == before
    assert beside(db) == {L.LEDGER_NAME, bak.name}
    meta = dict(after["meta"][1])  # type: ignore[index]
    assert meta["ledger.migrated_from_v2"].endswith(f"to v{L.SCHEMA_VERSION}, backup {bak.name}")


def test_a_current_ledger_is_not_written_by_opening_it(tmp_path: Path) -> None:
    """No backup and no version stamp when the file is already current: its bytes stay."""
    L.connect(tmp_path).close()
    db = tmp_path / L.LEDGER_NAME
    digest = sha(db)
    for _ in range(2):
        L.connect(tmp_path).close()
    assert sha(db) == digest and beside(db) == {L.LEDGER_NAME}


def test_a_new_ledger_has_every_column_a_migration_adds() -> None:
    """`_SCHEMA` is the whole schema; `_MIGRATIONS` only brings older files up to it."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(L._SCHEMA)
    for table, cols in L._MIGRATIONS.items():
        assert set(cols) <= L.columns(conn, table), f"{table}: {set(cols) - L.columns(conn, table)} only in _MIGRATIONS"


def test_the_real_schema_2_example_ledger_migrates_without_losing_a_row(tmp_path: Path) -> None:
    db = tmp_path / "a100-80g.sqlite"
    shutil.copyfile(V2_EXAMPLE, db)
    before = snapshot(db)
    assert before["version"] == 2
    led = RuntimeLedger(db)  # the runtime's writer opens it as `serve` does
    assert led.first_generation == 1 + max(r[1] for r in before["generations"][1])  # type: ignore[index]
    assert led.close()
    after = snapshot(db)
    assert after["version"] == L.SCHEMA_VERSION
    counts = {t: len(v[1]) for t, v in before.items() if t not in ("version", "meta")}  # type: ignore[index]
    assert {t: len(after[t][1]) for t in counts} == counts  # type: ignore[index]
    assert snapshot(L.backup_path(db, 2)) == before


def test_a_ledger_with_our_tables_but_no_version_is_still_someone_elses(tmp_path: Path) -> None:
    db = v2_ledger(tmp_path / L.LEDGER_NAME)
    c = sqlite3.connect(db)
    c.execute("DELETE FROM meta WHERE key = 'schema_version'")
    c.commit()
    c.close()
    digest = sha(db)
    with pytest.raises(L.LedgerError, match="SQLite file of something else") as e:
        L.connect(db)
    assert not isinstance(e.value, L.LedgerVersionError)
    assert sha(db) == digest and beside(db) == {L.LEDGER_NAME}


# -- new -> old -----------------------------------------------------------------------------------
def test_a_newer_ledger_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    db = newer_ledger(tmp_path / L.LEDGER_NAME)
    digest = sha(db)
    for open_it in (L.connect, RuntimeLedger, WatchdogLedger):
        with pytest.raises(L.LedgerVersionError) as e:
            open_it(tmp_path)  # type: ignore[operator]
        line = str(e.value)
        assert "\n" not in line and e.value.exit_code == 2
        assert str(db) in line and f"schema_version {NEWER}" in line and f"this vllm-guard's {L.SCHEMA_VERSION}" in line
        assert "upgrade vllm-guard or point it at another state dir" in line
        assert sha(db) == digest and beside(db) == {L.LEDGER_NAME}  # no WAL switch, no -wal/-shm, no backup


def test_a_newer_ledger_open_in_a_newer_guard_is_refused_too(tmp_path: Path) -> None:
    """A newer runtime serving from the file (its -wal holds commits not yet in the file): the
    version is read through the WAL, and neither file changes."""
    db = newer_ledger(tmp_path / L.LEDGER_NAME)
    newer = sqlite3.connect(db, isolation_level=None)
    try:
        newer.execute("PRAGMA wal_autocheckpoint=0")
        newer.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(NEWER + 1),))  # in -wal only
        wal = db.with_name(db.name + "-wal")
        digests = (sha(db), sha(wal))
        with pytest.raises(L.LedgerVersionError, match=f"schema_version {NEWER + 1}"):
            L.connect(db)
        assert (sha(db), sha(wal)) == digests
    finally:
        newer.close()


def run_guard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GUARD_CMD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1"})


def error_lines(stderr: str) -> list[str]:
    """stderr's lines that are not the JSON log lines a command logs before it fails."""
    return [x for x in stderr.splitlines() if x and not x.startswith("{")]


@pytest.mark.parametrize("command", ["watchdog", "soak"])
def test_an_older_guard_command_refuses_a_newer_ledger_in_one_line_exit_2(tmp_path: Path, command: str) -> None:
    db = newer_ledger(tmp_path / L.LEDGER_NAME)
    digest = sha(db)
    args = {"watchdog": ["watchdog", "--state-dir", str(tmp_path), "--once", "--kernel", "off"],
            "soak": ["soak", "--resume", "--db", str(db), "--no-progress"]}[command]
    out = run_guard(*args)
    lines = error_lines(out.stderr)
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("vllm-guard: error: ") and "Traceback" not in out.stderr, out.stderr
    assert f"schema_version {NEWER}" in lines[0] and "upgrade vllm-guard or point it at another state dir" in lines[0]
    assert sha(db) == digest and beside(db) == {L.LEDGER_NAME}


# -- reports read every version, read-only ----------------------------------------------------------
def test_a_report_reads_a_schema_2_ledger_without_migrating_it(tmp_path: Path) -> None:
    db = tmp_path / "a100-80g.sqlite"
    shutil.copyfile(V2_EXAMPLE, db)
    digest = sha(db)
    out = run_guard("report", "--db", str(db), "--format", "json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert '"failures_unplanned"' in out.stdout and "newer than" not in out.stdout
    assert sha(db) == digest and not any(n.endswith(".bak") for n in beside(db))


def test_a_report_of_a_newer_ledger_says_so_once_and_writes_nothing(tmp_path: Path) -> None:
    db = newer_ledger(tmp_path / L.LEDGER_NAME)
    digest = sha(db)
    out = run_guard("report", "--db", str(db))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"has schema_version {NEWER}, newer than this vllm-guard's {L.SCHEMA_VERSION}") == 1
    assert error_lines(out.stderr) == [x for x in out.stderr.splitlines() if x]  # nothing but the note
    assert len(error_lines(out.stderr)) == 1 and out.stderr.startswith("vllm-guard: note: "), out.stderr
    assert sha(db) == digest


# -- a migration killed midway ------------------------------------------------------------------
# The child stops (sleeps) when SQLite starts the statement that matches, inside connect's one
# transaction, and is killed there: no hook in the product, the test wraps sqlite3.connect.
CHILD = r"""
import re, sqlite3, sys, time
from vllm_guard.core import ledger

stop = re.compile(sys.argv[2], re.M)
real_connect = sqlite3.connect


def connect(*args, **kwargs):
    conn = real_connect(*args, **kwargs)

    def trace(sql):
        if stop.search(sql):
            print("stopped", flush=True)
            time.sleep(600)

    conn.set_trace_callback(trace)
    return conn


sqlite3.connect = connect
ledger.connect(sys.argv[1]).close()
print("stopped", flush=True)  # after COMMIT, connect returned
time.sleep(600)
"""

KILL_AT = {  # where the child dies -> the version the file must wholly be
    "the backup written, not yet renamed": (r"^PRAGMA journal_mode=DELETE", 2),
    "after BEGIN IMMEDIATE": (r"^ALTER TABLE generations", 2),
    "columns added, tables next": (r"CREATE TABLE IF NOT EXISTS edge_requests", 2),
    "all DDL done, version next": (r"^INSERT OR REPLACE INTO meta \(key, value\) VALUES \('schema_version'", 2),
    "at COMMIT": (r"^COMMIT", 2),
    "after COMMIT": (r"(?!)", L.SCHEMA_VERSION),  # matches nothing: stops once connect returned
}


@pytest.mark.parametrize("where", list(KILL_AT))
def test_a_migration_killed_midway_leaves_the_ledger_wholly_old_or_wholly_new(tmp_path: Path, where: str) -> None:
    pattern, expect = KILL_AT[where]
    db = v2_ledger(tmp_path / L.LEDGER_NAME)
    before = snapshot(db)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(db), pattern], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout is not None and child.stdout.readline() == "stopped\n", child.stderr
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    bak = L.backup_path(db, 2)
    tmp = bak.with_name(bak.name + ".tmp")
    if where == "the backup written, not yet renamed":
        assert tmp.exists() and not bak.exists()
    elif expect == 2:
        assert bak.exists() and not tmp.exists()  # the backup comes before the first change
    now = snapshot(db)
    assert now["version"] == expect
    if expect == 2:
        assert now == before  # not one column, table or row of the migration
    else:
        assert {t: len(v[1]) for t, v in now.items() if t in before and t not in ("version", "meta")} == \
               {t: len(v[1]) for t, v in before.items() if t not in ("version", "meta")}  # type: ignore[index]
    # the next guard migrates it cleanly, from a complete backup
    L.connect(db).close()
    done = snapshot(db)
    assert done["version"] == L.SCHEMA_VERSION and "edge_requests" in done
    assert {t: len(v[1]) for t, v in done.items() if t in before and t not in ("version", "meta")} == \
           {t: len(v[1]) for t, v in before.items() if t not in ("version", "meta")}  # type: ignore[index]
    assert snapshot(bak) == before and not tmp.exists()
