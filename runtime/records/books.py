"""The runtime's books: what it records of generations, failures and recycles — in the ledger
(through its writer thread) and in the bounded records status shows — and the failure window
that decides when the runtime gives up.

One writer for each fact: a replica's driver reports through these methods (the `Books`
interface of `replica.ports`), nothing else writes these tables or records.
- A failure is restored when a generation *of the same replica* next serves (not when one
  starts: a generation stopped before it served restores nothing).
- A generation a killed runtime left open is an unplanned failure of its own (`runtime_lost`),
  restored like any other.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.timefmt import utcnow

from ..replica.generation import Generation
from ..replica.machine import Recycle
from .recent import FailureRecord, Recent, RecycleRecord
from .writer import RuntimeLedger

log = structlog.get_logger("vllm_guard.supervisor")


@dataclass
class _Open:
    """The recycle a replica is running: its ledger row and its record in status."""

    row: int
    record: RecycleRecord


@dataclass
class RuntimeBooks:
    ledger: RuntimeLedger
    failure_window: float
    vllm_version: str = ""
    failures: Recent[FailureRecord] = field(default_factory=Recent)
    recycles: Recent[RecycleRecord] = field(default_factory=Recent)
    _times: collections.deque[float] = field(default_factory=collections.deque)
    _unrestored: dict[int, list[FailureRecord]] = field(default_factory=dict)
    _open: dict[int, _Open] = field(default_factory=dict)
    _gpu_names: dict[int, str] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic  # the failure window's clock (the driver's, in tests)
    on_failure: Callable[[int, str], None] | None = None  # (replica, detail): the weight holder's drop rule

    # -- generations -------------------------------------------------------------------------
    def set_version(self, version: str) -> None:
        self.vllm_version = version

    def set_gpu_name(self, replica: int, name: str) -> None:
        self._gpu_names[replica] = name

    def generation_ready(self, gen: Generation) -> None:
        self.ledger.generation_ready(gen.row, self.vllm_version, self._gpu_names.get(gen.replica, ""))
        if not gen.adopted:  # an adopted generation's start is the previous runtime's record
            self.ledger.generation_phases(gen.row, gen.start_phases())
            if gen.weights is not None:
                self.ledger.generation_weights(gen.row, gen.weights.source.value, gen.weights.reason)
            if gen.kv_report is not None:
                self.ledger.generation_kv(gen.row, gen.kv_report.source, gen.kv_report.reason)

    def generation_ended(self, gen: Generation, leftover: tuple[int, ...]) -> None:
        reason, cls = gen.end_reason
        # again at the end: with its first request if it had one, or where a failed start got to
        if not gen.adopted:
            self.ledger.generation_phases(gen.row, gen.start_phases())
        self.ledger.generation_ended(gen.row, reason, cls.value, gen.target.completed)

    # -- failures ----------------------------------------------------------------------------
    def failure(self, gen: Generation, kind: str, exit_code: int | None, detail: str, cls: EndClass) -> None:
        rec = FailureRecord(kind=kind, at=utcnow(), exit_code=exit_code, detail=detail, generation=gen.number,
                            cls=cls, replica=gen.replica)
        rec.ledger_id = self.ledger.failure(gen.number, kind, exit_code, detail, cls.value)
        self.failures.add(rec)
        self._unrestored.setdefault(gen.replica, []).append(rec)
        log.error("generation_failed", generation=gen.number, replica=gen.replica, kind=kind, exit_code=exit_code,
                  detail=detail, cls=cls.value)
        if cls is EndClass.UNPLANNED:
            self._times.append(self.clock())
        if self.on_failure is not None:
            self.on_failure(gen.replica, detail)

    def lost(self, generation: int, replica: int, ledger_id: int, at: str) -> None:
        """A generation a killed runtime left running: an unplanned failure, restored when this
        runtime's generation of that replica serves."""
        rec = FailureRecord(kind=FailureKind.RUNTIME_LOST.value, at=at, exit_code=None,
                            detail="the runtime ended without stopping this generation (killed or crashed)",
                            generation=generation, cls=EndClass.UNPLANNED, replica=replica, ledger_id=ledger_id)
        self.failures.add(rec)
        self._unrestored.setdefault(replica, []).append(rec)

    def restored(self, replica: int) -> None:
        for f in self._unrestored.pop(replica, []):
            f.restored_at = utcnow()
            self.ledger.failure_restored(f.ledger_id)

    def in_window(self, now: float | None = None) -> int:
        """Unplanned failures within `failure_window`."""
        now = self.clock() if now is None else now
        while self._times and now - self._times[0] > self.failure_window:
            self._times.popleft()
        return len(self._times)

    # -- recycles ----------------------------------------------------------------------------
    def recycle_began(self, replica: int, rec: Recycle, in_flight: int, queued: int) -> None:
        record = RecycleRecord(reason=rec.reason, cls=rec.cls, started=utcnow(), in_flight=in_flight, queued=queued,
                               generation=rec.generation, started_mono=rec.started_at, replica=replica,
                               strategy=rec.strategy, strategy_reason=rec.why)
        row = self.ledger.recycle_started(rec.generation, rec.reason, rec.cls.value, in_flight, queued, replica,
                                          rec.strategy)
        record.ledger_id = row
        self.recycles.add(record)
        self._open[replica] = _Open(row, record)

    def recycle_note(self, replica: int, strategy: str, why: str, next_generation: int | None) -> None:
        op = self._open.get(replica)
        if op is None:
            return
        if next_generation is not None:
            op.record.next_generation = next_generation
        if why:
            op.record.strategy, op.record.strategy_reason = strategy, why[:500]
            self.ledger.recycle_update(op.row, strategy=strategy)

    def recycle_mark(self, replica: int, what: str) -> None:
        op = self._open.get(replica)
        if op is not None:
            self.ledger.recycle_update(op.row, **{f"{what}_at": utcnow()})

    def recycle_ready(self, replica: int, generation: int, duration_s: float, downtime_s: float,
                      queued: int) -> None:
        op = self._open.pop(replica, None)
        if op is None:
            return
        r = op.record
        r.duration_s, r.downtime_s, r.queued = duration_s, downtime_s, max(r.queued, queued)
        r.next_generation = generation
        self.ledger.recycle_update(op.row, ready_at=utcnow(), duration_s=duration_s, downtime_s=downtime_s,
                                   max_queued=r.queued, strategy=r.strategy)

    def recycle_of(self, replica: int) -> RecycleRecord | None:
        """The recycle `replica` is running (status)."""
        op = self._open.get(replica)
        return op.record if op is not None else None

    def recycle_over(self, replica: int) -> None:
        """The replica's recycle ended without a next generation ready (a failure, a hold)."""
        self._open.pop(replica, None)
