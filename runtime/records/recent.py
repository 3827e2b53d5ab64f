"""What the runtime remembers of its failures and recycles: the last few, plus totals.

A runtime serves for months and the watchdog reads its status every second, so memory and the
status answer are bounded: the newest `RECENT` of each kind and a count. The ledger has the
whole history.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import RECENT, FailureSummary, RecycleSummary


@dataclass
class FailureRecord:
    kind: str  # a core.ledger.FailureKind value
    at: str
    exit_code: int | None
    detail: str
    generation: int
    cls: EndClass = EndClass.UNPLANNED
    restored_at: str | None = None
    ledger_id: int = 0
    replica: int = 0

    def summary(self) -> FailureSummary:
        return FailureSummary(kind=self.kind, at=self.at, exit_code=self.exit_code, detail=self.detail,
                              restored_at=self.restored_at, generation=self.generation)


@dataclass
class RecycleRecord:
    reason: str
    cls: EndClass
    started: str
    in_flight: int
    queued: int  # requests waiting at the start; raised to the most waiting at once until ready
    generation: int  # the generation recycled
    started_mono: float
    duration_s: float | None = None  # start -> the next generation ready
    downtime_s: float | None = None  # the replica accepted nothing: stop of dispatch -> next ready
    ledger_id: int = 0
    replica: int = 0
    strategy: str | None = None  # overlap | gated | cold: the one that ran (after any fallback)
    strategy_reason: str | None = None
    next_generation: int | None = None
    closed_mono: float | None = None  # when the replica stopped taking new requests (cold, gated)

    def summary(self) -> RecycleSummary:
        return RecycleSummary(reason=self.reason, cls=self.cls, started=self.started, generation=self.generation,
                              in_flight=self.in_flight, queued=self.queued, duration_s=self.duration_s,
                              downtime_s=self.downtime_s, strategy=self.strategy,
                              strategy_reason=self.strategy_reason, replica=self.replica,
                              next_generation=self.next_generation)


T = TypeVar("T")


class Recent(Generic[T]):
    """The newest `size` items and how many there were in all."""

    def __init__(self, size: int = RECENT) -> None:
        self.items: collections.deque[T] = collections.deque(maxlen=size)
        self.total = 0

    def add(self, item: T) -> T:
        self.items.append(item)
        self.total += 1
        return item

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
