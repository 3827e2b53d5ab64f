"""Thermal: share of time with thermal slowdown bits, margin to the slowdown threshold, and
the SM clock's drop below its maximum while busy, per GPU over a sliding time window.

Windowed like gpud's hw-slowdown check, so a rare event does not flap: a verdict needs the
window at least half covered. Idle samples (reason bit 0x1) do not count toward clock drop.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

from vllm_guard.runtime.ledger import PREVENTIVE

from .base import Action, CheckResult, Finding, Health, Sample, result
from .settings import WatchdogConfig
from .stats import share

GPU_IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
THERMAL_BITS = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL


def bits_named(reasons: int) -> list[str]:
    names = {GPU_IDLE: "idle", SW_POWER_CAP: "sw_power_cap", HW_SLOWDOWN: "hw_slowdown",
             SW_THERMAL: "sw_thermal", HW_THERMAL: "hw_thermal", HW_POWER_BRAKE: "hw_power_brake"}
    return [n for b, n in names.items() if reasons & b]


class ThermalDetector:
    name = "thermal"

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.windows: dict[str, collections.deque[dict[str, Any]]] = {}

    def is_supported(self, s: Sample) -> bool:
        return any(g.get("clock_reasons") is not None or g.get("temp_c") is not None
                   for g in (s.get("nvml") or {}).get("gpus", []))

    def check(self, s: Sample) -> CheckResult:
        if not self.is_supported(s):
            return result(self.name, s, Health.UNKNOWN, "no GPU thermal readings")
        findings, per_gpu, degraded, covered = [], [], [], False
        for g in s["nvml"]["gpus"]:
            w = self.windows.setdefault(g["uuid"], collections.deque())
            w.append({"t": s["t"], "reasons": g.get("clock_reasons") or 0, "temp": g.get("temp_c"),
                      "sm": g.get("sm_clock_mhz"), "max": g.get("sm_clock_max_mhz")})
            while w and s["t"] - w[0]["t"] > self.cfg.thermal_window:
                w.popleft()
            v = self._judge(g, w)
            per_gpu.append(v)
            covered = covered or v["covered"]
            if v["covered"] and v["throttle_share"] >= self.cfg.thermal_share:
                findings.append(Finding(
                    "thermal", g["uuid"],
                    f"{g.get('name')} thermal slowdown {v['throttle_share']:.0%} of the last "
                    f"{v['window_s']:.0f}s at {v['temp_c']} C (margin {v['margin_c']} C), "
                    f"SM clock -{v['clock_drop_pct']}%", PREVENTIVE, Action.RECYCLE, v))
            elif v["throttle_share"] > 0 or (v["margin_c"] is not None and v["margin_c"] < self.cfg.thermal_margin_c) \
                    or (v["clock_drop_pct"] or 0) >= self.cfg.clock_drop_pct:
                degraded.append(f"{g.get('name')}: share {v['throttle_share']:.0%}, margin {v['margin_c']} C, "
                                f"clock -{v['clock_drop_pct']}%")
        data = {"gpus": per_gpu}
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings, data)
        if degraded:
            return result(self.name, s, Health.DEGRADED, "; ".join(degraded), data=data)
        if not covered:
            return result(self.name, s, Health.INITIALIZING, "thermal window not yet half covered", data=data)
        return result(self.name, s, Health.HEALTHY, "no thermal slowdown", data=data)

    def _judge(self, g: dict[str, Any], w: collections.deque[dict[str, Any]]) -> dict[str, Any]:
        span = w[-1]["t"] - w[0]["t"] if len(w) > 1 else 0.0
        thr = share([bool(x["reasons"] & THERMAL_BITS) for x in w])
        brake = share([bool(x["reasons"] & HW_POWER_BRAKE) for x in w])
        busy = [x["sm"] / x["max"] for x in w if x["sm"] and x["max"] and not x["reasons"] & GPU_IDLE]
        drop = round((1 - statistics.fmean(busy)) * 100, 1) if busy else None
        slow = g.get("temp_slowdown_c")
        temp = g.get("temp_c")
        return {"uuid": g["uuid"], "name": g.get("name"), "samples": len(w), "window_s": round(span, 1),
                "covered": span >= self.cfg.thermal_window / 2, "throttle_share": round(thr, 4),
                "power_brake_share": round(brake, 4), "temp_c": temp, "slowdown_c": slow,
                "margin_c": None if temp is None or slow is None else slow - temp,
                "clock_drop_pct": drop, "sm_clock_mhz": g.get("sm_clock_mhz"),
                "reasons": bits_named(g.get("clock_reasons") or 0)}
