"""Read a ledger for the report, tolerating tables that are absent, empty or of another shape.

The watchdog's `samples` and `incidents` are read as whatever columns exist, with a JSON `data`
column flattened in, so a schema change there degrades the report to a note, never a crash.
Opens the file read-only: a report never writes (nor creates) a ledger.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .store import db_path

REQUEST_FIELDS = ("seq", "sent_at", "ended_at", "scheduled_at", "ttft_s", "ttft_sched_s", "e2e_s", "e2e_sched_s",
                  "itl_mean_s", "output_tokens", "generation")


@dataclass
class LedgerData:
    path: str
    generations: list[dict[str, Any]] = field(default_factory=list)
    recycles: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] | None = None  # None: table absent
    samples: list[dict[str, Any]] | None = None
    soak_samples: list[dict[str, Any]] = field(default_factory=list)
    soak_status: list[dict[str, Any]] = field(default_factory=list)  # status snapshots, data parsed
    runs: list[dict[str, Any]] = field(default_factory=list)
    requests: dict[str, np.ndarray] = field(default_factory=dict)  # numeric columns
    errors: list[str | None] = field(default_factory=list)  # the error column, row-aligned
    meta: dict[str, Any] = field(default_factory=dict)  # `meta` rows, JSON values decoded


def _open(path: str | Path) -> sqlite3.Connection:
    p = db_path(path)
    if not p.exists():
        raise FileNotFoundError(f"no ledger at {p}")
    conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=30.0)
    conn.row_factory = sqlite3.Row
    return conn


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _rows(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(sql, args)]


def _flatten(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its JSON `data` column merged in (row keys win)."""
    data = row.get("data")
    if isinstance(data, str):
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return {**obj, **{k: v for k, v in row.items() if k != "data"}}
    return row


def _merge_sources(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The watchdog writes one row per source per tick (same `at`): one dict per tick,
    {"at": ..., "<source>": <its data>}. Rows without a `source` column are flattened as they are."""
    if not rows or "source" not in rows[0]:
        return [_flatten(r) for r in rows]
    ticks: dict[Any, dict[str, Any]] = {}
    for r in rows:
        tick = ticks.setdefault(r.get("at"), {"at": r.get("at")})
        data = r.get("data")
        try:
            tick[str(r["source"])] = json.loads(data) if isinstance(data, str) else data
        except ValueError:
            continue
    return list(ticks.values())


def load(path: str | Path, run_id: int | None = None) -> LedgerData:
    conn = _open(path)
    try:
        t = _tables(conn)
        d = LedgerData(path=str(db_path(path)))
        if "meta" in t:
            for r in _rows(conn, "SELECT key, value FROM meta"):
                try:
                    d.meta[r["key"]] = json.loads(r["value"])
                except ValueError:
                    d.meta[r["key"]] = r["value"]
        if "generations" in t:
            d.generations = _rows(conn, "SELECT * FROM generations ORDER BY started_at, id")
        if "recycles" in t:
            d.recycles = _rows(conn, "SELECT * FROM recycles ORDER BY started_at, id")
        if "failures" in t:
            d.failures = _rows(conn, "SELECT * FROM failures ORDER BY at, id")
        if "incidents" in t:
            d.incidents = [_flatten(r) for r in _rows(conn, "SELECT * FROM incidents")]
        if "samples" in t:
            d.samples = _merge_sources(_rows(conn, "SELECT * FROM samples ORDER BY id"))
        if "soak_samples" in t:
            d.soak_samples = _rows(conn, "SELECT * FROM soak_samples ORDER BY at, id")
        if "soak_status" in t:
            d.soak_status = [_flatten(r) for r in _rows(conn, "SELECT * FROM soak_status ORDER BY id")]
        if "runs" in t:
            where, args = ("WHERE id = ?", (run_id,)) if run_id is not None else ("", ())
            d.runs = _rows(conn, f"SELECT * FROM runs {where} ORDER BY id", args)
        if "requests" in t and d.runs:
            ids = tuple(int(r["id"]) for r in d.runs)
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
        return d
    finally:
        conn.close()
