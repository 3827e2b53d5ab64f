"""Request latency histograms per replica, fed by the proxy's `RequestDone` records.

The status snapshot carries only recent quantiles of one process (`ttft_seconds{quantile}`), which
cannot be added up across boxes; histograms can: a fleet's p99, or the share of requests within
an SLA bound per hour, is a `sum by (le)` away. Only counted requests that a replica answered in
full are observed (failed ones are counted by outcome, `request_outcomes_total`), so the SLA share
is within-bound completions over completed + failed. The buckets include the field report's
tier bounds (500 ms, 5 s) exactly, so the share is exact at them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from ..frontdoor.done import Outcome, RequestDone

P = "vllm_guard_runtime_"
SLA_BOUNDS_S = (0.5, 5.0)  # Interactive and Batch P99 bounds (docs/REPORTS.md "SLA tiers")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
# a recycle's queue can hold a request for minutes: the top buckets keep such waits apart from +Inf
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0, 3600.0)


class RequestHistograms:
    """TTFT and E2E at the proxy (arrival to first body byte, to the end), per replica."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(P + "request_ttft_seconds", "time to the first body byte at the proxy, completed "
                              "counted requests, per replica", ["replica"], buckets=TTFT_BUCKETS, registry=registry)
        self.e2e = Histogram(P + "request_e2e_seconds", "arrival to the last byte at the proxy, completed counted "
                             "requests, per replica", ["replica"], buckets=E2E_BUCKETS, registry=registry)

    def observe(self, done: RequestDone) -> None:
        """A `Proxy.listeners` entry: runs on the event loop, takes microseconds."""
        if not done.counted or done.outcome is not Outcome.COMPLETED or done.replica is None:
            return
        replica = str(done.replica)
        if done.ttft_s is not None:
            self.ttft.labels(replica).observe(done.ttft_s)
        self.e2e.labels(replica).observe(done.e2e_s)
