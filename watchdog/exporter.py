"""Prometheus exporter: `vllm_guard_*` gauges and counters on their own registry, bound to
loopback unless configured otherwise. Updated from each tick's verdicts."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .base import CheckResult


class Exporter:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.slope = Gauge("vllm_guard_memory_slope_mb_per_100_requests", "Theil-Sen memory slope per process",
                           ["memory", "role", "pid"], registry=r)
        self.slope_h = Gauge("vllm_guard_memory_slope_mb_per_hour", "memory slope against time",
                             ["memory", "role", "pid"], registry=r)
        self.tto = Gauge("vllm_guard_time_to_oom_seconds", "forecast time to out-of-memory",
                         ["memory", "role", "pid"], registry=r)
        self.throttle = Gauge("vllm_guard_thermal_throttle_share", "share of the window with thermal slowdown",
                              ["gpu"], registry=r)
        self.margin = Gauge("vllm_guard_thermal_margin_celsius", "slowdown threshold minus temperature",
                            ["gpu"], registry=r)
        self.drop = Gauge("vllm_guard_sm_clock_drop_percent", "SM clock below max while busy", ["gpu"], registry=r)
        self.health = Gauge("vllm_guard_detector_healthy", "1 healthy, 0 not, -1 unknown", ["detector"], registry=r)
        self.incidents = Counter("vllm_guard_incidents", "incidents recorded", ["kind"], registry=r)
        self.actions = Counter("vllm_guard_actions", "actions taken through the admin socket",
                               ["action", "outcome"], registry=r)
        self.restarts = Gauge("vllm_guard_runtime_failures", "unplanned failures the runtime reports", registry=r)
        self.recycles = Gauge("vllm_guard_runtime_recycles", "recycles the runtime reports", registry=r)
        self.mtbf = Gauge("vllm_guard_mtbf_hours", "up time / unplanned failures (ledger)", registry=r)
        self.collector_ok = Gauge("vllm_guard_collector_success", "last collection succeeded", ["collector"],
                                  registry=r)
        self.collector_s = Gauge("vllm_guard_collector_duration_seconds", "last collection time", ["collector"],
                                 registry=r)
        self.escalated = Gauge("vllm_guard_escalated", "1 when the rate limit stopped all actions", registry=r)
        self._series: set[tuple[str, str, str]] = set()

    def serve(self, addr: str, port: int) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def update(self, results: list[CheckResult], s: dict[str, Any]) -> None:
        for res in results:
            self.health.labels(res.name).set({"healthy": 1, "unknown": -1, "initializing": -1}.get(res.health.value, 0))
            if res.name == "memory_drift":
                self._drift(res.data.get("series", []))
            elif res.name == "thermal":
                for g in res.data.get("gpus", []):
                    self.throttle.labels(g["uuid"]).set(g["throttle_share"])
                    if g["margin_c"] is not None:
                        self.margin.labels(g["uuid"]).set(g["margin_c"])
                    if g["clock_drop_pct"] is not None:
                        self.drop.labels(g["uuid"]).set(g["clock_drop_pct"])
        for name, (ok, secs) in s.get("collectors", {}).items():
            self.collector_ok.labels(name).set(1 if ok else 0)
            self.collector_s.labels(name).set(secs)
        st = s.get("status")
        if st:
            self.restarts.set(st.get("failures", 0))
            self.recycles.set(len(st.get("recycles", [])))

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
