"""Thermal figures from the watchdog's NVML samples: throttle share by reason, temperature,
clock drop, and soak throughput in throttled vs unthrottled windows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from .memory import _epoch

# NVML clock-event reason bits (nvmlClocksEventReason*)
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "power_brake"}
THROTTLE_MASK = sum(REASONS)
IDLE = 0x1


def gpu_points(samples: list[dict[str, Any]] | None) -> dict[str, list[dict[str, Any]]]:
    """uuid -> [{t, temp_c, sm_clock_mhz, sm_clock_max_mhz, reasons, name}] from samples with `gpus`."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples or []:
        nv = s.get("nvml") if isinstance(s.get("nvml"), dict) else s
        t = _epoch(nv.get("at_s") or s.get("at"))
        for g in nv.get("gpus") or []:
            if not isinstance(g, dict) or t is None:
                continue
            out[str(g.get("uuid") or g.get("index"))].append({
                "t": t, "name": g.get("name"), "temp_c": g.get("temp_c"), "sm_clock_mhz": g.get("sm_clock_mhz"),
                "sm_clock_max_mhz": g.get("sm_clock_max_mhz"), "reasons": g.get("clock_reasons"),
                "temp_slowdown_c": g.get("temp_slowdown_c"),
            })
    return {k: sorted(v, key=lambda p: p["t"]) for k, v in out.items()}


def _rate(ends: np.ndarray, windows: list[tuple[float, float]]) -> float | None:
    dur = sum(b - a for a, b in windows)
    if dur <= 0 or ends.size == 0:
        return None
    n = sum(int(((ends >= a) & (ends < b)).sum()) for a, b in windows)
    return n / dur


def thermal_report(samples: list[dict[str, Any]] | None, request_ends: np.ndarray) -> dict[str, Any]:
    if samples is None:
        return {"present": False, "note": "no watchdog samples table in this ledger", "gpus": []}
    per_gpu = gpu_points(samples)
    if not per_gpu:
        return {"present": False, "note": "no GPU samples (watchdog absent, no NVML, or a CPU-only run)", "gpus": []}
    gpus = []
    for uuid, pts in per_gpu.items():
        reasons = [p["reasons"] for p in pts]
        known = [r for r in reasons if isinstance(r, int)]
        share = {name: (sum(1 for r in known if r & bit) / len(known) if known else None) for bit, name in REASONS.items()}
        throttled_any = sum(1 for r in known if r & THROTTLE_MASK) / len(known) if known else None
        temps = [p["temp_c"] for p in pts if p["temp_c"] is not None]
        busy = [p for p in pts if not (isinstance(p["reasons"], int) and p["reasons"] & IDLE)]
        clocks = [p["sm_clock_mhz"] for p in busy if p["sm_clock_mhz"]]  # an idle GPU clocks down: no drop
        cmax = next((p["sm_clock_max_mhz"] for p in pts if p["sm_clock_max_mhz"]), None) or (max(clocks) if clocks else None)
        hot, cool = [], []
        for a, b in zip(pts, pts[1:]):
            (hot if isinstance(a["reasons"], int) and a["reasons"] & THROTTLE_MASK else cool).append((a["t"], b["t"]))
        gpus.append({
            "uuid": uuid, "name": pts[0]["name"], "samples": len(pts),
            "throttled_share": throttled_any, "throttled_share_by_reason": share,
            "max_temp_c": max(temps) if temps else None,
            "temp_slowdown_c": pts[0]["temp_slowdown_c"],
            "sm_clock_max_mhz": cmax, "sm_clock_p50_mhz": float(np.median(clocks)) if clocks else None,
            "sm_clock_min_mhz": min(clocks) if clocks else None,
            # p5 of busy clocks vs the max clock: a sustained drop, not one slow sample
            "clock_drop_pct": (100.0 * (1 - float(np.percentile(clocks, 5)) / cmax) if clocks and cmax else None),
            "throughput_throttled_rps": _rate(request_ends, hot),
            "throughput_unthrottled_rps": _rate(request_ends, cool),
        })
    return {"present": True, "gpus": gpus, "note": ""}
