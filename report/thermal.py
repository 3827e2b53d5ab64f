"""Thermal figures from the watchdog's NVML samples: throttle share, power-cap share apart,
share by reason, temperature, clock drop, and soak throughput in throttled vs unthrottled
windows.

What counts as throttled is `core.gpu.throttled()` (heat or a hardware signal), the rule the
watchdog's detector uses too; the SW power cap is `core.gpu.power_capped()`, shown apart: a
busy card at its power limit is not throttled. Clock drop is `core.gpu.clock_drop_pct()`, the
watchdog's figure, over the worst window of the watchdog's length: what it saw at worst.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_guard.core import gpu
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.samples import Tick

from .figures import GpuThermal, ThermalFigures

WINDOW_S = float(WatchdogConfig().thermal_window)  # the watchdog's thermal window
# every reason bit but idle, by name (core.gpu's names)
REASONS = {bit: name for bit, name in gpu.REASON_NAMES.items() if bit != gpu.GPU_IDLE}


@dataclass(frozen=True)
class GpuPoint:
    t: float  # epoch seconds
    name: str
    temp_c: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    reasons: int | None
    temp_slowdown_c: float | None


def gpu_points(ticks: list[Tick] | None) -> dict[str, list[GpuPoint]]:
    """uuid -> points in time order, from the ticks that have an NVML reading."""
    out: dict[str, list[GpuPoint]] = defaultdict(list)
    for s in ticks or []:
        if s.nvml is None:
            continue
        for g in s.nvml.gpus:
            out[g.uuid].append(GpuPoint(s.nvml.at_s, g.name, g.temp_c, g.sm_clock_mhz, g.sm_clock_max_mhz,
                                        g.clock_reasons, g.temp_slowdown_c))
    return {k: sorted(v, key=lambda p: p.t) for k, v in out.items()}


def _rate(ends: np.ndarray, windows: list[tuple[float, float]]) -> float | None:
    dur = sum(b - a for a, b in windows)
    if dur <= 0 or ends.size == 0:
        return None
    n = sum(int(((ends >= a) & (ends < b)).sum()) for a, b in windows)
    return n / dur


def _share(known: list[int], pred: Any) -> float | None:
    return sum(1 for r in known if pred(r)) / len(known) if known else None


def worst_drop(pts: list[GpuPoint], cmax: float | None, window_s: float = WINDOW_S) -> float | None:
    """The clock drop (`core.gpu.clock_drop_pct`, the watchdog's figure) of the worst window of
    the watchdog's length; the whole run's when the run is shorter (what the watchdog saw). A
    point without its own maximum clock is read against the GPU's (`cmax`)."""
    samples = [(p.sm_clock_mhz, p.sm_clock_max_mhz or cmax, p.reasons) for p in pts]
    busy = [(p.t, r) for p, s in zip(pts, samples) if (r := gpu.busy_clock_ratio(*s)) is not None]
    if not busy:
        return None
    if busy[-1][0] - busy[0][0] < window_s:
        return gpu.clock_drop_pct(samples)
    t = np.array([b[0] for b in busy])
    csum = np.concatenate([[0.0], np.cumsum([b[1] for b in busy])])
    j = np.searchsorted(t, t - window_s, side="left")  # each window: busy[j[i] .. i], as the watchdog keeps it
    idx = np.flatnonzero((t - t[0]) >= window_s)  # windows the watchdog saw whole
    means = (csum[idx + 1] - csum[j[idx]]) / (idx + 1 - j[idx])
    return gpu.drop_pct(float(means.min()))


def gpu_figures(uuid: str, pts: list[GpuPoint], request_ends: np.ndarray) -> GpuThermal:
    known = [p.reasons for p in pts if p.reasons is not None]
    temps = [p.temp_c for p in pts if p.temp_c is not None]
    busy = [p for p in pts if not gpu.idle(p.reasons)]
    clocks = [p.sm_clock_mhz for p in busy if p.sm_clock_mhz]  # an idle GPU clocks down: no drop
    cmax = next((p.sm_clock_max_mhz for p in pts if p.sm_clock_max_mhz), None) or (max(clocks) if clocks else None)
    hot: list[tuple[float, float]] = []
    cool: list[tuple[float, float]] = []
    for a, b in zip(pts, pts[1:]):
        (hot if gpu.throttled(a.reasons) else cool).append((a.t, b.t))
    return GpuThermal(
        uuid=uuid, name=pts[0].name, samples=len(pts),
        throttled_share=_share(known, gpu.throttled), power_capped_share=_share(known, gpu.power_capped),
        throttled_share_by_reason={name: _share(known, lambda r, b=bit: bool(r & b)) for bit, name in REASONS.items()},
        max_temp_c=max(temps) if temps else None, temp_slowdown_c=pts[0].temp_slowdown_c,
        sm_clock_max_mhz=cmax, sm_clock_p50_mhz=float(np.median(clocks)) if clocks else None,
        sm_clock_min_mhz=min(clocks) if clocks else None,
        clock_drop_pct=worst_drop(pts, cmax),
        throughput_throttled_rps=_rate(request_ends, hot), throughput_unthrottled_rps=_rate(request_ends, cool))


def thermal_report(ticks: list[Tick] | None, request_ends: np.ndarray) -> ThermalFigures:
    if ticks is None:
        return ThermalFigures(False, "no watchdog samples table in this ledger")
    per_gpu = gpu_points(ticks)
    if not per_gpu:
        return ThermalFigures(False, "no GPU samples (watchdog absent, no NVML, or a CPU-only run)")
    return ThermalFigures(True, "", [gpu_figures(u, pts, request_ends) for u, pts in per_gpu.items()])
