"""The open-loop arrival schedule: a pure, seeded function of the request index.

Offsets are in *run time* (seconds of active soak since the run began). They are generated in
fixed blocks, each from its own seeded generator, so the schedule is identical whether a run
goes straight through or resumes after `kill -9`: request i is always sent at the same run-time
offset with the same prompt. Inter-arrival gaps follow a gamma distribution with shape
`burstiness` and mean 1/rate, like `vllm bench serve --burstiness` (1.0 = Poisson). Burst mode
packs the same mean rate into the first `duty` share of every `period`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

BLOCK = 1024


@dataclass(frozen=True)
class Schedule:
    rate: float  # mean requests per second; inf = all at once (limited by the concurrency cap)
    burstiness: float = 1.0
    seed: int = 0
    mode: str = "steady"  # steady | burst
    burst_period_s: float = 60.0
    burst_duty: float = 0.25
    span_requests: int = 0  # > 0: scale so request span_requests - 1 is sent at span_requests / rate

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate has value {self.rate!r}: must be > 0 (inf for closed loop)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness has value {self.burstiness!r}: must be > 0")
        if self.mode not in ("steady", "burst"):
            raise ValueError(f"mode has value {self.mode!r}: steady or burst")
        if self.span_requests and (self.mode != "steady" or math.isinf(self.rate)):
            raise ValueError("a fixed span needs steady mode and a finite rate")
        if self.mode == "burst" and not (0 < self.burst_duty <= 1 and self.burst_period_s > 0):
            raise ValueError(f"burst duty {self.burst_duty!r} / period {self.burst_period_s!r} out of range")

    def _block_gaps(self, block: int) -> np.ndarray:
        if math.isinf(self.rate):
            return np.zeros(BLOCK)
        rng = np.random.default_rng([self.seed, block])
        shape = self.burstiness
        rate = self.rate / self.burst_duty if self.mode == "burst" else self.rate
        return rng.gamma(shape, 1.0 / (rate * shape), BLOCK)

    def _to_wall(self, t: np.ndarray) -> np.ndarray:
        """Burst mode: compressed time (all arrivals) -> run time inside the on-windows."""
        if self.mode == "steady":
            return t
        on = self.burst_period_s * self.burst_duty
        return np.floor(t / on) * self.burst_period_s + np.mod(t, on)

    def _scale(self) -> float:
        """vllm bench serve's normalisation: N requests span exactly N / rate seconds, so the
        throughput of a fixed-count run does not depend on the seed's draw."""
        if not self.span_requests:
            return 1.0
        raw = Schedule(self.rate, self.burstiness, self.seed)
        last = next(raw.offsets(self.span_requests - 1))[1]
        return (self.span_requests / self.rate) / last

    def offsets(self, start: int = 0) -> Iterator[tuple[int, float]]:
        """(index, run-time offset) from request `start` on, forever, in order."""
        if self.span_requests:
            k = self._scale()
            raw = Schedule(self.rate, self.burstiness, self.seed)
            for i, t in raw.offsets(start):
                yield i, t * k
            return
        block = start // BLOCK
        base = 0.0
        for b in range(block):  # same float operations as a straight run: identical offsets
            base = float((base + np.cumsum(self._block_gaps(b)))[-1])
        while True:
            cum = base + np.cumsum(self._block_gaps(block))
            base = float(cum[-1])
            wall = self._to_wall(cum) if self.mode == "burst" else cum
            for k in range(BLOCK):
                i = block * BLOCK + k
                if i >= start:
                    yield i, float(wall[k])
            block += 1

    def count_within(self, duration_s: float) -> int:
        """How many requests the run sends in `duration_s` of run time."""
        n = 0
        for n, t in self.offsets():
            if t >= duration_s:
                return n
        return n  # pragma: no cover (offsets is infinite)


def prompt_ids(seed: int, index: int, length: int, low: int = 100, high: int = 250) -> list[int]:
    """Deterministic token ids for request `index` (same on resume); ids valid in any vocab >= 256."""
    rng = np.random.default_rng([seed, 1 << 30, index])
    return rng.integers(low, high, length).tolist()
