"""The ledger: one SQLite file per state dir (WAL), one schema for the whole project.

Each writer owns its tables (`OWNERS`): the runtime writes `generations`, `recycles`,
`failures` and what it measures of the traffic and its processes (`edge_requests`, one row per
request for `[ledger] request_retention`; `edge_minutes`, per-minute counts and latency
histograms for the ledger's life; `process_memory`, downsampled with age); the watchdog `samples`, `incidents`; the load generator `runs`, `requests` and
the `soak_*` tables. Everyone may read everything. Times are ISO 8601 UTC text (sortable),
durations seconds.

Versions share the file by `meta.schema_version` (`SCHEMA_VERSION`). A newer guard upgrades an
older ledger on open: a backup copy beside it, then the missing tables and columns
(`_MIGRATIONS`) and the new version in one transaction. An older guard never writes a newer
ledger (`LedgerVersionError`, before it writes a byte); a report reads any version read-only.
"""

from __future__ import annotations

import enum
import os
import re
import sqlite3
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .errors import EXIT_USAGE, GuardError
from .timefmt import utcnow

LEDGER_NAME = "ledger.sqlite"
SCHEMA_VERSION = 4
BUSY_TIMEOUT_S = 5.0

OWNERS: dict[str, str] = {
    "meta": "everyone (own key prefixes)",
    "generations": "runtime", "recycles": "runtime", "failures": "runtime",
    "edge_requests": "runtime", "edge_minutes": "runtime", "process_memory": "runtime",
    "samples": "watchdog", "incidents": "watchdog",
    "runs": "loadgen", "requests": "loadgen", "soak_segments": "loadgen", "soak_samples": "loadgen",
    "soak_status": "loadgen",
}


class EndClass(str, enum.Enum):
    """How a generation's service ended. Only UNPLANNED counts against MTBF."""

    SCHEDULED = "scheduled"  # count / uptime limits, idle, operator recycles, shutdown
    PREVENTIVE = "preventive"  # memory growth, forecasts, thermals
    UNPLANNED = "unplanned"  # crash, hang, OOM, start failure, runtime lost


SCHEDULED, PREVENTIVE, UNPLANNED = EndClass.SCHEDULED.value, EndClass.PREVENTIVE.value, EndClass.UNPLANNED.value
CLASSES = tuple(c.value for c in EndClass)


class FailureKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    START_FAILED = "start_failed"
    START_TIMEOUT = "start_timeout"
    RESTART = "restart"  # an operator's or the watchdog's hard restart
    RUNTIME_LOST = "runtime_lost"  # the runtime itself died with this generation serving


class LedgerError(GuardError):
    """The file is not a vllm-guard ledger, or cannot be opened."""


class LedgerVersionError(LedgerError):
    """The ledger was written by a newer vllm-guard (its schema_version is above ours): this one
    must not write it. A config error, like a wrong state dir: exit 2, nothing started, the
    file untouched."""

    exit_code = EXIT_USAGE

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
    boot_id TEXT,
    pid_started REAL,
    replica INTEGER NOT NULL DEFAULT 0,
    strategy TEXT,
    updated_at TEXT,
    -- where its start went: JSON [[phase, seconds after spawn], ...] in the order a start goes
    -- (runtime/child/anatomy.py ORDER); written when it is ready and again when it ends
    start_phases TEXT,
    -- the configuration it ran (runtime/reload.py `config_hash`); after a reload, the keys it changed (JSON)
    config_hash TEXT,
    config_changed TEXT,
    -- where its weights came from: held (mapped from the replica's holder) or disk, with why
    weights_source TEXT,
    weights_note TEXT,
    -- where its KV cache came from: held (the holder's, shared by generations that never compute at once) or own
    kv_source TEXT,
    kv_note TEXT
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
    downtime_s REAL,
    strategy TEXT,
    replica INTEGER NOT NULL DEFAULT 0
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
-- runtime: what the proxy and the memory monitor measure (times: epoch seconds, REAL)
CREATE TABLE IF NOT EXISTS edge_requests (
    id INTEGER PRIMARY KEY,
    arrived REAL NOT NULL,
    request_id TEXT,
    replica INTEGER,
    generation INTEGER,
    outcome TEXT NOT NULL,
    status INTEGER,
    reason TEXT,
    stream INTEGER,
    resumed INTEGER,
    ttft_s REAL,
    e2e_s REAL,
    chunks INTEGER,
    itl_mean_s REAL,
    itl_max_s REAL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER
);
CREATE INDEX IF NOT EXISTS edge_requests_arrived ON edge_requests (arrived);
CREATE TABLE IF NOT EXISTS edge_minutes (
    id INTEGER PRIMARY KEY,
    minute INTEGER NOT NULL,
    replica INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    completed INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    rejected INTEGER NOT NULL,
    disconnected INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    usage_known INTEGER NOT NULL,
    ttft TEXT NOT NULL,
    e2e TEXT NOT NULL,
    itl TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS edge_minutes_minute ON edge_minutes (minute);
CREATE TABLE IF NOT EXISTS process_memory (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    role TEXT NOT NULL,
    requests INTEGER,
    rss_mb REAL,
    uss_mb REAL,
    swap_mb REAL,
    gpu_mb REAL,
    host_available_mb REAL,
    gpu_free_mb REAL
);
CREATE INDEX IF NOT EXISTS process_memory_at ON process_memory (at);
-- watchdog
-- replica: the replica a row is about (its index); NULL: the box, not one replica
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY,
    at TEXT NOT NULL,
    source TEXT NOT NULL,
    data TEXT NOT NULL,
    replica INTEGER
);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    cause TEXT,
    class TEXT NOT NULL,
    detected_at TEXT NOT NULL,
    action TEXT,
    restored_at TEXT,
    data TEXT,
    replica INTEGER
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


# column -> DDL, per table: what an older ledger lacks gets added on open
_MIGRATIONS: dict[str, dict[str, str]] = {
    "generations": {"pid_started": "REAL", "replica": "INTEGER NOT NULL DEFAULT 0", "strategy": "TEXT",
                    "updated_at": "TEXT", "start_phases": "TEXT",
                    # schema 4: the configuration it ran (runtime/reload.py `config_hash`) and, on the
                    # first generation of a replica after a reload, the keys that reload changed (JSON list)
                    "config_hash": "TEXT", "config_changed": "TEXT",
                    # where its weights came from (`[server] hold_weights`)
                    "weights_source": "TEXT", "weights_note": "TEXT",
                    # where its KV cache came from (`[server] hold_kv_cache`)
                    "kv_source": "TEXT", "kv_note": "TEXT"},
    "recycles": {"strategy": "TEXT", "replica": "INTEGER NOT NULL DEFAULT 0"},
    # schema 3: the watchdog watches every replica (NULL: a box-wide row, as every older row is)
    "samples": {"replica": "INTEGER"},
    "incidents": {"replica": "INTEGER"},
}


# Samples downsampled with age (the watchdog's `samples`, the runtime's `process_memory`):
# (older than s, keep one per bucket of s): the newest hour in full, then one a minute up to a
# day, one per 10 minutes up to 30 days, one an hour beyond.
DOWNSAMPLE: tuple[tuple[float, int], ...] = ((3600.0, 60), (86400.0, 600), (30 * 86400.0, 3600))


def db_path(db: str | Path) -> Path:
    """The ledger file for a state dir or a file path."""
    p = Path(db)
    return p / LEDGER_NAME if p.is_dir() else p


def _ddl(script: str) -> tuple[tuple[str, str, str], ...]:
    """`_SCHEMA` as (type, name, statement) per CREATE, in order (each one is run on its own)."""
    out, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if not sqlite3.complete_statement(buf):  # a `;` in a comment does not end one
            continue
        stmt, buf = buf.strip(), ""
        m = re.search(r"CREATE (TABLE|INDEX) IF NOT EXISTS (\w+)", stmt)
        if m is None:
            raise AssertionError(f"_SCHEMA: not a CREATE ... IF NOT EXISTS: {stmt[:60]!r}")
        out.append((m[1].lower(), m[2], stmt))
    if re.sub(r"--[^\n]*", "", buf).strip():
        raise AssertionError(f"_SCHEMA: an unfinished statement: {buf.strip()[:60]!r}")
    return tuple(out)


_DDL = _ddl(_SCHEMA)


def stored_version(conn: sqlite3.Connection, where: str | Path = "the ledger") -> int | None:
    """The file's `schema_version`; None when it has no meta table or no version row (a new
    file, or an SQLite file of something else)."""
    if "meta" not in tables(conn):
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        return None
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise LedgerError(f"{where}: schema_version has value {row[0]!r}: not an integer") from None


def newer_line(p: str | Path, version: int) -> str:
    """The one line that says a ledger is of a newer schema than this vllm-guard's."""
    return (f"{p} has schema_version {version}, newer than this vllm-guard's {SCHEMA_VERSION} "
            f"(a newer vllm-guard wrote it)")


def refuse_newer(p: Path, version: int | None) -> None:
    """LedgerVersionError when `version` (the file's, `file_version`) is newer than ours: a
    writer's check, before it writes anything."""
    if version is not None and version > SCHEMA_VERSION:
        raise LedgerVersionError(f"{newer_line(p, version)}; refusing to write it: upgrade vllm-guard or point "
                                 "it at another state dir")


def _uri(p: Path, mode: str) -> str:
    return f"file:{urllib.parse.quote(str(p.resolve()))}?{mode}"


def file_version(path: str | Path) -> int | None:
    """The `schema_version` of an existing ledger file, read without writing a byte in it or
    beside it; None for a new or empty file, or one that is not SQLite (`connect` says why).

    A plain read-only open of a WAL database creates `-wal` and `-shm` and leaves them. With
    no `-wal` beside the file no process has it open and every commit is in the file itself,
    so it is read `immutable` (nothing created); with one, a read-only open adds nothing new."""
    p = db_path(path)
    mode = "mode=ro" if p.with_name(p.name + "-wal").exists() else "immutable=1"
    try:
        conn = sqlite3.connect(_uri(p, mode), uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            return stored_version(conn, p)
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return None


def _missing(conn: sqlite3.Connection) -> list[str]:
    """What this file lacks of `_SCHEMA`: the columns of `_MIGRATIONS` on tables it has, then
    the tables and indexes it has not (created whole), in `_SCHEMA`'s order."""
    have = {(r[0], r[1]) for r in conn.execute("SELECT type, name FROM sqlite_master")}
    out = [f"ALTER TABLE {table} ADD COLUMN {col} {ddl}"
           for table, cols in _MIGRATIONS.items() if ("table", table) in have
           for col, ddl in cols.items() if col not in columns(conn, table)]
    return out + [stmt for kind, name, stmt in _DDL if (kind, name) not in have]


def backup_path(p: Path, version: int) -> Path:
    """Where the copy of a ledger of `version` is kept before it is migrated."""
    return p.with_name(f"{p.name}.v{version}.bak")


def _backup(p: Path, version: int, busy_timeout_s: float) -> Path:
    """Copy the ledger as it is before its migration to `backup_path`, a self-contained file
    (no -wal) an older vllm-guard opens as it was.

    Through SQLite's online backup API (`Connection.backup`), not a file copy: a `cp` of a WAL
    database misses what is committed in `-wal` and may catch a page mid-checkpoint; the API
    copies one consistent snapshot through SQLite's own locks. It runs while the migrating
    connection holds the write lock with nothing written yet, so the copy is exactly what is
    migrated, from a second connection (a connection cannot back up a database while it holds a
    write transaction on it). Written under a temporary name and renamed: a kill mid-copy
    leaves no partial `.bak`."""
    bak = backup_path(p, version)
    tmp = bak.with_name(bak.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        src = sqlite3.connect(_uri(p, "mode=ro"), uri=True, timeout=busy_timeout_s)
        dst = sqlite3.connect(str(tmp))
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
            src.close()
        os.chmod(tmp, stat.S_IMODE(p.stat().st_mode))  # readable by whom the ledger is
        os.replace(tmp, bak)
    except (OSError, sqlite3.Error) as e:
        tmp.unlink(missing_ok=True)
        raise LedgerError(f"{p}: cannot write its backup {bak.name} before migrating it from schema {version} to "
                          f"{SCHEMA_VERSION} ({e}); nothing was changed") from e
    return bak


def _upgrade(conn: sqlite3.Connection, p: Path, busy_timeout_s: float) -> None:
    """Bring the file to `_SCHEMA` and `SCHEMA_VERSION` in one transaction (BEGIN IMMEDIATE ...
    COMMIT): a kill leaves it wholly old or wholly new. An older version is backed up first.
    A current file that lacks nothing is not written at all."""
    if stored_version(conn, p) == SCHEMA_VERSION and not _missing(conn):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        old = stored_version(conn, p)  # again under the lock: another process may have moved it
        refuse_newer(p, old)
        bak = _backup(p, old, busy_timeout_s) if old is not None and old < SCHEMA_VERSION else None
        for stmt in _missing(conn):
            conn.execute(stmt)
        if old != SCHEMA_VERSION:
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
        if bak is not None:  # when, and where the old file is: `ledger.migrated_from_v2`
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                         (f"ledger.migrated_from_v{old}", f"{utcnow()} to v{SCHEMA_VERSION}, backup {bak.name}"))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def connect(path: str | Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> sqlite3.Connection:
    """Open (and create) a ledger for writing: WAL, a busy timeout, the full schema.

    A ledger of a newer schema is refused (`LedgerVersionError`) before a byte of it is written;
    an older one is backed up and migrated (`_upgrade`)."""
    p = db_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    created = not p.exists()
    if created:  # group-writable whatever the umask: runtime, watchdog and soak share the file
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o660)
        os.close(fd)
        try:
            os.chmod(p, 0o660)  # before WAL: SQLite gives -wal/-shm the database's mode
        except OSError:
            pass
    else:  # read-only, before WAL mode (which writes the header) or anything else
        refuse_newer(p, file_version(p))
    conn = sqlite3.connect(str(p), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        have = tables(conn)
        if have and stored_version(conn, p) is None:
            raise LedgerError(f"{p} is an SQLite file of something else (tables: {', '.join(sorted(have)[:5])}); "
                              "refusing to add the ledger's tables to it")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        _upgrade(conn, p, busy_timeout_s)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise LedgerError(f"{p} is not a usable vllm-guard ledger: {e}") from e
    except LedgerError:
        conn.close()
        raise
    return conn


def open_readonly(path: str | Path) -> sqlite3.Connection:
    """Open an existing ledger read-only (a report never writes or creates one); LedgerError
    when the file is missing, is not SQLite, or is an SQLite file of something else."""
    p = db_path(path)
    if not p.exists():
        raise LedgerError(f"no ledger at {p}")
    if p.is_dir():
        raise LedgerError(f"{p} is a directory, not a ledger")
    conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=30.0)
    conn.row_factory = sqlite3.Row
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        ok = "meta" in tables and conn.execute(
            "SELECT 1 FROM meta WHERE key = 'schema_version'").fetchone() is not None
    except sqlite3.DatabaseError as e:
        conn.close()
        raise LedgerError(f"{p} is not a vllm-guard ledger ({e})") from e
    if not ok:
        conn.close()
        raise LedgerError(f"{p} is an SQLite file but not a vllm-guard ledger (no schema_version)")
    return conn


def tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


# -- typed rows of the runtime's tables (what MTBF and the report read) ----------------------
@dataclass(frozen=True)
class GenerationRow:
    id: int
    generation: int
    started_at: str
    ready_at: str | None
    ended_at: str | None
    end_reason: str | None
    end_class: str | None
    requests_served: int
    pid: int | None
    vllm_version: str | None
    gpu_name: str | None
    model: str | None
    host: str | None
    boot_id: str | None
    replica: int = 0
    strategy: str | None = None
    updated_at: str | None = None  # the runtime's last incremental update of a serving generation
    start_phases: str | None = None  # JSON [[phase, seconds after spawn], ...] (core.phases)


@dataclass(frozen=True)
class RecycleRow:
    id: int
    generation: int
    trigger: str
    cls: str
    started_at: str
    in_flight: int
    queued: int
    max_queued: int
    drained_at: str | None
    stopped_at: str | None
    ready_at: str | None
    duration_s: float | None
    downtime_s: float | None
    strategy: str | None = None
    replica: int = 0


@dataclass(frozen=True)
class FailureRow:
    id: int
    generation: int
    kind: str
    cls: str
    at: str
    exit_code: int | None
    detail: str | None
    restored_at: str | None


def _typed(cls: type, rows: Iterable[sqlite3.Row], rename: dict[str, str] | None = None) -> list[Any]:
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    out = []
    for r in rows:
        d = {(rename or {}).get(k, k): r[k] for k in r.keys()}
        out.append(cls(**{k: v for k, v in d.items() if k in names}))
    return out


@dataclass(frozen=True)
class RuntimeHistory:
    """The runtime's three tables, in time order."""

    generations: list[GenerationRow]
    recycles: list[RecycleRow]
    failures: list[FailureRow]


def read_runtime(conn: sqlite3.Connection) -> RuntimeHistory:
    t = tables(conn)
    gens = _typed(GenerationRow, conn.execute("SELECT * FROM generations ORDER BY started_at, id")) \
        if "generations" in t else []
    recs = _typed(RecycleRow, conn.execute("SELECT * FROM recycles ORDER BY started_at, id"), {"class": "cls"}) \
        if "recycles" in t else []
    fails = _typed(FailureRow, conn.execute("SELECT * FROM failures ORDER BY at, id"), {"class": "cls"}) \
        if "failures" in t else []
    return RuntimeHistory(gens, recs, fails)


def next_generation(conn: sqlite3.Connection) -> int:
    """Generation numbers continue across runtime processes: one number, one generation."""
    row = conn.execute("SELECT MAX(generation) FROM generations").fetchone()
    return int(row[0] or 0) + 1
