"""Thermal: per GPU over a sliding time window, the share of samples *throttled* (heat or a
hardware signal: `core.gpu.throttled`, the project's one definition), of them the thermal
share, the share *power capped* (reported apart: a busy card normally runs at its power
limit, so a cap is not a throttle), the margin to the slowdown threshold, and the SM clock's
drop below its maximum while busy.

Windowed like gpud's hw-slowdown check, so a rare event does not flap: a verdict needs the
window at least half covered. Idle samples do not count toward clock drop.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from vllm_guard.core import gpu
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.samples import GpuReading
from vllm_guard.core.stats import share

from .base import Action, CheckResult, Finding, Health, Sample, result


@dataclass(frozen=True)
class Point:
    t: float
    reasons: int | None
    sm_mhz: float | None
    max_mhz: float | None


class ThermalDetector:
    name = "thermal"

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.windows: dict[str, collections.deque[Point]] = {}

    def is_supported(self, s: Sample) -> bool:
        return s.nvml is not None and any(g.clock_reasons is not None or g.temp_c is not None for g in s.nvml.gpus)

    def check(self, s: Sample) -> CheckResult:
        if s.nvml is None or not self.is_supported(s):
            why = f": {s.nvml.error}" if s.nvml is not None and s.nvml.error else ""
            return result(self.name, s, Health.UNKNOWN, f"no GPU thermal readings{why}")
        findings: list[Finding] = []
        per_gpu: list[dict[str, Any]] = []
        degraded: list[str] = []
        capped: list[str] = []
        covered = False
        for g in s.nvml.gpus:
            w = self.windows.setdefault(g.uuid, collections.deque())
            w.append(Point(s.t, g.clock_reasons, g.sm_clock_mhz, g.sm_clock_max_mhz))
            while w and s.t - w[0].t > self.cfg.thermal_window:
                w.popleft()
            v = self._judge(g, w)
            per_gpu.append(v)
            covered = covered or v["covered"]
            if v["power_capped_share"] > 0:
                capped.append(f"{g.name} power capped {v['power_capped_share']:.0%}")
            if v["covered"] and v["throttle_share"] >= self.cfg.thermal_share:
                findings.append(Finding(
                    "thermal", g.uuid,
                    f"{g.name} throttled {v['throttle_share']:.0%} of the last {v['window_s']:.0f}s "
                    f"(thermal {v['thermal_share']:.0%}, power brake {v['power_brake_share']:.0%}) at "
                    f"{v['temp_c']} C (margin {v['margin_c']} C), SM clock -{v['clock_drop_pct']}%",
                    EndClass.PREVENTIVE, Action.RECYCLE, v))
            elif v["throttle_share"] > 0 or (v["margin_c"] is not None and v["margin_c"] < self.cfg.thermal_margin_c) \
                    or (v["clock_drop_pct"] or 0) >= self.cfg.clock_drop_pct:
                degraded.append(f"{g.name}: throttled {v['throttle_share']:.0%}, margin {v['margin_c']} C, "
                                f"clock -{v['clock_drop_pct']}%")
        data = {"gpus": per_gpu}
        note = f" ({'; '.join(capped)}: at its power limit, not throttled)" if capped else ""
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings, data)
        if degraded:
            return result(self.name, s, Health.DEGRADED, "; ".join(degraded) + note, data=data)
        if not covered:
            return result(self.name, s, Health.INITIALIZING, "thermal window not yet half covered" + note, data=data)
        return result(self.name, s, Health.HEALTHY, "not throttled" + note, data=data)

    def _judge(self, g: GpuReading, w: collections.deque[Point]) -> dict[str, Any]:
        span = w[-1].t - w[0].t if len(w) > 1 else 0.0
        pct = gpu.clock_drop_pct((x.sm_mhz, x.max_mhz, x.reasons) for x in w)
        drop = None if pct is None else round(pct, 1)
        margin = None if g.temp_c is None or g.temp_slowdown_c is None else g.temp_slowdown_c - g.temp_c
        return {"uuid": g.uuid, "name": g.name, "samples": len(w), "window_s": round(span, 1),
                "covered": span >= self.cfg.thermal_window / 2,
                "throttle_share": round(share([gpu.throttled(x.reasons) for x in w]), 4),
                "thermal_share": round(share([gpu.thermal(x.reasons) for x in w]), 4),
                "power_brake_share": round(share([bool(x.reasons and x.reasons & gpu.HW_POWER_BRAKE) for x in w]), 4),
                "power_capped_share": round(share([gpu.power_capped(x.reasons) for x in w]), 4),
                "temp_c": g.temp_c, "slowdown_c": g.temp_slowdown_c, "margin_c": margin,
                "clock_drop_pct": drop, "sm_clock_mhz": g.sm_clock_mhz,
                "reasons": gpu.reason_names(g.clock_reasons)}
