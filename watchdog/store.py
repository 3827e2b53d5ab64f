"""The watchdog's writer for its two ledger tables: `samples` (downsampled with age) and
`incidents`. Each insert is its own transaction (autocommit, WAL): once a call returns, the
row survives a kill -9 of the watchdog.

Sample rows are the typed records of `core.samples` (one row per box-wide source: nvml, procs,
host, status, verdicts; one per replica and per-replica source: metrics, replica, with the
replica's index in `replica`; together a `Tick`), and `watchdog.samples_schema` in `meta` says
which schema they follow. Incidents about one replica carry its index too. Downsampling
(`core.ledger.DOWNSAMPLE`, shared with the runtime's process memory) keeps the newest hour at
full resolution, then one row per source per minute up to a day, per 10 minutes up to 30 days,
per hour beyond; it runs every few minutes.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import structlog
from pydantic import ValidationError

from vllm_guard.core import ledger as L
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.samples import (
    REPLICA_SOURCES, SAMPLES_SCHEMA, HostReading, NvmlRecord, ProcReading, ReplicaBrief, ReplicaTick, StatusBrief, Tick,
)
from vllm_guard.core.timefmt import iso
from vllm_guard.core.vllm_api import EngineMetrics

log = structlog.get_logger("vllm_guard.watchdog")

# core.ledger.DOWNSAMPLE as (older than, keep one per ISO prefix of this length): 16 = minute,
# 15 = 10 min, 13 = hour
_PREFIX = {60: 16, 600: 15, 3600: 13}
TIERS = tuple((age, _PREFIX[bucket]) for age, bucket in L.DOWNSAMPLE)
COMPACT_EVERY_S = 300.0
SOURCES = ("nvml", "procs", "host", "status", "verdicts")  # box-wide; REPLICA_SOURCES per replica


class WatchdogLedger:
    def __init__(self, path: str | Path, now: Callable[[], dt.datetime] | None = None) -> None:
        self.conn = L.connect(path)
        self.now = now or (lambda: dt.datetime.now(dt.timezone.utc))
        self._last_compact = time.monotonic()
        self.set_meta({"samples_schema": SAMPLES_SCHEMA})

    def close(self) -> None:
        self.conn.close()

    def _iso(self) -> str:
        return iso(self.now())

    def set_meta(self, values: dict[str, Any]) -> None:
        """`watchdog.<key>` rows in `meta` (profile, budget, GPU names): what reports label ledgers by."""
        rows = [(f"watchdog.{k}", json.dumps(v, default=str)) for k, v in values.items()]
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", rows)

    # -- samples ---------------------------------------------------------------------------------
    def sample(self, *, nvml: NvmlRecord | None = None, procs: dict[int, ProcReading] | None = None,
               host: HostReading | None = None, status: StatusBrief | None = None,
               verdicts: dict[str, str] | None = None,
               replicas: Mapping[int, tuple[EngineMetrics | None, ReplicaBrief | None]] | None = None) -> Tick:
        """One row per present source, in one transaction; returns the tick as written.
        `replicas`: index -> (its /metrics counters, its brief)."""
        per = {str(i): ReplicaTick(metrics=m.to_dict() if m is not None else None, replica=b)
               for i, (m, b) in (replicas or {}).items()}
        tick = Tick(at=self._iso(), nvml=nvml, host=host, status=status, verdicts=verdicts, replicas=per,
                    procs={str(pid): p for pid, p in procs.items()} if procs is not None else None)
        data = tick.model_dump(mode="json")
        rows: list[tuple[str, str, str, int | None]] = [
            (tick.at, src, _json(data[src]), None) for src in SOURCES if data[src] is not None]
        for index, sources in data["replicas"].items():
            rows += [(tick.at, src, _json(sources[src]), int(index)) for src in REPLICA_SOURCES
                     if sources[src] is not None]
        with self.conn:  # BEGIN ... COMMIT
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT INTO samples (at, source, data, replica) VALUES (?, ?, ?, ?)", rows)
        if time.monotonic() - self._last_compact >= COMPACT_EVERY_S:
            self.compact()
        return tick

    def compact(self) -> int:
        """Apply the downsampling tiers; returns rows deleted."""
        self._last_compact = time.monotonic()
        now = self.now()
        deleted = 0
        for age, prefix in TIERS:
            cutoff = iso(now - dt.timedelta(seconds=age))
            cur = self.conn.execute(
                f"DELETE FROM samples WHERE at < ? AND id NOT IN (SELECT MIN(id) FROM samples WHERE at < ? "
                f"GROUP BY source, replica, substr(at, 1, {prefix}))", (cutoff, cutoff))
            deleted += cur.rowcount
        return deleted

    def last_host(self) -> tuple[str, str]:
        """(boot_id, at) of the newest host sample: the reboot detector's memory across restarts."""
        row = self.conn.execute("SELECT at, data FROM samples WHERE source = 'host' AND replica IS NULL "
                                "ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return "", ""
        try:
            return HostReading.model_validate_json(row["data"]).boot_id, str(row["at"])
        except ValidationError as e:
            log.warning("ledger_host_sample_unreadable", at=row["at"], error=str(e).splitlines()[0])
            return "", ""

    # -- incidents -------------------------------------------------------------------------------
    def incident(self, kind: str, cause: str, cls: EndClass, action: str, data: dict[str, Any],
                 replica: int | None = None) -> int:
        """`replica`: the replica it is about; None: the box or the runtime as a whole."""
        cur = self.conn.execute(
            "INSERT INTO incidents (kind, cause, class, detected_at, action, data, replica) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (kind, cause, cls.value, self._iso(), action, json.dumps(data, separators=(",", ":"), default=str),
             replica))
        return int(cur.lastrowid or 0)

    def set_action(self, row_id: int, action: str) -> None:
        self.conn.execute("UPDATE incidents SET action = ? WHERE id = ?", (action, row_id))

    def restored(self, row_id: int) -> None:
        self.conn.execute("UPDATE incidents SET restored_at = ? WHERE id = ? AND restored_at IS NULL",
                          (self._iso(), row_id))

    def counts(self) -> dict[str, int]:
        return {r["kind"]: r["n"] for r in self.conn.execute("SELECT kind, COUNT(*) AS n FROM incidents GROUP BY kind")}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
