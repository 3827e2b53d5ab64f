"""The soak's ledger writer: every finished request goes to SQLite at once, commits grouped.

A writer thread takes rows from a queue and commits whatever has accumulated in one
transaction (group commit): when idle each row commits alone within milliseconds, under load
rows share commits. A `kill -9` loses only the rows still in the queue, which the sent journal
then accounts for. The sent journal is an append-only file written with one `os.write` per
request *before* it is sent; the kernel keeps it even if the process is killed, so a resumed
run knows exactly which requests reached the server without a result.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from vllm_guard.core import ledger
from vllm_guard.core.samples import SoakStatusRecord
from vllm_guard.core.timefmt import utcnow

from .params import SoakParams


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One `requests` row: a finished (or lost) request. Times `*_at` are epoch seconds."""

    run_id: int
    seq: int
    request_id: str
    segment: int = 0
    offset_s: float | None = None  # scheduled run-time offset
    scheduled_at: float | None = None
    sent_at: float | None = None
    ended_at: float | None = None
    status: int | None = None  # HTTP status
    ttft_s: float | None = None
    ttft_sched_s: float | None = None
    e2e_s: float | None = None
    e2e_sched_s: float | None = None
    itl_mean_s: float | None = None
    itl_max_s: float | None = None
    chunks: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    generation: int | None = None
    error: str | None = None  # category; None = success
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """One `soak_samples` row: one process of the guard's memory reading."""

    run_id: int
    at: str  # the reading's time (ISO)
    generation: int
    state: str
    requests_total: int
    requests_generation: int  # requests this generation had taken when read
    role: str
    pid: int
    rss_mb: float
    uss_mb: float | None
    gpu_mb: float | None
    host_available_mb: float | None


@dataclass(frozen=True)
class StoredRun:
    id: int
    token: str
    status: str
    params: str  # SoakParams as JSON


REQUEST_COLS = tuple(f.name for f in dataclasses.fields(RequestRow))
SAMPLE_COLS = tuple(f.name for f in dataclasses.fields(MemoryRow))
_SQL = {
    "requests": f"INSERT OR IGNORE INTO requests ({', '.join(REQUEST_COLS)}) "
                f"VALUES ({', '.join('?' for _ in REQUEST_COLS)})",
    "soak_status": "INSERT INTO soak_status (run_id, at, generation, data) VALUES (?, ?, ?, ?)",
    "soak_samples": f"INSERT INTO soak_samples ({', '.join(SAMPLE_COLS)}) "
                    f"VALUES ({', '.join('?' for _ in SAMPLE_COLS)})",
}
_STOP = object()


class SoakStore:
    """Runs, segments, requests and samples of one soak process."""

    def __init__(self, db: str | Path, max_batch: int = 1024) -> None:
        self.path = ledger.db_path(db)
        self.conn = ledger.connect(self.path)
        self.max_batch = max_batch
        self.commits = 0
        self.rows = 0
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._writer, name="soak-ledger", daemon=True)
        self._thread.start()
        self._journal_fd: int | None = None

    # -- run bookkeeping (main thread, rare) ----------------------------------------------------
    def create_run(self, token: str, params: SoakParams, note: str) -> int:
        cur = self.conn.execute(
            "INSERT INTO runs (token, started_at, url, scenario, seed, duration_s, note, params) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (token, utcnow(), params.url, params.scenario, params.seed, params.duration_s, note,
             params.to_json()),
        )
        return int(cur.lastrowid or 0)

    def unfinished_runs(self) -> list[StoredRun]:
        """Runs not done, newest first: what `--resume-or-start` looks through."""
        rows = self.conn.execute("SELECT id, token, status, params FROM runs WHERE status != 'done' "
                                 "ORDER BY id DESC").fetchall()
        return [StoredRun(int(r["id"]), str(r["token"]), str(r["status"]), str(r["params"])) for r in rows]

    def stored_run(self, run_id: int | None = None) -> StoredRun | None:
        """Run `run_id`, or (None) the last one not done: what `--resume` continues."""
        sql = "SELECT id, token, status, params FROM runs "
        row = self.conn.execute(sql + "WHERE id = ?", (run_id,)).fetchone() if run_id is not None else \
            self.conn.execute(sql + "WHERE status != 'done' ORDER BY id DESC LIMIT 1").fetchone()
        return None if row is None else StoredRun(int(row["id"]), str(row["token"]), str(row["status"]),
                                                  str(row["params"]))

    def start_segment(self, run_id: int, wall0: float, offset0: float, first_seq: int) -> int:
        seg = self.conn.execute("SELECT COALESCE(MAX(segment) + 1, 0) FROM soak_segments WHERE run_id = ?",
                                (run_id,)).fetchone()[0]
        self.conn.execute(
            "INSERT INTO soak_segments (run_id, segment, started_at, wall0, offset0, first_seq, pid) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (run_id, seg, utcnow(), wall0, offset0, first_seq, os.getpid()))
        self.conn.execute("UPDATE runs SET status = 'running', ended_at = NULL WHERE id = ?", (run_id,))
        return int(seg)

    def last_segment(self, run_id: int) -> int:
        row = self.conn.execute("SELECT MAX(segment) FROM soak_segments WHERE run_id = ?", (run_id,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def end_run(self, run_id: int, segment: int, status: str) -> None:
        self.flush()
        now = utcnow()
        self.conn.execute("UPDATE soak_segments SET ended_at = ? WHERE run_id = ? AND segment = ?",
                          (now, run_id, segment))
        self.conn.execute("UPDATE runs SET status = ?, ended_at = ? WHERE id = ?", (status, now, run_id))
        if status == "done":  # every request has its row now: the journal has done its job
            token = self.conn.execute("SELECT token FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
            self.journal_path(token).unlink(missing_ok=True)

    def run_time_used(self, run_id: int) -> float:
        """Run time a closed-loop run has used: its latest send offset (0 for a new run)."""
        row = self.conn.execute("SELECT MAX(offset_s) FROM requests WHERE run_id = ?", (run_id,)).fetchone()
        return float(row[0]) if row and row[0] is not None else 0.0

    def progress(self, run_id: int) -> tuple[int, set[int]]:
        """(first seq without a row, seqs above it that have one): what a resume skips."""
        first = self.conn.execute(
            "SELECT COALESCE((SELECT MIN(r.seq + 1) FROM requests r WHERE r.run_id = :r AND NOT EXISTS "
            "(SELECT 1 FROM requests q WHERE q.run_id = :r AND q.seq = r.seq + 1)), 0)", {"r": run_id}
        ).fetchone()[0]
        if not self.conn.execute("SELECT 1 FROM requests WHERE run_id = ? AND seq = 0", (run_id,)).fetchone():
            first = 0
        above = {int(r[0]) for r in self.conn.execute(
            "SELECT seq FROM requests WHERE run_id = ? AND seq > ?", (run_id, first))}
        return int(first), above

    # -- the sent journal -------------------------------------------------------------------------
    def journal_path(self, token: str) -> Path:
        return self.path.with_name(f"{self.path.name}.soak-{token}.sent")

    def open_journal(self, token: str) -> None:
        self._journal_fd = os.open(self.journal_path(token), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def journal_sent(self, seq: int, request_id: str, sent_at: float) -> None:
        assert self._journal_fd is not None
        os.write(self._journal_fd, f"{seq} {request_id} {sent_at:.6f}\n".encode())

    def read_journal(self, token: str) -> Iterable[tuple[int, str, float]]:
        p = self.journal_path(token)
        if not p.exists():
            return
        with p.open() as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3:  # a torn last line is skipped
                    yield int(parts[0]), parts[1], float(parts[2])

    # -- rows (any thread) -------------------------------------------------------------------------
    def put_request(self, row: RequestRow) -> None:
        self._check()
        self._q.put(("requests", tuple(getattr(row, c) for c in REQUEST_COLS)))

    def put_samples(self, rows: list[MemoryRow]) -> None:
        self._check()
        for row in rows:
            self._q.put(("soak_samples", tuple(getattr(row, c) for c in SAMPLE_COLS)))

    def put_status(self, run_id: int, at: str, record: SoakStatusRecord) -> None:
        """A `soak_status` row: the typed subset of the guard's status (core.samples)."""
        self._check()
        self._q.put(("soak_status", (run_id, at, record.generation, record.model_dump_json())))

    def flush(self) -> None:
        """Block until every row queued so far is committed."""
        done = threading.Event()
        self._q.put(("flush", done))
        while not done.wait(0.5):
            self._check()
        self._check()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put((_STOP, None))
            self._thread.join(60)
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None
        self.conn.close()
        self._check()

    def _check(self) -> None:
        if self._err is not None:
            raise RuntimeError(f"soak ledger writer failed: {self._err}") from self._err

    def _writer(self) -> None:
        conn = ledger.connect(self.path)
        try:
            while True:
                batch = [self._q.get()]
                while len(batch) < self.max_batch:
                    try:
                        batch.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                stop = self._commit(conn, batch)
                if stop:
                    return
        except BaseException as e:  # surfaced to the main thread by _check()
            self._err = e
        finally:
            conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[tuple[Any, Any]]) -> bool:
        rows = [(k, v) for k, v in batch if k in _SQL]
        if rows:
            by_kind: dict[str, list[tuple[Any, ...]]] = {}
            for kind, values in rows:
                by_kind.setdefault(kind, []).append(values)
            conn.execute("BEGIN")
            for kind, values_list in by_kind.items():  # one C loop per table: the GIL stays free
                conn.executemany(_SQL[kind], values_list)
            conn.execute("COMMIT")
            self.commits += 1
            self.rows += len(rows)
        stop = False
        for kind, value in batch:
            if kind == "flush":
                value.set()
            elif kind is _STOP:
                stop = True
        return stop
