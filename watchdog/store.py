"""The watchdog's writer for its two ledger tables: `samples` (downsampled with age) and
`incidents`. Each insert is its own transaction (autocommit, WAL): once a call returns, the
row survives a kill -9 of the watchdog.

Sample rows are the typed records of `core.samples` (one row per source: nvml, procs, host,
metrics, status, verdicts; together a `Tick`), and `watchdog.samples_schema` in `meta` says
which schema they follow. Downsampling keeps the newest hour at full resolution, then one row
per source per minute up to a day, per 10 minutes up to 30 days, per hour beyond; it runs
every few minutes.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, Callable

import structlog
from pydantic import ValidationError

from vllm_guard.core import ledger as L
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.samples import SAMPLES_SCHEMA, HostReading, NvmlRecord, ProcReading, StatusBrief, Tick
from vllm_guard.core.timefmt import iso
from vllm_guard.core.vllm_api import EngineMetrics

log = structlog.get_logger("vllm_guard.watchdog")

# (older than, keep one per ISO prefix of this length): 16 = minute, 15 = 10 min, 13 = hour
TIERS = ((3600.0, 16), (86400.0, 15), (30 * 86400.0, 13))
COMPACT_EVERY_S = 300.0
SOURCES = ("nvml", "procs", "host", "metrics", "status", "verdicts")


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
               host: HostReading | None = None, metrics: EngineMetrics | None = None,
               status: StatusBrief | None = None, verdicts: dict[str, str] | None = None) -> Tick:
        """One row per present source, in one transaction; returns the tick as written."""
        tick = Tick(at=self._iso(), nvml=nvml, host=host, status=status, verdicts=verdicts,
                    procs={str(pid): p for pid, p in procs.items()} if procs is not None else None,
                    metrics=metrics.to_dict() if metrics is not None else None)
        data = tick.model_dump(mode="json")
        rows = [(tick.at, src, json.dumps(data[src], separators=(",", ":"))) for src in SOURCES
                if data[src] is not None]
        with self.conn:  # BEGIN ... COMMIT
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)", rows)
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
                f"GROUP BY source, substr(at, 1, {prefix}))", (cutoff, cutoff))
            deleted += cur.rowcount
        return deleted

    def last_host(self) -> tuple[str, str]:
        """(boot_id, at) of the newest host sample: the reboot detector's memory across restarts."""
        row = self.conn.execute("SELECT at, data FROM samples WHERE source = 'host' ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return "", ""
        try:
            return HostReading.model_validate_json(row["data"]).boot_id, str(row["at"])
        except ValidationError as e:
            log.warning("ledger_host_sample_unreadable", at=row["at"], error=str(e).splitlines()[0])
            return "", ""

    # -- incidents -------------------------------------------------------------------------------
    def incident(self, kind: str, cause: str, cls: EndClass, action: str, data: dict[str, Any]) -> int:
        cur = self.conn.execute(
            "INSERT INTO incidents (kind, cause, class, detected_at, action, data) VALUES (?, ?, ?, ?, ?, ?)",
            (kind, cause, cls.value, self._iso(), action, json.dumps(data, separators=(",", ":"), default=str)))
        return int(cur.lastrowid or 0)

    def set_action(self, row_id: int, action: str) -> None:
        self.conn.execute("UPDATE incidents SET action = ? WHERE id = ?", (action, row_id))

    def restored(self, row_id: int) -> None:
        self.conn.execute("UPDATE incidents SET restored_at = ? WHERE id = ? AND restored_at IS NULL",
                          (self._iso(), row_id))

    def counts(self) -> dict[str, int]:
        return {r["kind"]: r["n"] for r in self.conn.execute("SELECT kind, COUNT(*) AS n FROM incidents GROUP BY kind")}
