"""The watchdog's writer for its two ledger tables: `samples` (downsampled with age) and
`incidents`. Each insert is its own transaction (autocommit, WAL): once a call returns, the
row survives a kill -9 of the watchdog.

Downsampling keeps the newest hour at full resolution, then one row per source per minute up
to a day, per 10 minutes up to 30 days, per hour beyond; it runs every few minutes.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, Callable

from vllm_guard.runtime import ledger as L

# (older than, keep one per ISO prefix of this length): 16 = minute, 15 = 10 min, 13 = hour
TIERS = ((3600.0, 16), (86400.0, 15), (30 * 86400.0, 13))
COMPACT_EVERY_S = 300.0


class WatchdogLedger:
    def __init__(self, path: str | Path, now: Callable[[], dt.datetime] | None = None) -> None:
        self.conn = L.connect(path)
        self.now = now or (lambda: dt.datetime.now(dt.timezone.utc))
        self._last_compact = time.monotonic()

    def close(self) -> None:
        self.conn.close()

    def _iso(self) -> str:
        return L.iso(self.now())

    def set_meta(self, values: dict[str, Any]) -> None:
        """`watchdog.<key>` rows in `meta` (profile, budget, GPU names): what reports label ledgers by."""
        rows = [(f"watchdog.{k}", json.dumps(v, default=str)) for k, v in values.items()]
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", rows)

    # -- samples ---------------------------------------------------------------------------------
    def sample(self, parts: dict[str, Any]) -> None:
        """One row per source (nvml, procs, host, metrics, status) in one transaction."""
        at = self._iso()
        rows = [(at, src, json.dumps(v, separators=(",", ":"), default=str)) for src, v in parts.items()
                if v is not None]
        with self.conn:  # BEGIN ... COMMIT
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)", rows)
        if time.monotonic() - self._last_compact >= COMPACT_EVERY_S:
            self.compact()

    def compact(self) -> int:
        """Apply the downsampling tiers; returns rows deleted."""
        self._last_compact = time.monotonic()
        now = self.now()
        deleted = 0
        for age, prefix in TIERS:
            cutoff = L.iso(now - dt.timedelta(seconds=age))
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
        return str(json.loads(row["data"]).get("boot_id", "")), str(row["at"])

    # -- incidents -------------------------------------------------------------------------------
    def incident(self, kind: str, cause: str, cls: str, action: str, data: dict[str, Any]) -> int:
        cur = self.conn.execute(
            "INSERT INTO incidents (kind, cause, class, detected_at, action, data) VALUES (?, ?, ?, ?, ?, ?)",
            (kind, cause, cls, self._iso(), action, json.dumps(data, separators=(",", ":"), default=str)))
        return int(cur.lastrowid or 0)

    def set_action(self, row_id: int, action: str) -> None:
        self.conn.execute("UPDATE incidents SET action = ? WHERE id = ?", (action, row_id))

    def restored(self, row_id: int) -> None:
        self.conn.execute("UPDATE incidents SET restored_at = ? WHERE id = ? AND restored_at IS NULL",
                          (self._iso(), row_id))

    def counts(self) -> dict[str, int]:
        return {r["kind"]: r["n"] for r in self.conn.execute("SELECT kind, COUNT(*) AS n FROM incidents GROUP BY kind")}

    def mtbf_hours(self) -> float | None:
        """Up time / unplanned failures from the runtime's tables (None before the first failure)."""
        rows = self.conn.execute("SELECT ready_at, ended_at FROM generations WHERE ready_at IS NOT NULL").fetchall()
        up = 0.0
        for r in rows:
            end = L.parse_iso(r["ended_at"]) if r["ended_at"] else self.now()
            up += max(0.0, (end - L.parse_iso(r["ready_at"])).total_seconds())
        n = self.conn.execute("SELECT COUNT(*) FROM failures WHERE class = 'unplanned'").fetchone()[0]
        return round(up / 3600 / n, 3) if n else None
