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
import json
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import structlog

from vllm_guard.core import ledger as L
from vllm_guard.core.host import boot_id
from vllm_guard.core.protocol import LedgerHealth
from vllm_guard.core.timefmt import utcnow

if TYPE_CHECKING:
    from vllm_guard.core.config import GuardConfig
    from vllm_guard.core.protocol import MemoryReading

    from ..frontdoor.done import Listener
    from .traffic import TrafficRecorder

log = structlog.get_logger("vllm_guard.ledger")

MAX_PENDING = 10_000  # beyond this the oldest queued write is dropped (and counted as failed)
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
PERMANENT_TRIES = 3  # a write that fails this often with a non-transient error (a corrupt page) is dropped
# The tables whose row ids the runtime gives out itself (an update needs no answer from the database).
RUNTIME_TABLES = ("generations", "recycles", "failures", "edge_minutes")
# Errors that go away by themselves: another process holds the lock, the disk is full, I/O failed.
_TRANSIENT = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_READONLY",
              "SQLITE_PROTOCOL", "SQLITE_NOMEM")


def transient(e: sqlite3.Error) -> bool:
    """Worth retrying for as long as it takes (vs. a corrupt page or a bad statement)."""
    name = getattr(e, "sqlite_errorname", "") or ""
    if name:
        return name.startswith(_TRANSIENT)
    text = str(e).lower()
    return any(w in text for w in ("locked", "busy", "full", "disk i/o", "unable to open", "readonly"))


def _busy(e: BaseException | None) -> bool:
    return isinstance(e, sqlite3.Error) and transient(e)


@dataclass(frozen=True)
class _Write:
    sql: str
    params: tuple[Any, ...]
    what: str
    rows: Callable[[], list[tuple[Any, ...]]] | None = None  # many rows in one transaction, built in the writer


@dataclass(frozen=True)
class OpenGeneration:
    """A generation a previous runtime left open (it was killed or crashed)."""

    id: int
    generation: int
    pid: int | None
    pid_started: float | None
    replica: int = 0
    last_seen: str = ""  # its last incremental update (when it was last known alive)


@dataclass(frozen=True)
class LostGeneration:
    """An open generation closed at start-up, and its `runtime_lost` failure row."""

    generation: int
    replica: int
    failure_id: int
    at: str


class RuntimeLedger:
    """One writer thread; every public method only queues and returns at once.

    A ledger that another process holds locked at start does not stop the runtime: what start-up
    needs is read (readers are never blocked in WAL mode) and the writer connects when it can.
    """

    def __init__(self, path: str | Path, busy_timeout_s: float = L.BUSY_TIMEOUT_S) -> None:
        self.path = L.db_path(path)
        self.busy_timeout_s = busy_timeout_s
        self.conn: sqlite3.Connection | None = None
        try:
            self.conn = L.connect(path, busy_timeout_s)  # LedgerError at start: one line, nothing started
        except L.LedgerError as e:
            if not _busy(e.__cause__):
                raise
            log.error("ledger_locked_at_start", error=str(e.__cause__), path=str(self.path))
        self.host = socket.gethostname()
        self.boot_id = boot_id()
        reader = self.conn if self.conn is not None else self._reader()
        try:
            self._ids = {t: self._max_id(reader, t) for t in RUNTIME_TABLES}
            self.first_generation = L.next_generation(reader)
            self._open = self._open_generations(reader)
            self._adopted: set[int] = set()
        except sqlite3.Error as e:  # a corrupt page, a missing table
            self._close_conn()
            raise L.LedgerError(f"{self.path} cannot be read: {type(e).__name__}: {e}") from e
        finally:
            if reader is not self.conn:
                reader.close()
        self._queue: collections.deque[_Write] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self.failed_writes = 0
        self.last_error: str | None = None
        self._failing_since: float | None = None
        self.traffic: TrafficRecorder | None = None  # attach(): what the proxy and the memory monitor measure
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def _reader(self) -> sqlite3.Connection:
        try:
            return sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            raise L.LedgerError(f"{self.path} cannot be read: {e}") from e

    def _close_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()

    @staticmethod
    def _max_id(conn: sqlite3.Connection, table: str) -> int:
        try:
            return int(conn.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0])
        except sqlite3.OperationalError:
            if table != "edge_minutes":  # an older ledger read while locked at start may lack it
                raise
            return 0

    def _next_id(self, table: str) -> int:
        self._ids[table] += 1
        return self._ids[table]

    def new_id(self, table: str) -> int:
        """A row id of one of RUNTIME_TABLES for a row written, then rewritten in place (the
        traffic recorder's open minutes); on the event loop, like every write."""
        return self._next_id(table)

    # -- the writer thread -------------------------------------------------------------------
    def _put(self, sql: str, params: tuple[Any, ...], what: str,
             rows: Callable[[], list[tuple[Any, ...]]] | None = None) -> None:
        with self._cond:
            if len(self._queue) >= MAX_PENDING:
                lost = self._queue.popleft()
                self.failed_writes += 1
                log.error("ledger_write_dropped", what=lost.what, pending=len(self._queue))
            self._queue.append(_Write(sql, params, what, rows))
            self._cond.notify()

    def put_rows(self, sql: str, rows: Callable[[], list[tuple[Any, ...]]], what: str) -> None:
        """Many rows in one transaction (one queued write); `rows` runs in the writer thread."""
        self._put(sql, (), what, rows)

    def put(self, sql: str, params: tuple[Any, ...], what: str) -> None:
        """One statement of a table the runtime owns (the traffic recorder's)."""
        self._put(sql, params, what)

    def _write(self, w: _Write) -> None:
        if self.conn is None:  # locked at start: connect now (it creates nothing an open file lacks)
            try:
                self.conn = L.connect(self.path, self.busy_timeout_s)
            except L.LedgerError as e:
                if isinstance(e.__cause__, sqlite3.Error):
                    raise e.__cause__ from None
                raise sqlite3.OperationalError(str(e)) from None
        if w.rows is None:
            self.conn.execute(w.sql, w.params)
            return
        rows = w.rows()
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany(w.sql, rows)
            self.conn.execute("COMMIT")
        except BaseException:
            # SQLITE_FULL (and SQLITE_NOMEM, some I/O errors) roll the transaction back
            # themselves: a ROLLBACK then fails with "no transaction is active", a non-transient
            # error that would hide the real one and get the write dropped
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise

    def _run(self) -> None:
        """Write in order; a failed write is retried with backoff (the same one: order is kept)
        until it succeeds, or, for an error that will not go away, PERMANENT_TRIES times. Never
        dies: a failure of its own logging is not a reason to stop writing."""
        delay = RETRY_MIN_S
        tries = 0
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and everything written (or given up)
                    return
                w = self._queue[0]
                self._busy = True
            error: sqlite3.Error | None = None
            try:
                self._write(w)
            except sqlite3.Error as e:
                error = e
            except Exception as e:  # noqa: BLE001 - not SQLite's (a bug): keep the thread, count the write
                error = sqlite3.DatabaseError(f"{type(e).__name__}: {e}")
            drop = False
            if error is not None:
                tries += 1
                drop = not transient(error) and tries >= PERMANENT_TRIES
                self._failed(w, error, drop)
            with self._cond:
                self._busy = False
                if error is None or drop:
                    if self._queue and self._queue[0] is w:  # (it may have been dropped meanwhile)
                        self._queue.popleft()
                    if drop:
                        self.failed_writes += 1
                    elif self._failing_since is not None:
                        self._recovered()
                    delay, tries = RETRY_MIN_S, 0
                else:
                    self._cond.wait(delay)  # the same write again after the delay (order is kept)
                    delay = min(RETRY_MAX_S, delay * 2)
                self._cond.notify_all()

    def _failed(self, w: _Write, e: sqlite3.Error, dropped: bool) -> None:
        msg = f"{type(e).__name__}: {e}"
        first = self._failing_since is None or msg != self.last_error
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self.last_error = msg
        try:
            if dropped:
                log.error("ledger_write_dropped", what=w.what, error=msg, reason="not a transient error")
            elif first:
                log.error("ledger_write_failed", what=w.what, error=msg, pending=len(self._queue))
        except Exception:  # noqa: BLE001 - the log itself failed (a full disk under stderr): keep writing
            pass

    def _recovered(self) -> None:
        assert self._failing_since is not None
        after = round(time.monotonic() - self._failing_since, 1)
        self._failing_since = None
        try:
            log.info("ledger_recovered", after_s=after, pending=len(self._queue))
        except Exception:  # noqa: BLE001 - see _failed
            pass

    def health(self) -> LedgerHealth:
        with self._cond:
            pending = len(self._queue)
        return LedgerHealth(ok=self._failing_since is None, pending_writes=pending,
                            failed_writes=self.failed_writes, last_error=self.last_error)

    def close(self, timeout: float = 10.0) -> bool:
        """Write what is queued (up to `timeout`), then close; False if writes were lost."""
        if self.traffic is not None:
            self.traffic.flush(everything=True)
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
            self._close_conn()
        return lost == 0

    # -- start-up ------------------------------------------------------------------------------
    @staticmethod
    def _open_generations(conn: sqlite3.Connection) -> list[OpenGeneration]:
        rows = conn.execute(
            "SELECT id, generation, pid, pid_started, replica, COALESCE(updated_at, ready_at, started_at) "
            "FROM generations WHERE ended_at IS NULL").fetchall()
        return [OpenGeneration(int(r[0]), int(r[1]), r[2], r[3], int(r[4] or 0), str(r[5])) for r in rows]

    def open_generations(self) -> list[OpenGeneration]:
        """Generations a previous runtime left open (read when this ledger was opened), but for
        those it handed over to this one (`adopting`)."""
        return list(self._open)

    def adopting(self, rows: set[int]) -> None:
        """These open rows are generations a previous runtime handed over: this runtime goes on
        with them, they are neither orphans nor lost."""
        self._open = [g for g in self._open if g.id not in rows]
        self._adopted = set(rows)

    def close_open_generations(self, reason: str) -> list[LostGeneration]:
        """A generation a previous runtime left open ended when it was last seen (its last
        incremental update), with the requests it had served by then; never at ready_at with 0.
        Each is an unplanned failure of its own (`reason`, at that time), restored when a
        generation of its replica serves again. Queued like every write (before this runtime's
        first generation)."""
        keep = sorted(self._adopted)
        self._put("UPDATE generations SET ended_at = COALESCE(updated_at, ready_at, started_at), end_reason = ?, "
                  f"end_class = ? WHERE ended_at IS NULL AND id NOT IN ({','.join('?' * len(keep))})",
                  (reason, L.UNPLANNED, *keep), "close open generations")
        lost = []
        for g in self._open:
            row = self._next_id("failures")
            self._put("INSERT INTO failures (id, generation, kind, class, at, exit_code, detail) "
                      "VALUES (?, ?, ?, ?, ?, NULL, ?)",
                      (row, g.generation, reason, L.UNPLANNED, g.last_seen,
                       "the runtime ended without stopping this generation (killed or crashed)"), f"failure {reason}")
            lost.append(LostGeneration(g.generation, g.replica, row, g.last_seen))
        return lost

    # -- the runtime's records ---------------------------------------------------------------
    def generation_started(self, generation: int, pid: int, pid_started: float | None, model: str,
                           replica: int = 0, strategy: str | None = None, config_hash: str | None = None,
                           config_changed: Sequence[str] = ()) -> int:
        row = self._next_id("generations")
        now = utcnow()
        changed = json.dumps(list(config_changed)) if config_changed else None
        self._put("INSERT INTO generations (id, generation, started_at, updated_at, pid, pid_started, model, "
                  "host, boot_id, replica, strategy, config_hash, config_changed) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (row, generation, now, now, pid, pid_started, model, self.host, self.boot_id, replica, strategy,
                   config_hash, changed), f"generation {generation} started")
        return row

    def reload_noted(self, summary: Mapping[str, Any]) -> None:
        """The last reload (applied, unchanged or refused, and why) in `meta` as `runtime.last_reload`."""
        self._put("INSERT OR REPLACE INTO meta (key, value) VALUES ('runtime.last_reload', ?)",
                  (json.dumps(dict(summary), sort_keys=True),), "runtime reload")

    def generation_ready(self, row: int, vllm_version: str, gpu_name: str) -> None:
        now = utcnow()
        # COALESCE: a generation adopted from a previous runtime keeps the time it first became ready
        self._put("UPDATE generations SET ready_at = COALESCE(ready_at, ?), updated_at = ?, vllm_version = ?, "
                  "gpu_name = ? WHERE id = ?", (now, now, vllm_version, gpu_name, row), "generation ready")

    def generation_weights(self, row: int, source: str, note: str) -> None:
        """Where the generation's weights came from (held / disk) and, from disk, why."""
        self._put("UPDATE generations SET weights_source = ?, weights_note = ?, updated_at = ? WHERE id = ?",
                  (source, note, utcnow(), row), "generation weights")

    def generation_kv(self, row: int, source: str, note: str) -> None:
        """Where the generation's KV cache came from (held / own) and, its own, why."""
        self._put("UPDATE generations SET kv_source = ?, kv_note = ?, updated_at = ? WHERE id = ?",
                  (source, note, utcnow(), row), "generation kv")

    def generation_phases(self, row: int, phases: list[tuple[str, float]]) -> None:
        """Where the generation's start went (phase, seconds after spawn)."""
        self._put("UPDATE generations SET start_phases = ?, updated_at = ? WHERE id = ?",
                  (json.dumps([[p, s] for p, s in phases]), utcnow(), row), "generation start phases")

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

    # -- what the runtime measures (runtime/records/traffic.py) -------------------------------
    def attach(self, listeners: list[Listener], cfg: GuardConfig) -> None:
        """Record every request the proxy ends (`listeners`: `Proxy.listeners`) and the memory
        readings; note the warm-up and retention in `meta` for the report."""
        from .traffic import TrafficRecorder

        self.traffic = TrafficRecorder(self, float(cfg.ledger.request_retention))
        listeners.append(self.traffic.record)
        for key, value in (("memory_warmup_requests", cfg.recycle.memory_warmup_requests),
                           ("request_retention_s", float(cfg.ledger.request_retention))):
            self._put("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (f"runtime.{key}", str(value)),
                      "runtime meta")

    def process_memory(self, generation: int, replica: int, reading: MemoryReading,
                       host_available_mb: float | None = None, gpu_free_mb: float | None = None) -> None:
        """One memory reading of a generation's processes (per process: RSS, USS, swap, GPU), with
        the host's available and the GPUs' free memory read with it (the forecasts' headroom)."""
        if self.traffic is None:
            from .traffic import TrafficRecorder

            self.traffic = TrafficRecorder(self, 0.0)
        self.traffic.memory(generation, replica, reading, host_available_mb, gpu_free_mb)
