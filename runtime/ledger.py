"""The ledger: one SQLite file per state dir (WAL), one schema for the whole project.

Each writer owns its tables: the runtime writes `generations`, `recycles`, `failures`; the
watchdog `samples`, `incidents`; the soak `runs`, `requests`. MTBF is computable from the
runtime's tables alone. Times are ISO 8601 UTC text (sortable), durations are seconds.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import sqlite3
from pathlib import Path
from typing import Any

LEDGER_NAME = "ledger.sqlite"
SCHEMA_VERSION = 1

# Classes of an end of service. Only `unplanned` counts against MTBF.
SCHEDULED = "scheduled"  # count / uptime limits, operator recycles
PREVENTIVE = "preventive"  # memory growth, forecasts, thermals
UNPLANNED = "unplanned"  # crash, hang, OOM, start failure
CLASSES = (SCHEDULED, PREVENTIVE, UNPLANNED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- runtime
CREATE TABLE IF NOT EXISTS generations (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    started_at TEXT NOT NULL,
    ready_at TEXT,
    ended_at TEXT,
    end_reason TEXT,
    end_class TEXT,
    requests_served INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    vllm_version TEXT,
    gpu_name TEXT,
    model TEXT,
    host TEXT,
    boot_id TEXT
);
CREATE TABLE IF NOT EXISTS recycles (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    trigger TEXT NOT NULL,
    class TEXT NOT NULL,
    started_at TEXT NOT NULL,
    in_flight INTEGER NOT NULL,
    queued INTEGER NOT NULL DEFAULT 0,
    max_queued INTEGER NOT NULL DEFAULT 0,
    drained_at TEXT,
    stopped_at TEXT,
    ready_at TEXT,
    duration_s REAL,
    downtime_s REAL
);
CREATE TABLE IF NOT EXISTS failures (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    kind TEXT NOT NULL,
    class TEXT NOT NULL DEFAULT 'unplanned',
    at TEXT NOT NULL,
    exit_code INTEGER,
    detail TEXT,
    restored_at TEXT
);
-- watchdog
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    source TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    cause TEXT,
    class TEXT NOT NULL,
    detected_at TEXT NOT NULL,
    action TEXT,
    restored_at TEXT,
    data TEXT
);
-- soak (owned by vllm_guard.soak; times: ISO text, and epoch seconds in REAL *_at columns)
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    token TEXT NOT NULL UNIQUE,
    started_at TEXT NOT NULL,
    ended_at TEXT,
    status TEXT NOT NULL DEFAULT 'running',
    url TEXT,
    scenario TEXT,
    seed INTEGER,
    duration_s REAL,
    note TEXT,
    params TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    run_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    segment INTEGER NOT NULL DEFAULT 0,
    offset_s REAL,
    scheduled_at REAL,
    sent_at REAL,
    ended_at REAL,
    status INTEGER,
    ttft_s REAL,
    ttft_sched_s REAL,
    e2e_s REAL,
    e2e_sched_s REAL,
    itl_mean_s REAL,
    itl_max_s REAL,
    chunks INTEGER,
    prompt_tokens INTEGER,
    output_tokens INTEGER,
    generation INTEGER,
    error TEXT,
    detail TEXT,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS soak_segments (
    run_id INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    started_at TEXT NOT NULL,
    wall0 REAL NOT NULL,
    offset0 REAL NOT NULL,
    first_seq INTEGER NOT NULL,
    pid INTEGER,
    ended_at TEXT,
    PRIMARY KEY (run_id, segment)
);
CREATE TABLE IF NOT EXISTS soak_samples (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL,
    at TEXT NOT NULL,
    generation INTEGER,
    state TEXT,
    requests_total INTEGER,
    requests_generation INTEGER,
    role TEXT,
    pid INTEGER,
    rss_mb REAL,
    uss_mb REAL,
    gpu_mb REAL,
    host_available_mb REAL
);
CREATE INDEX IF NOT EXISTS soak_samples_at ON soak_samples (run_id, at);
CREATE TABLE IF NOT EXISTS soak_status (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL,
    at TEXT NOT NULL,
    generation INTEGER,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_at ON samples (at);
CREATE INDEX IF NOT EXISTS failures_at ON failures (at);
"""


def utcnow() -> str:
    """Now as ISO 8601 UTC with milliseconds (`2026-11-29T21:19:20.123Z`)."""
    return iso(_dt.datetime.now(_dt.timezone.utc))


def iso(t: _dt.datetime) -> str:
    return t.astimezone(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def boot_id(proc: str = "/proc") -> str:
    """The kernel's boot id; a change between two records means the host rebooted."""
    try:
        return Path(proc, "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def connect(path: str | Path) -> sqlite3.Connection:
    """Open (and create) a ledger with WAL, a busy timeout, and the full schema."""
    p = Path(path)
    if p.is_dir():
        p = p / LEDGER_NAME
    p.parent.mkdir(parents=True, exist_ok=True)
    created = not p.exists()
    conn = sqlite3.connect(str(p), timeout=30.0, isolation_level=None, check_same_thread=False)
    if created:  # group-writable whatever the umask: runtime, watchdog and soak share the file
        try:
            os.chmod(p, 0o660)  # before WAL: SQLite gives -wal/-shm the database's mode
        except OSError:
            pass
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.executescript(_SCHEMA)
    conn.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )
    return conn


class RuntimeLedger:
    """The runtime's writer: generations, recycles and failures."""

    def __init__(self, path: str | Path) -> None:
        self.conn = connect(path)
        self.host = socket.gethostname()
        self.boot_id = boot_id()

    def close(self) -> None:
        self.conn.close()

    def _insert(self, table: str, row: dict[str, Any]) -> int:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        cur = self.conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", tuple(row.values()))
        return int(cur.lastrowid or 0)

    def _update(self, table: str, row_id: int, **values: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in values)
        self.conn.execute(f"UPDATE {table} SET {sets} WHERE id = ?", (*values.values(), row_id))

    def generation_started(self, generation: int, pid: int, model: str) -> int:
        return self._insert(
            "generations",
            {
                "generation": generation,
                "started_at": utcnow(),
                "pid": pid,
                "model": model,
                "host": self.host,
                "boot_id": self.boot_id,
            },
        )

    def generation_ready(self, row_id: int, vllm_version: str, gpu_name: str) -> None:
        self._update("generations", row_id, ready_at=utcnow(), vllm_version=vllm_version, gpu_name=gpu_name)

    def generation_ended(self, row_id: int, reason: str, cls: str, requests_served: int) -> None:
        self._update(
            "generations", row_id, ended_at=utcnow(), end_reason=reason, end_class=cls,
            requests_served=requests_served,
        )

    def recycle_started(self, generation: int, trigger: str, cls: str, in_flight: int, queued: int) -> int:
        return self._insert(
            "recycles",
            {
                "generation": generation,
                "trigger": trigger,
                "class": cls,
                "started_at": utcnow(),
                "in_flight": in_flight,
                "queued": queued,
            },
        )

    def recycle_update(self, row_id: int, **values: Any) -> None:
        self._update("recycles", row_id, **values)

    def failure(self, generation: int, kind: str, exit_code: int | None, detail: str, cls: str = UNPLANNED) -> int:
        return self._insert(
            "failures",
            {
                "generation": generation,
                "kind": kind,
                "class": cls,
                "at": utcnow(),
                "exit_code": exit_code,
                "detail": detail,
            },
        )

    def failure_restored(self, row_id: int) -> None:
        self._update("failures", row_id, restored_at=utcnow())

    def close_open_generations(self, reason: str) -> int:
        """At start: a generation left open by a previous run ended when the runtime died."""
        cur = self.conn.execute(
            "UPDATE generations SET ended_at = COALESCE(ready_at, started_at), end_reason = ?, "
            "end_class = ? WHERE ended_at IS NULL",
            (reason, UNPLANNED),
        )
        return cur.rowcount
