"""Leak figures: memory points from the watchdog's samples (preferred) or the soak's own.

Points are grouped per process role and fitted within each generation (see leak.py): MB per
100 requests (x = requests served by that generation) and MB per hour (x = time since the
generation's first point). Points before `warmup_requests` are dropped: allocator pools,
caches and compiled graphs settle there, which is growth but not a leak.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from vllm_guard.core.samples import Tick
from vllm_guard.core.timefmt import epoch

from .leak import Series, group_slope, stratified_slope, time_to_limit_h
from .ledgerread import SoakSample

METRICS = ("rss_mb", "uss_mb", "gpu_mb")


@dataclass(frozen=True)
class MemPoint:
    """One process's memory at one time, from either source."""

    t: float  # epoch seconds
    generation: int | None
    role: str
    pid: int
    requests: int | None  # requests its generation had served
    rss_mb: float | None
    uss_mb: float | None
    gpu_mb: float | None
    host_available_mb: float | None

    def metric(self, name: str) -> float | None:
        v: float | None = getattr(self, name)
        return v


def points_from_watchdog(ticks: list[Tick] | None) -> list[MemPoint]:
    """Per-process points of the ticks that have `procs` (GPU MB from the same tick's NVML)."""
    out: list[MemPoint] = []
    for s in ticks or []:
        t = epoch(s.at)
        if not s.procs or t is None:
            continue
        gpu_by_pid = {p.pid: p.used_mb for g in (s.nvml.gpus if s.nvml else []) for p in g.processes
                      if p.used_mb is not None}
        gen = s.status.generation if s.status else None
        req = s.status.requests_generation if s.status else None
        avail = s.host.mem_available_mb if s.host else None
        for pid, m in s.procs.items():
            out.append(MemPoint(t, gen, m.role.value, int(pid), req, m.rss_mb, m.uss_mb, gpu_by_pid.get(int(pid)), avail))
    return out


def points_from_soak(rows: list[SoakSample]) -> list[MemPoint]:
    out = []
    for r in rows:
        t = epoch(r.at)
        if t is not None:
            out.append(MemPoint(t, r.generation, r.role or "?", r.pid, r.requests_generation, r.rss_mb, r.uss_mb,
                                r.gpu_mb, r.host_available_mb))
    return out


def _series(points: list[MemPoint], metric: str, by_requests: bool) -> list[Series]:
    groups: dict[Any, Series] = {}
    t0: dict[Any, float] = {}
    for p in sorted(points, key=lambda p: p.t):
        y = p.metric(metric)
        if y is None:
            continue
        key: int | str = p.generation if p.generation is not None else f"pid{p.pid}"
        t0.setdefault(key, p.t)
        x = p.requests if by_requests else (p.t - t0[key]) / 3600.0
        if x is None:
            continue
        groups.setdefault(key, Series(key if isinstance(key, int) else -1)).x.append(float(x))
        groups[key].y.append(float(y))
    return list(groups.values())


def gpu_headroom(ticks: list[Tick] | None, budget_mb: float | None) -> tuple[float | None, str]:
    """GPU MB left at the last NVML tick, by the watchdog's rule: its GPU budget (meta) minus
    what the service's processes hold, else the least free memory of the GPUs (NVML total -
    used). With the reason, for the report."""
    last = next((s for s in reversed(ticks or []) if s.nvml is not None and s.nvml.gpus), None)
    if last is None or last.nvml is None:
        return None, "no NVML samples"
    gpus = last.nvml.gpus
    if budget_mb:
        ours = {int(p) for p in (last.procs or {})}
        used = sum(p.used_mb or 0.0 for g in gpus for p in g.processes if not ours or p.pid in ours)
        return budget_mb - used, f"the watchdog's GPU budget {budget_mb:g} MB minus the service's {used:g} MB"
    free = [(g.mem_total_mb - g.mem_used_mb, g.mem_total_mb) for g in gpus
            if g.mem_total_mb is not None and g.mem_used_mb is not None]
    if not free:
        return None, "NVML gave no memory total"
    left, total = min(free)
    return left, f"NVML free memory ({left:g} of {total:g} MB)"


def leak_report(points: list[MemPoint], source: str | None, confidence: float = 0.90,
                warmup_requests: int = 20, gpu_headroom_mb: float | None = None,
                gpu_headroom_from: str = "no NVML samples") -> dict[str, Any]:
    if not points:
        return {"source": None, "processes": [], "note": "no memory samples: run the watchdog, or give the soak "
                "--state-dir so it records the guard's memory readings"}
    kept = [p for p in points if p.requests is None or p.requests >= warmup_requests]
    by_role: dict[str, list[MemPoint]] = defaultdict(list)
    for p in kept:
        by_role[p.role or "?"].append(p)
    avail = [p.host_available_mb for p in sorted(points, key=lambda p: p.t) if p.host_available_mb]
    headroom = avail[-1] if avail else None
    procs: list[dict[str, Any]] = []
    rss_slopes: list[float] = []
    for role in sorted(by_role):
        pts = by_role[role]
        for metric in METRICS:
            if not any(p.metric(metric) for p in pts):
                continue
            per_req = stratified_slope(_series(pts, metric, True), confidence).scaled(100.0)
            per_h = stratified_slope(_series(pts, metric, False), confidence)
            last = max(pts, key=lambda p: p.t).metric(metric)
            gens = [{"generation": s.generation, **group_slope(s.x, s.y, confidence).scaled(100.0).to_dict()}
                    for s in _series(pts, metric, True)]
            if metric == "rss_mb":
                rss_slopes.append(per_h.slope or 0.0)
            procs.append({
                "role": role, "metric": metric, "per_100_requests": per_req.to_dict(), "per_hour": per_h.to_dict(),
                "last_mb": last, "per_generation_per_100_requests": gens,
                "kind": "gpu" if metric == "gpu_mb" else "host",
                "time_to_oom_h": time_to_limit_h(gpu_headroom_mb if metric == "gpu_mb" else headroom, per_h.slope),
            })
    host_slope = sum(rss_slopes)
    tto = time_to_limit_h(headroom, host_slope)
    return {
        "source": source, "confidence": confidence, "warmup_requests": warmup_requests,
        "points": len(points), "host_available_mb_end": headroom,
        "host_rss_slope_mb_per_h": host_slope, "host_time_to_oom_h": None if tto is None or math.isinf(tto) else tto,
        "gpu_headroom_mb_end": gpu_headroom_mb, "gpu_headroom_from": gpu_headroom_from,
        "processes": procs,
        "note": "time_to_oom_h: headroom at the end (host: available memory; GPU: the watchdog's budget or "
                "NVML's free memory) / growth per hour",
    }
