"""Prometheus exporter: `vllm_guard_*` gauges and counters on their own registry, bound to
loopback unless configured otherwise. Updated from each tick's verdicts, the runtime's typed
status totals, and the ledger's reliability figures (`core.reliability.service_figures`: the
same MTBF `vllm-guard report` and the runtime's metrics port show)."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from vllm_guard.core.ledger import read_runtime
from vllm_guard.core.reliability import ServiceFigures, service_figures

from .base import CheckResult, Health, Sample

HEALTH_VALUE = {Health.HEALTHY: 1, Health.UNKNOWN: -1, Health.INITIALIZING: -1}


class Exporter:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.slope = Gauge("vllm_guard_memory_slope_mb_per_100_requests", "Theil-Sen memory slope per process",
                           ["memory", "role", "pid"], registry=r)
        self.slope_h = Gauge("vllm_guard_memory_slope_mb_per_hour", "memory slope against time",
                             ["memory", "role", "pid"], registry=r)
        self.tto = Gauge("vllm_guard_time_to_oom_seconds", "forecast time to out-of-memory",
                         ["memory", "role", "pid"], registry=r)
        self.throttle = Gauge("vllm_guard_thermal_throttle_share",
                              "share of the window throttled (thermal slowdown or HW power brake)", ["gpu"], registry=r)
        self.power_cap = Gauge("vllm_guard_power_capped_share",
                               "share of the window at the software power cap (not a throttle)", ["gpu"], registry=r)
        self.margin = Gauge("vllm_guard_thermal_margin_celsius", "slowdown threshold minus temperature",
                            ["gpu"], registry=r)
        self.drop = Gauge("vllm_guard_sm_clock_drop_percent", "SM clock below max while busy", ["gpu"], registry=r)
        self.health = Gauge("vllm_guard_detector_healthy", "1 healthy, 0 not, -1 unknown", ["detector"], registry=r)
        self.incidents = Counter("vllm_guard_incidents", "incidents recorded", ["kind"], registry=r)
        self.actions = Counter("vllm_guard_actions", "actions sent through the admin socket",
                               ["action", "outcome"], registry=r)
        self.restarts = Gauge("vllm_guard_runtime_failures", "unplanned failures the runtime reports", registry=r)
        self.recycles = Gauge("vllm_guard_runtime_recycles", "recycles the runtime reports", registry=r)
        self.mtbf = Gauge("vllm_guard_mtbf_hours", "up time / unplanned events (ledger; NaN before the first)",
                          registry=r)
        self.availability = Gauge("vllm_guard_availability", "share of observed time in service (ledger)",
                                  registry=r)
        self.collector_ok = Gauge("vllm_guard_collector_success", "last collection succeeded", ["collector"],
                                  registry=r)
        self.collector_s = Gauge("vllm_guard_collector_duration_seconds", "last collection time", ["collector"],
                                 registry=r)
        self.escalated = Gauge("vllm_guard_escalated", "1 when the rate limit stopped all actions", registry=r)
        self.probe_misses = Gauge("vllm_guard_probe_misses", "the watchdog's timed-out probes in a row with no "
                                  "engine progress, per replica", ["replica"], registry=r)
        self._series: set[tuple[str, str, str]] = set()
        self.mtbf.set(math.nan)
        self.availability.set(math.nan)

    def serve(self, addr: str, port: int) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def update(self, results: list[CheckResult], s: Sample) -> None:
        for res in results:
            self.health.labels(res.name).set(HEALTH_VALUE.get(res.health, 0))
            if res.name == "memory_drift" and "series" in res.data:
                self._drift(res.data["series"])
            elif res.name == "hang" and "replicas" in res.data:
                for i, rep in res.data["replicas"].items():
                    self.probe_misses.labels(i).set(rep["probe_misses"])
            elif res.name == "thermal" and "gpus" in res.data:
                for g in res.data["gpus"]:
                    self.throttle.labels(g["uuid"]).set(g["throttle_share"])
                    self.power_cap.labels(g["uuid"]).set(g["power_capped_share"])
                    if g["margin_c"] is not None:
                        self.margin.labels(g["uuid"]).set(g["margin_c"])
                    if g["clock_drop_pct"] is not None:
                        self.drop.labels(g["uuid"]).set(g["clock_drop_pct"])
        for name, c in s.collectors.items():
            self.collector_ok.labels(name).set(1 if c.ok else 0)
            self.collector_s.labels(name).set(c.seconds)
        if s.status is not None:
            self.restarts.set(s.status.failures)
            self.recycles.set(s.status.recycles)

    def update_reliability(self, conn: sqlite3.Connection, now: float) -> ServiceFigures:
        """MTBF and availability from the runtime's ledger tables. The confidence bounds need
        scipy, which this light process does not load: `vllm-guard report` gives them."""
        figs = service_figures(read_runtime(conn), now, bounds=False)
        m = figs.mtbf
        self.mtbf.set(m.mtbf_h if m is not None and m.mtbf_h is not None else math.nan)
        self.availability.set(figs.availability if figs.availability is not None else math.nan)
        return figs

    def _drift(self, series: list[dict[str, Any]]) -> None:
        now = set()
        for v in series:
            key = (v["memory"], v["role"], str(v["pid"]))
            now.add(key)
            self.slope.labels(*key).set(v["slope_mb_per_100"])
            self.slope_h.labels(*key).set(v["slope_mb_per_h"])
            self.tto.labels(*key).set(v["time_to_oom_s"] if v["time_to_oom_s"] is not None else float("inf"))
        for key in self._series - now:  # gone with their process
            for g in (self.slope, self.slope_h, self.tto):
                try:
                    g.remove(*key)
                except KeyError:
                    pass
        self._series = now
