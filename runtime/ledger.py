"""The runtime's ledger writer: generations, recycles and failures, written off the event loop.

SQLite can block for its busy timeout (another process holds the write lock) or fail (disk
full, a corrupt page). Serving must never wait for the ledger nor stop because of it, so every
write is queued to one writer thread that retries a failed write with backoff and keeps order;
the supervisor never blocks on it and never sees its errors. `health()` tells status how many
writes are pending and failed and the last error. Row ids are allocated here (the runtime is
the only writer of its tables, and one runtime owns a state dir), so later updates need no
answer from the database.

Generation numbers continue across runtime processes (`core.ledger.next_generation`), and a
serving generation's `requests_served` and `updated_at` are written as it goes, so a runtime
that is killed leaves a generation that ended when it was last seen, with what it had served.
"""

from __future__ import annotations

import collections
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from vllm_guard.core import ledger as L
from vllm_guard.core.host import boot_id
from vllm_guard.core.protocol import LedgerHealth
from vllm_guard.core.timefmt import utcnow

log = structlog.get_logger("vllm_guard.ledger")

MAX_PENDING = 10_000  # beyond this the oldest queued write is dropped (and counted as failed)
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
RUNTIME_TABLES = ("generations", "recycles", "failures")


@dataclass(frozen=True)
class _Write:
    sql: str
    params: tuple[Any, ...]
    what: str


@dataclass(frozen=True)
class OpenGeneration:
    """A generation a previous runtime left open (it was killed or crashed)."""

    id: int
    generation: int
    pid: int | None
    pid_started: float | None


class RuntimeLedger:
    """One writer thread; every public method only queues and returns at once."""

    def __init__(self, path: str | Path, busy_timeout_s: float = L.BUSY_TIMEOUT_S) -> None:
        self.conn = L.connect(path, busy_timeout_s)  # LedgerError at start: one line, nothing started
        self.host = socket.gethostname()
        self.boot_id = boot_id()
        try:
            self._ids = {t: self._max_id(t) for t in RUNTIME_TABLES}
            self.first_generation = L.next_generation(self.conn)
        except sqlite3.Error as e:  # a corrupt page, a lock held past the busy timeout
            self.conn.close()
            raise L.LedgerError(f"{L.db_path(path)} cannot be read: {type(e).__name__}: {e}") from e
        self._queue: collections.deque[_Write] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self.failed_writes = 0
        self.last_error: str | None = None
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def _max_id(self, table: str) -> int:
        return int(self.conn.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0])

    def _next_id(self, table: str) -> int:
        self._ids[table] += 1
        return self._ids[table]

    # -- the writer thread -------------------------------------------------------------------
    def _put(self, sql: str, params: tuple[Any, ...], what: str) -> None:
        with self._cond:
            if len(self._queue) >= MAX_PENDING:
                lost = self._queue.popleft()
                self.failed_writes += 1
                log.error("ledger_write_dropped", what=lost.what, pending=len(self._queue))
            self._queue.append(_Write(sql, params, what))
            self._cond.notify()

    def _run(self) -> None:
        delay = RETRY_MIN_S
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and everything written (or given up)
                    return
                w = self._queue[0]
                self._busy = True
            try:
                self.conn.execute(w.sql, w.params)
                ok = True
            except sqlite3.Error as e:
                self._failed(w, e)
                ok = False
            with self._cond:
                self._busy = False
                if ok:
                    if self._queue and self._queue[0] is w:  # (it may have been dropped meanwhile)
                        self._queue.popleft()
                    if self._failing_since is not None:
                        log.info("ledger_recovered", after_s=round(time.monotonic() - self._failing_since, 1))
                        self._failing_since = None
                    delay = RETRY_MIN_S
                else:
                    self._cond.wait(delay)  # the same write again after the delay (order is kept)
                    delay = min(RETRY_MAX_S, delay * 2)
                self._cond.notify_all()

    def _failed(self, w: _Write, e: sqlite3.Error) -> None:
        msg = f"{type(e).__name__}: {e}"
        if self._failing_since is None or msg != self.last_error:
            log.error("ledger_write_failed", what=w.what, error=msg, pending=len(self._queue))
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self.last_error = msg

    def health(self) -> LedgerHealth:
        with self._cond:
            pending = len(self._queue)
        return LedgerHealth(ok=self._failing_since is None, pending_writes=pending,
                            failed_writes=self.failed_writes, last_error=self.last_error)

    def close(self, timeout: float = 10.0) -> bool:
        """Write what is queued (up to `timeout`), then close; False if writes were lost."""
        end = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < end:
                self._cond.wait(min(0.1, max(0.0, end - time.monotonic())))
            lost = len(self._queue)
            if lost:
                self.failed_writes += lost
                self._queue.clear()
                self._cond.notify_all()
        self._thread.join(max(0.0, end - time.monotonic()) + 1.0)
        if lost:
            log.error("ledger_writes_lost", writes=lost, error=self.last_error)
        if not self._thread.is_alive():
            self.conn.close()
        return lost == 0

    # -- start-up (synchronous: nothing serves yet) -------------------------------------------
    def open_generations(self) -> list[OpenGeneration]:
        rows = self.conn.execute(
            "SELECT id, generation, pid, pid_started FROM generations WHERE ended_at IS NULL").fetchall()
        return [OpenGeneration(int(r[0]), int(r[1]), r[2], r[3]) for r in rows]

    def close_open_generations(self, reason: str) -> int:
        """A generation a previous runtime left open ended when it was last seen (its last
        incremental update), with the requests it had served by then; never at ready_at with 0."""
        cur = self.conn.execute(
            "UPDATE generations SET ended_at = COALESCE(updated_at, ready_at, started_at), end_reason = ?, "
            "end_class = ? WHERE ended_at IS NULL",
            (reason, L.UNPLANNED),
        )
        return int(cur.rowcount)

    # -- the runtime's records ---------------------------------------------------------------
    def generation_started(self, generation: int, pid: int, pid_started: float | None, model: str,
                           replica: int = 0, strategy: str | None = None) -> int:
        row = self._next_id("generations")
        now = utcnow()
        self._put("INSERT INTO generations (id, generation, started_at, updated_at, pid, pid_started, model, "
                  "host, boot_id, replica, strategy) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (row, generation, now, now, pid, pid_started, model, self.host, self.boot_id, replica, strategy),
                  f"generation {generation} started")
        return row

    def generation_ready(self, row: int, vllm_version: str, gpu_name: str) -> None:
        now = utcnow()
        self._put("UPDATE generations SET ready_at = ?, updated_at = ?, vllm_version = ?, gpu_name = ? "
                  "WHERE id = ?", (now, now, vllm_version, gpu_name, row), "generation ready")

    def generation_progress(self, row: int, requests_served: int) -> None:
        """The generation is alive and has served this many requests (written as it goes)."""
        self._put("UPDATE generations SET requests_served = ?, updated_at = ? WHERE id = ? AND ended_at IS NULL",
                  (requests_served, utcnow(), row), "generation progress")

    def generation_ended(self, row: int, reason: str, cls: str, requests_served: int) -> None:
        now = utcnow()
        self._put("UPDATE generations SET ended_at = ?, updated_at = ?, end_reason = ?, end_class = ?, "
                  "requests_served = ? WHERE id = ?", (now, now, reason, cls, requests_served, row),
                  "generation ended")

    def recycle_started(self, generation: int, trigger: str, cls: str, in_flight: int, queued: int,
                        replica: int = 0, strategy: str | None = None) -> int:
        row = self._next_id("recycles")
        self._put("INSERT INTO recycles (id, generation, trigger, class, started_at, in_flight, queued, replica, "
                  "strategy) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (row, generation, trigger, cls, utcnow(), in_flight, queued, replica, strategy), "recycle started")
        return row

    def recycle_update(self, row: int, **values: Any) -> None:
        allowed = {"drained_at", "stopped_at", "ready_at", "duration_s", "downtime_s", "max_queued", "strategy"}
        bad = set(values) - allowed
        if bad:
            raise ValueError(f"recycles has no updatable column {sorted(bad)}")
        sets = ", ".join(f"{k} = ?" for k in values)
        self._put(f"UPDATE recycles SET {sets} WHERE id = ?", (*values.values(), row), "recycle update")

    def failure(self, generation: int, kind: str, exit_code: int | None, detail: str, cls: str) -> int:
        row = self._next_id("failures")
        self._put("INSERT INTO failures (id, generation, kind, class, at, exit_code, detail) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)", (row, generation, kind, cls, utcnow(), exit_code, detail),
                  f"failure {kind}")
        return row

    def failure_restored(self, row: int) -> None:
        self._put("UPDATE failures SET restored_at = ? WHERE id = ?", (utcnow(), row), "failure restored")
