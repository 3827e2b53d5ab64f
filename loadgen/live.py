"""The soak's live aggregates: what the progress line and the summary show, in constant memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_guard.core import stream as client
from vllm_guard.core.latency import Histogram


@dataclass
class Live:
    """Streaming aggregates for the progress line and the summary: constant memory. Latencies
    go into `core.latency` histograms: the soak's p50/p99 follow the rule of the runtime's and the
    report's."""

    done: int = 0
    sent: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    e2e_sched: Histogram = field(default_factory=Histogram)
    lag: Histogram = field(default_factory=Histogram)  # sent - scheduled
    output_tokens: int = 0

    def add(self, res: client.Result, lag_s: float, e2e_sched_s: float) -> None:
        self.done += 1
        self.lag.add(max(0.0, lag_s))
        if res.error:
            self.errors[res.error] = self.errors.get(res.error, 0) + 1
            return
        if res.ttft_s is not None:
            self.ttft.add(res.ttft_s)
        self.e2e_sched.add(e2e_sched_s)
        self.output_tokens += res.output_tokens or 0

    @property
    def failed(self) -> int:
        return sum(self.errors.values())
