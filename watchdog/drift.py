"""Memory drift: Theil-Sen slope of each service process's memory against requests and time.

Per process (vLLM preallocates KV, so totals stay flat: look per pid) and per memory kind
(host RSS from psutil, GPU from NVML's per-process list). Points start after the warm-up, and
a slope is a leak by the project's one rule (`core.leak`: its interval clears the noise floor in
the whole window and in each half of it; a step is not a leak); then time-to-OOM = headroom /
slope in time, and a forecast inside the horizon asks for a preventive recycle. Requests are the runtime's `requests.total` (status), which never counts probes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.ledger import EndClass
from vllm_guard.core import gpu, leak
from vllm_guard.core.stats import time_to_exhaust

from .base import Action, CheckResult, Finding, Health, Sample, result

MAX_SERIES_POINTS = 7200


@dataclass
class Series:
    role: str
    start_requests: float
    pts: collections.deque[tuple[float, float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_SERIES_POINTS))
    judged_at: float = float("-inf")
    verdict: dict[str, Any] | None = None


class DriftDetector:
    name = "memory_drift"

    def __init__(self, cfg: WatchdogConfig, gpu_cap_mb: float = 0.0) -> None:
        self.cfg = cfg
        self.gpu_cap_mb = gpu_cap_mb  # `[inject] gpu_memory_budget_gib`: the card acts this small
        self.series: dict[tuple[str, int], Series] = {}

    def is_supported(self, s: Sample) -> bool:
        return s.status is not None and bool(s.procs)

    def _readings(self, s: Sample) -> dict[tuple[str, int], tuple[str, float]]:
        procs = s.procs or {}
        out: dict[tuple[str, int], tuple[str, float]] = {}
        for pid, m in procs.items():
            out[("host_rss", pid)] = (m.role.value, m.rss_mb)
        for g in s.nvml.gpus if s.nvml is not None else []:
            for p in g.processes:
                if p.pid in procs and p.used_mb is not None:
                    role = procs[p.pid].role.value
                    key = ("gpu", p.pid)
                    out[key] = (role, (out[key][1] if key in out else 0.0) + p.used_mb)
        return out

    def _headroom(self, s: Sample, memory: str) -> float | None:
        procs = s.procs or {}
        if memory == "host_rss":
            if self.cfg.host_budget_mb:
                return self.cfg.host_budget_mb - sum(m.rss_mb for m in procs.values())
            return s.host.mem_available_mb if s.host is not None else None
        gpus = s.nvml.gpus if s.nvml is not None else []
        if self.cfg.gpu_budget_mb:
            used = sum(p.used_mb or 0.0 for g in gpus for p in g.processes if p.pid in procs)
            return self.cfg.gpu_budget_mb - used
        free = [gpu.capped_total_mb(g.mem_total_mb, self.gpu_cap_mb) - g.mem_used_mb
                for g in gpus if g.mem_total_mb is not None and g.mem_used_mb is not None]
        return min(free) if free else None

    def check(self, s: Sample) -> CheckResult:
        if s.status is None or not s.procs:
            return result(self.name, s, Health.UNKNOWN, "no runtime status or no service processes")
        requests = float(s.status.requests.total)
        readings = self._readings(s)
        for key in [k for k in self.series if k not in readings]:
            del self.series[key]  # process gone (recycled): a new generation starts a new series
        findings: list[Finding] = []
        out: list[dict[str, Any]] = []
        warming = False
        for key, (role, mb) in readings.items():
            ser = self.series.setdefault(key, Series(role, requests))
            if not leak.warmed_up(requests - ser.start_requests, self.cfg.warmup_requests):
                warming = True
                continue
            ser.pts.append((requests, s.t, mb))
            if s.t - ser.judged_at >= self.cfg.drift_every:  # Theil-Sen is O(n^2): not every tick
                ser.verdict, ser.judged_at = self._judge(s, key, ser), s.t
            verdict = ser.verdict
            if verdict is None:
                warming = True
                continue
            out.append(verdict)
            findings.extend(self._findings(key, verdict))
        data = {"series": out}
        if any(f.action is Action.RECYCLE for f in findings):
            return result(self.name, s, Health.UNHEALTHY, findings[-1].cause, findings, data)
        if findings:
            return result(self.name, s, Health.DEGRADED, findings[-1].cause, findings, data)
        if warming and not out:
            return result(self.name, s, Health.INITIALIZING, "warming up / collecting points", data=data)
        return result(self.name, s, Health.HEALTHY, "no significant growth", data=data)

    def _judge(self, s: Sample, key: tuple[str, int], ser: Series) -> dict[str, Any] | None:
        reqs = [p[0] for p in ser.pts]
        if len(ser.pts) < self.cfg.drift_min_points or max(reqs) - min(reqs) < self.cfg.drift_min_requests:
            return None
        v = leak.judge([leak.Series([p[1] for p in ser.pts], reqs, [p[2] for p in ser.pts])],
                       self.cfg.noise_floor_mb_per_100, self.cfg.drift_min_requests, self.cfg.drift_min_points)
        if v.per_100 is None:
            return None
        memory, pid = key
        headroom = self._headroom(s, memory)
        tto_h = v.time_to_oom_h(headroom)
        rto = (time_to_exhaust(headroom, v.per_100.slope / 100.0)
               if v.shown and headroom is not None else None)
        return {"memory": memory, "pid": pid, "role": ser.role, "points": len(ser.pts),
                "requests_span": max(reqs) - min(reqs), "requests": reqs[-1],
                "slope_mb_per_100": round(v.per_100.slope, 4),
                "ci_mb_per_100": [round(v.per_100.low, 4), round(v.per_100.high, 4)],
                "halves_mb_per_100": [None if h is None else round(h.slope, 4) for h in v.halves],
                "slope_mb_per_h": round(v.per_hour.slope, 2) if v.per_hour is not None else 0.0,
                "headroom_mb": headroom,
                "significant": v.shown, "time_to_oom_s": None if tto_h is None else round(tto_h * 3600, 1),
                "requests_to_oom": None if rto is None else round(rto)}

    def _findings(self, key: tuple[str, int], v: dict[str, Any]) -> list[Finding]:
        if not v["significant"]:
            return []
        k = f"{key[0]}:{key[1]}"
        cause = (f"{v['role']} (pid {v['pid']}) {v['memory']} grows {v['slope_mb_per_100']:.2f} MB/100 requests "
                 f"({v['slope_mb_per_h']:.0f} MB/h)")
        out = [Finding("memory_drift", k, cause, EndClass.PREVENTIVE, Action.NONE, dict(v))]
        tto = v["time_to_oom_s"]
        if tto is not None and tto <= self.cfg.forecast_horizon:
            out.append(Finding("memory_forecast", k, f"{cause}: out of memory in {tto / 3600:.1f} h",
                               EndClass.PREVENTIVE, Action.RECYCLE, dict(v)))
        return out
