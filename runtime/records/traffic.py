"""What the runtime measures, for the ledger: every request the proxy ended, and its processes'
memory. The report answers from these alone, without a soak or a watchdog.

Requests (`record`, a listener on `Proxy.listeners`, on the event loop, O(1), never blocks):
each engine request ends in the minute of its end, per replica: counts by outcome, tokens from
vLLM's usage record, and three mergeable latency histograms (`core.latency`: TTFT and E2E of
completed requests, ITL as each streamed request's mean gap between chunks) — kept for the
ledger's life (`edge_minutes`). A failed request met no latency bound (the report counts it as
infinitely slow); a rejected one (refused: a client error, a hold, shutdown) or one whose
client left has no latency of the service. One row per request (`edge_requests`) is kept for
`[ledger] request_retention`. Both go to the ledger's writer thread in batches, once a second
(rows also every ROWS_BATCH): a minute's row is written as soon as a request ended in it and
rewritten in place (its id is the runtime's) as it fills, until a few seconds after it closed
(stragglers). So the live ledger is never more than a second behind what status counts: a
report on a running service shows its requests (a minute written only once it had closed left
`vllm-guard report` saying "no requests recorded" for up to 65 s, and a killed runtime lost it).

Memory (`memory`, from the memory monitor every `memory_interval`): one row per process (RSS,
USS, swap, GPU, with the host's available and the GPUs' least free memory read with it: the
headroom of a forecast), downsampled with
age like the watchdog's samples (`core.ledger.DOWNSAMPLE`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from vllm_guard.core import ledger as L
from vllm_guard.core.latency import Histogram
from vllm_guard.core.timefmt import epoch

from ..frontdoor.done import Outcome, RequestDone

if TYPE_CHECKING:
    from vllm_guard.core.protocol import MemoryReading


class Sink(Protocol):
    """What the recorder needs of the ledger's writer thread (`writer.RuntimeLedger`)."""

    def put(self, sql: str, params: tuple[Any, ...], what: str) -> None: ...

    def put_rows(self, sql: str, rows: Callable[[], list[tuple[Any, ...]]], what: str) -> None: ...

    def new_id(self, table: str) -> int:
        """A row id for a row written, then rewritten in place."""

MINUTE_S = 60
GRACE_S = 5.0  # a minute is written this long after it ended (requests still ending in it)
ROWS_BATCH = 256
ROWS_EVERY_S = 1.0
MAINTAIN_EVERY_S = 300.0
REASON_MAX = 200

_REQUEST_SQL = ("INSERT INTO edge_requests (arrived, request_id, replica, generation, outcome, status, reason, "
                "stream, resumed, ttft_s, e2e_s, chunks, itl_mean_s, itl_max_s, prompt_tokens, completion_tokens) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_MINUTE_SQL = ("INSERT OR REPLACE INTO edge_minutes (id, minute, replica, requests, completed, failed, rejected, "
               "disconnected, prompt_tokens, completion_tokens, usage_known, ttft, e2e, itl) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_MEMORY_SQL = ("INSERT INTO process_memory (at, replica, generation, pid, role, requests, rss_mb, uss_mb, swap_mb, "
               "gpu_mb, host_available_mb, gpu_free_mb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def itl_mean(r: RequestDone) -> float | None:
    """A streamed request's mean gap between the chunks it was sent (a chunk is a chunk)."""
    if not r.stream or r.chunks < 2 or r.ttft_s is None:
        return None
    return max(0.0, r.e2e_s - r.ttft_s) / (r.chunks - 1)


@dataclass
class Minute:
    """One replica's requests that ended in one minute: one row, rewritten as it fills."""

    row_id: int = 0  # its edge_minutes row
    written: bool = True  # its row holds every request so far
    requests: int = 0
    outcomes: dict[Outcome, int] = field(default_factory=lambda: {o: 0 for o in Outcome})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_known: int = 0  # completed requests whose response carried vLLM's usage record
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)

    def add(self, r: RequestDone) -> None:
        self.written = False
        self.requests += 1
        self.outcomes[r.outcome] += 1
        if r.prompt_tokens is not None:
            self.prompt_tokens += r.prompt_tokens
        if r.completion_tokens is not None:
            self.completion_tokens += r.completion_tokens
        if r.outcome is not Outcome.COMPLETED:
            return
        if r.completion_tokens is not None:
            self.usage_known += 1
        if r.ttft_s is not None:
            self.ttft.add(r.ttft_s)
        self.e2e.add(r.e2e_s)
        gap = itl_mean(r)
        if gap is not None:
            self.itl.add(gap)

    def row(self, minute: int, replica: int) -> tuple[Any, ...]:
        """Its row as it stands (a copy: the writer thread reads it later)."""
        o = self.outcomes
        self.written = True
        return (self.row_id, minute, replica, self.requests, o[Outcome.COMPLETED], o[Outcome.FAILED],
                o[Outcome.REJECTED], o[Outcome.CLIENT_DISCONNECTED], self.prompt_tokens, self.completion_tokens,
                self.usage_known, self.ttft.to_json(), self.e2e.to_json(), self.itl.to_json())


def request_row(r: RequestDone) -> tuple[Any, ...]:
    return (r.arrived, r.request_id, r.replica, r.generation, r.outcome.value, r.status, r.reason[:REASON_MAX] or None,
            int(r.stream), r.resumed, r.ttft_s, r.e2e_s, r.chunks, itl_mean(r), r.max_gap_s, r.prompt_tokens,
            r.completion_tokens)


class TrafficRecorder:
    def __init__(self, ledger: Sink, retention_s: float, clock: Callable[[], float] = time.time) -> None:
        self.ledger = ledger
        self.retention_s = retention_s
        self.clock = clock
        self._lock = threading.Lock()  # the loop records; close() flushes from another thread
        self._minutes: dict[tuple[int, int], Minute] = {}
        self._rows: list[tuple[Any, ...]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._rows_timer: asyncio.TimerHandle | None = None
        self._maintained = time.monotonic()

    # -- requests (the proxy's listener) ------------------------------------------------------
    def record(self, r: RequestDone) -> None:
        if not r.counted:
            return  # not an engine request (health, models): no latency of the service
        minute = int((r.arrived + r.e2e_s) // MINUTE_S) * MINUTE_S
        with self._lock:
            key = (minute, r.replica or 0)
            m = self._minutes.get(key)
            if m is None:
                m = self._minutes[key] = Minute(self.ledger.new_id("edge_minutes"))
                self._later("_timer", minute + MINUTE_S + GRACE_S - self.clock(), self._tick)
            m.add(r)
            if self.retention_s > 0:
                self._rows.append(request_row(r))
                if len(self._rows) >= ROWS_BATCH:
                    self._flush_rows()
            self._later("_rows_timer", ROWS_EVERY_S, self._tick)  # the minute's row, the rows so far

    def _later(self, name: str, delay: float, fn: Callable[[], None]) -> None:
        """One pending call per timer (on the running loop; none outside one: flushed at close)."""
        if getattr(self, name) is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        setattr(self, name, loop.call_later(max(0.0, delay), self._fire, name, fn))

    def _fire(self, name: str, fn: Callable[[], None]) -> None:
        setattr(self, name, None)
        fn()

    def _tick(self) -> None:
        self.flush()

    def flush(self, everything: bool = False) -> None:
        """Queue the minutes that took requests since they were last written (open ones too, as
        they stand) and the rows so far; forget the minutes that closed (all with `everything`)."""
        now = self.clock()
        with self._lock:
            rows = [m.row(*k) for k, m in sorted(self._minutes.items()) if not m.written]
            for k in [k for k in self._minutes if everything or k[0] + MINUTE_S + GRACE_S <= now]:
                del self._minutes[k]
            if rows:
                self.ledger.put_rows(_MINUTE_SQL, lambda: rows, f"{len(rows)} minute(s) of requests")
            self._flush_rows()
            if self._minutes:
                first = min(k[0] for k in self._minutes)
                self._later("_timer", first + MINUTE_S + GRACE_S - now, self._tick)
        self._maintain(now)

    def _flush_rows(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            self.ledger.put_rows(_REQUEST_SQL, lambda: rows, f"{len(rows)} request rows")

    # -- memory (the memory monitor) ----------------------------------------------------------
    def memory(self, generation: int, replica: int, reading: MemoryReading, host_available_mb: float | None = None,
               gpu_free_mb: float | None = None) -> None:
        at = epoch(reading.at) or self.clock()
        rows = [(at, replica, generation, p.pid, p.role.value, reading.requests, p.rss_mb, p.uss_mb, p.swap_mb,
                 p.gpu_mb, host_available_mb, gpu_free_mb) for p in reading.per_process]
        if rows:
            self.ledger.put_rows(_MEMORY_SQL, lambda: rows, f"memory of generation {generation}")
        self._maintain(at)

    # -- retention and downsampling -----------------------------------------------------------
    def _maintain(self, now: float) -> None:
        if time.monotonic() - self._maintained < MAINTAIN_EVERY_S:
            return
        self._maintained = time.monotonic()
        self.maintain(now)

    def maintain(self, now: float) -> None:
        """Queue the deletes: request rows past retention, memory rows thinned with age."""
        self.ledger.put("DELETE FROM edge_requests WHERE arrived < ?", (now - self.retention_s,),
                        "request rows past retention")
        for age, bucket in L.DOWNSAMPLE:
            cut = now - age
            self.ledger.put("DELETE FROM process_memory WHERE at < ? AND id NOT IN (SELECT MIN(id) FROM "
                            "process_memory WHERE at < ? GROUP BY pid, generation, CAST(at / ? AS INTEGER))",
                            (cut, cut, bucket), "memory rows downsampled")
