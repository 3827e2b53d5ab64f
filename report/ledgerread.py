"""Read a ledger for the report, typed: the runtime's rows, the watchdog's ticks, the soak's runs.

The file is opened with `core.ledger.open_readonly` (a report never writes nor creates a
ledger; a file that is not one is a LedgerError). Tables that are absent or empty are fine
(the report says so). A ledger of any schema version is read as it is, never migrated: columns
that migrations add (`ledger._MIGRATIONS`) are read only where `ledger.columns` has them; one
of a newer version is read for what this version knows, and the report says so. Rows that do not match their schema are not skipped in silence: each
table's problems are counted with the first one's message (`Problems`), and the report
shows them.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.core import ledger
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.ledger import LedgerError, RuntimeHistory
from vllm_guard.core.protocol import decode
from vllm_guard.core.samples import SoakStatusRecord, Tick, tick_sources

from .hist import Hist

REQUEST_FIELDS = ("seq", "sent_at", "ended_at", "scheduled_at", "ttft_s", "ttft_sched_s", "e2e_s", "e2e_sched_s",
                  "itl_mean_s", "output_tokens", "generation")
RUN_FIELDS = ("id", "started_at", "ended_at", "status", "scenario", "url", "seed", "duration_s", "note")
SOAK_SAMPLE_FIELDS = ("at", "generation", "role", "pid", "requests_generation", "rss_mb", "uss_mb", "gpu_mb",
                      "host_available_mb")


@dataclass
class Problems:
    """Rows of one table that did not match their schema: how many, and the first one."""

    rows: int = 0
    bad: int = 0
    first: str = ""

    def add(self, where: str, e: Exception) -> None:
        self.bad += 1
        if not self.first:
            self.first = f"{where}: {e}"

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "invalid": self.bad, "first_error": self.first or None}


@dataclass(frozen=True)
class Incident:
    kind: str
    cause: str | None
    cls: str
    detected_at: str
    action: str | None
    restored_at: str | None
    replica: int | None = None  # the replica it is about; None: the box, the runtime, or a ledger before schema 3


@dataclass(frozen=True)
class SoakRun:
    id: int
    started_at: str
    ended_at: str | None
    status: str
    scenario: str | None
    url: str | None
    seed: int | None
    duration_s: float | None
    note: str | None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RUN_FIELDS}


@dataclass(frozen=True)
class SoakSample:
    """One `soak_samples` row (the load generator's copy of the guard's memory reading)."""

    at: str
    generation: int | None
    role: str | None
    pid: int
    requests_generation: int | None
    rss_mb: float | None
    uss_mb: float | None
    gpu_mb: float | None
    host_available_mb: float | None


@dataclass(frozen=True)
class WatchdogMeta:
    """The `watchdog.<key>` rows of `meta` (JSON values) the watchdog records at start: what
    `--compare` labels a ledger by. All absent without a watchdog."""

    gpu_profile: str | None = None
    gpu_budget_mb: float | None = None
    gpu_names: tuple[str, ...] = ()
    gpu_cap_mb: float = 0.0  # an injected budget the card acted as (`core.gpu.capped_total_mb`); 0: none


@dataclass(frozen=True)
class EdgeMinute:
    """One `edge_minutes` row: one replica's requests that ended in one minute (the runtime's)."""

    minute: int  # epoch seconds of the minute's start
    replica: int
    requests: int
    completed: int
    failed: int
    rejected: int
    disconnected: int
    prompt_tokens: int
    completion_tokens: int
    usage_known: int
    ttft: Hist
    e2e: Hist
    itl: Hist


@dataclass(frozen=True)
class ProcessMemoryRow:
    """One `process_memory` row: the runtime's reading of one process."""

    at: float
    replica: int
    generation: int
    pid: int
    role: str
    requests: int | None
    rss_mb: float | None
    uss_mb: float | None
    swap_mb: float | None
    gpu_mb: float | None
    host_available_mb: float | None
    gpu_free_mb: float | None


@dataclass(frozen=True)
class RuntimeMeta:
    """The `runtime.<key>` rows of `meta`: what the runtime measured with."""

    memory_warmup_requests: int | None = None
    request_retention_s: float | None = None


MINUTE_FIELDS = ("minute", "replica", "requests", "completed", "failed", "rejected", "disconnected", "prompt_tokens",
                 "completion_tokens", "usage_known")
MEMORY_FIELDS = ("at", "replica", "generation", "pid", "role", "requests", "rss_mb", "uss_mb", "swap_mb", "gpu_mb",
                 "host_available_mb", "gpu_free_mb")


@dataclass(frozen=True)
class Waits:
    """The runtime's per-request rows with a first token (`edge_requests`), as arrays: one
    element a request, in the table's order."""

    arrived: np.ndarray
    ttft_s: np.ndarray
    replica: np.ndarray
    generation: np.ndarray

    @staticmethod
    def empty() -> Waits:
        z = np.zeros(0)
        return Waits(z, z, z.astype(int), z.astype(int))


@dataclass
class LedgerData:
    path: str
    runtime: RuntimeHistory = field(default_factory=lambda: RuntimeHistory([], [], []))
    incidents: list[Incident] | None = None  # None: table absent
    ticks: list[Tick] | None = None  # the watchdog's samples, one per tick; None: table absent
    tick_problems: Problems = field(default_factory=Problems)
    soak_samples: list[SoakSample] = field(default_factory=list)
    soak_status: list[SoakStatusRecord] = field(default_factory=list)
    status_problems: Problems = field(default_factory=Problems)
    runs: list[SoakRun] = field(default_factory=list)
    requests: dict[str, np.ndarray] = field(default_factory=dict)  # numeric columns
    errors: list[str | None] = field(default_factory=list)  # the error column, row-aligned
    watchdog_meta: WatchdogMeta = field(default_factory=WatchdogMeta)
    meta_problems: Problems = field(default_factory=Problems)
    edge_minutes: list[EdgeMinute] = field(default_factory=list)  # the runtime's traffic, per minute
    minute_problems: Problems = field(default_factory=Problems)
    edge_request_rows: int = 0  # per-request rows the runtime kept (its retention)
    edge_span: tuple[float, float] | None = None  # first arrival, last end of those rows
    waits: Waits = field(default_factory=Waits.empty)  # those rows with a first token (report/tail.py)
    process_memory: list[ProcessMemoryRow] = field(default_factory=list)
    runtime_meta: RuntimeMeta = field(default_factory=RuntimeMeta)
    schema_version: int | None = None  # the file's; above ledger.SCHEMA_VERSION: a newer guard wrote it


def _ticks(conn: sqlite3.Connection, problems: Problems) -> list[Tick]:
    """The watchdog writes one row per source (and per replica) per tick (same `at`): one Tick
    per `at`. A ledger older than schema 3 has no `replica` column: every row is box-wide."""
    replica = "replica" if "replica" in ledger.columns(conn, "samples") else "NULL"
    by_at: dict[str, list[tuple[str, int | None, Any]]] = {}
    bad: dict[str, str] = {}
    for at, source, data, rep in conn.execute(f"SELECT at, source, data, {replica} FROM samples ORDER BY id"):
        rows = by_at.setdefault(str(at), [])
        try:
            rows.append((str(source), rep, json.loads(data)))
        except ValueError as e:
            bad.setdefault(str(at), f"source {source}: not JSON ({e})")
    out = []
    problems.rows = len(by_at)
    for at, rows in by_at.items():
        if at in bad:
            problems.add(f"tick {at}", ProtocolError(bad[at]))
            continue
        try:
            tick: Tick = decode(Tick, {"at": at, **tick_sources(rows)})
        except ProtocolError as e:
            problems.add(f"tick {at}", e)
            continue
        odd = [k for k in (tick.procs or {}) if not k.isdigit()]
        if odd:
            problems.add(f"tick {at}", ProtocolError(f"procs: key {odd[0]!r} is not a pid"))
            continue
        out.append(tick)
    return out


def _soak_status(conn: sqlite3.Connection, problems: Problems) -> list[SoakStatusRecord]:
    out = []
    for i, (at, data) in enumerate(conn.execute("SELECT at, data FROM soak_status ORDER BY id")):
        problems.rows = i + 1
        try:
            out.append(decode(SoakStatusRecord, json.loads(data)))
        except (ProtocolError, ValueError) as e:
            problems.add(f"soak_status at {at}", e)
    return out


_META_TYPES: dict[str, tuple[type, ...]] = {"gpu_profile": (str,), "gpu_budget_mb": (int, float), "gpu_names": (list,),
                                            "gpu_cap_mb": (int, float)}


def _meta_ok(name: str, v: Any) -> bool:
    if name == "gpu_names":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    return isinstance(v, _META_TYPES[name]) and not isinstance(v, bool)


def _watchdog_meta(conn: sqlite3.Connection, problems: Problems) -> WatchdogMeta:
    found: dict[str, Any] = {}
    for key, value in conn.execute("SELECT key, value FROM meta WHERE key LIKE 'watchdog.%'"):
        name = str(key).removeprefix("watchdog.")
        if name not in _META_TYPES:
            continue  # a newer watchdog's key: not ours to read
        problems.rows += 1
        try:
            v: Any = json.loads(value)
        except ValueError as e:
            problems.add(f"meta {key}", e)
            continue
        if not _meta_ok(name, v):
            problems.add(f"meta {key}", ProtocolError(f"value {v!r} is not {'/'.join(t.__name__ for t in _META_TYPES[name])}"))
            continue
        found[name] = tuple(v) if name == "gpu_names" else float(v) if name in ("gpu_budget_mb", "gpu_cap_mb") else v
    return WatchdogMeta(**found)


def _requests(conn: sqlite3.Connection, d: LedgerData) -> None:
    ids = tuple(r.id for r in d.runs)
    marks = ",".join("?" for _ in ids)
    cur = conn.execute(f"SELECT {', '.join(REQUEST_FIELDS)}, error FROM requests "
                       f"WHERE run_id IN ({marks}) ORDER BY sent_at", ids)
    cols: list[list[Any]] = [[] for _ in REQUEST_FIELDS]
    for r in cur:
        for i in range(len(REQUEST_FIELDS)):
            cols[i].append(r[i])
        d.errors.append(r[len(REQUEST_FIELDS)])
    d.requests = {k: np.array([np.nan if v is None else v for v in c], dtype=float)
                  for k, c in zip(REQUEST_FIELDS, cols)}


def _waits(conn: sqlite3.Connection) -> Waits:
    rows = np.array(conn.execute("SELECT arrived, ttft_s, COALESCE(replica, 0), COALESCE(generation, 0) "
                                 "FROM edge_requests WHERE ttft_s IS NOT NULL ORDER BY arrived").fetchall(),
                    dtype=float).reshape(-1, 4)
    return Waits(rows[:, 0], rows[:, 1], rows[:, 2].astype(int), rows[:, 3].astype(int))


def _edge_minutes(conn: sqlite3.Connection, problems: Problems) -> list[EdgeMinute]:
    out = []
    for r in conn.execute(f"SELECT {', '.join(MINUTE_FIELDS)}, ttft, e2e, itl FROM edge_minutes ORDER BY minute, id"):
        problems.rows += 1
        try:
            hists = [Hist.from_json(r[k]) for k in ("ttft", "e2e", "itl")]
        except (ValueError, TypeError) as e:
            problems.add(f"edge_minutes at {r['minute']}", e)
            continue
        ints = {k: int(r[k] or 0) for k in MINUTE_FIELDS}
        out.append(EdgeMinute(**ints, ttft=hists[0], e2e=hists[1], itl=hists[2]))
    return out


def _runtime_meta(conn: sqlite3.Connection) -> RuntimeMeta:
    found: dict[str, Any] = {}
    for key, value in conn.execute("SELECT key, value FROM meta WHERE key LIKE 'runtime.%'"):
        name = str(key).removeprefix("runtime.")
        try:
            if name == "memory_warmup_requests":
                found[name] = int(value)
            elif name == "request_retention_s":
                found[name] = float(value)
        except ValueError:
            continue  # a value of another version: the report's defaults apply
    return RuntimeMeta(**found)


def load(path: str | Path, run_id: int | None = None) -> LedgerData:
    """Everything the report shows; LedgerError when the file is not a ledger, or `run_id`
    names no soak run in it."""
    conn = ledger.open_readonly(path)
    p = ledger.db_path(path)
    try:
        t = ledger.tables(conn)
        d = LedgerData(path=str(p), runtime=ledger.read_runtime(conn), schema_version=ledger.stored_version(conn, p))
        d.watchdog_meta = _watchdog_meta(conn, d.meta_problems)
        d.runtime_meta = _runtime_meta(conn)
        if "edge_minutes" in t:
            d.edge_minutes = _edge_minutes(conn, d.minute_problems)
        if "edge_requests" in t:
            n, lo, hi = conn.execute("SELECT COUNT(*), MIN(arrived), MAX(arrived + e2e_s) FROM edge_requests").fetchone()
            d.edge_request_rows = int(n)
            d.edge_span = (float(lo), float(hi)) if n and lo is not None and hi is not None else None
            d.waits = _waits(conn)
        if "process_memory" in t:
            d.process_memory = [ProcessMemoryRow(*r) for r in conn.execute(
                f"SELECT {', '.join(MEMORY_FIELDS)} FROM process_memory ORDER BY at, id")]
        if "incidents" in t:
            replica = "replica" if "replica" in ledger.columns(conn, "incidents") else "NULL"
            d.incidents = [Incident(*r) for r in conn.execute(
                f"SELECT kind, cause, class, detected_at, action, restored_at, {replica} FROM incidents ORDER BY id")]
        if "samples" in t:
            d.ticks = _ticks(conn, d.tick_problems)
        if "soak_samples" in t:
            d.soak_samples = [SoakSample(*r) for r in conn.execute(
                f"SELECT {', '.join(SOAK_SAMPLE_FIELDS)} FROM soak_samples ORDER BY at, id")]
        if "soak_status" in t:
            d.soak_status = _soak_status(conn, d.status_problems)
        if "runs" in t:
            where, args = ("WHERE id = ?", (run_id,)) if run_id is not None else ("", ())
            d.runs = [SoakRun(*r) for r in conn.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs {where} ORDER BY id",
                                                        args)]
        if run_id is not None and not d.runs:
            known = [r[0] for r in conn.execute("SELECT id FROM runs ORDER BY id")] if "runs" in t else []
            raise LedgerError(f"--run-id has value {run_id}: no soak run with that id in {p} "
                              f"(runs: {', '.join(map(str, known)) or 'none'})")
        if "requests" in t and d.runs:
            _requests(conn, d)
        return d
    except sqlite3.DatabaseError as e:  # a table of another shape: a ledger of another version
        raise LedgerError(f"{p}: cannot read it as a vllm-guard ledger ({e})") from e
    finally:
        conn.close()
