"""Leak figures: memory points from the watchdog's samples (preferred) or the soak's own.

Points are grouped per process role and fitted within each generation (see leak.py): MB per
100 requests (x = requests served by that generation) and MB per hour (x = time since the
generation's first point). Points before `warmup_requests` are dropped: allocator pools,
caches and compiled graphs settle there, which is growth but not a leak.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from vllm_guard.runtime.ledger import parse_iso

from .leak import Series, group_slope, stratified_slope, time_to_limit_h

METRICS = ("rss_mb", "uss_mb", "gpu_mb")


def _epoch(v: Any) -> float | None:
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v:
        try:
            return parse_iso(v).timestamp()
        except ValueError:
            return None
    return None


def _find_per_process(obj: Any, depth: int = 0) -> dict[str, dict[str, Any]] | None:
    """The first {pid: {"rss_mb": ...}} mapping inside a watchdog sample, wherever it sits."""
    if not isinstance(obj, dict) or depth > 4:
        return None
    vals = list(obj.values())
    if vals and all(isinstance(v, dict) and "rss_mb" in v for v in vals) and all(str(k).isdigit() for k in obj):
        return obj
    for v in vals:
        found = _find_per_process(v, depth + 1)
        if found:
            return found
    return None


def _dig(obj: dict[str, Any], *paths: tuple[str, ...]) -> Any:
    for path in paths:
        cur: Any = obj
        for k in path:
            cur = cur.get(k) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def points_from_watchdog(samples: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in samples or []:
        per = _find_per_process(s)
        if not per:
            continue
        t = _epoch(_dig(s, ("at",), ("at_s",), ("memory", "current", "at")))
        gen = _dig(s, ("generation",), ("status", "generation"))
        req = _dig(s, ("requests_generation",), ("memory", "current", "requests"),
                   ("status", "memory", "current", "requests"), ("status", "requests_generation"))
        gpu_by_pid = {}
        nv = s.get("nvml") if isinstance(s.get("nvml"), dict) else s
        for g in nv.get("gpus") or []:
            for p in (g.get("processes") or []) if isinstance(g, dict) else []:
                if isinstance(p, dict) and p.get("used_mb") is not None:
                    gpu_by_pid[str(p.get("pid"))] = float(p["used_mb"])
        avail = _dig(s, ("mem_available_mb",), ("host", "mem_available_mb"), ("host_available_mb",))
        for pid, m in per.items():
            out.append({"t": t, "generation": gen, "role": m.get("role", "?"), "pid": int(pid),
                        "requests": req, "rss_mb": m.get("rss_mb"), "uss_mb": m.get("uss_mb"),
                        "gpu_mb": m.get("gpu_mb", gpu_by_pid.get(str(pid))), "host_available_mb": avail})
    return [p for p in out if p["t"] is not None]


def points_from_soak(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": _epoch(r["at"]), "generation": r["generation"], "role": r["role"], "pid": r["pid"],
             "requests": r["requests_generation"], "rss_mb": r["rss_mb"], "uss_mb": r["uss_mb"],
             "gpu_mb": r["gpu_mb"], "host_available_mb": r["host_available_mb"]} for r in rows if r.get("at")]


def _series(points: list[dict[str, Any]], metric: str, by_requests: bool) -> list[Series]:
    groups: dict[Any, Series] = {}
    t0: dict[Any, float] = {}
    for p in sorted(points, key=lambda p: p["t"]):
        y = p.get(metric)
        if y is None:
            continue
        key = p["generation"] if p["generation"] is not None else f"pid{p['pid']}"
        t0.setdefault(key, p["t"])
        x = p["requests"] if by_requests else (p["t"] - t0[key]) / 3600.0
        if x is None:
            continue
        groups.setdefault(key, Series(key if isinstance(key, int) else -1)).x.append(float(x))
        groups[key].y.append(float(y))
    return list(groups.values())


def leak_report(points: list[dict[str, Any]], source: str | None, confidence: float = 0.90,
                warmup_requests: int = 20) -> dict[str, Any]:
    if not points:
        return {"source": None, "processes": [], "note": "no memory samples: run the watchdog, or give the soak "
                "--state-dir so it records the guard's memory readings"}
    kept = [p for p in points if p["requests"] is None or p["requests"] >= warmup_requests]
    by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in kept:
        by_role[p["role"] or "?"].append(p)
    avail = [p["host_available_mb"] for p in sorted(points, key=lambda p: p["t"]) if p.get("host_available_mb")]
    headroom = avail[-1] if avail else None
    procs = []
    for role in sorted(by_role):
        pts = by_role[role]
        for metric in METRICS:
            if not any(p.get(metric) for p in pts):
                continue
            per_req = stratified_slope(_series(pts, metric, True), confidence).scaled(100.0)
            per_h = stratified_slope(_series(pts, metric, False), confidence)
            last = max(pts, key=lambda p: p["t"]).get(metric)
            gens = [{"generation": s.generation, **group_slope(s.x, s.y, confidence).scaled(100.0).to_dict()}
                    for s in _series(pts, metric, True)]
            procs.append({
                "role": role, "metric": metric, "per_100_requests": per_req.to_dict(), "per_hour": per_h.to_dict(),
                "last_mb": last, "per_generation_per_100_requests": gens,
                "time_to_oom_h": time_to_limit_h(headroom, per_h.slope) if metric != "gpu_mb" else None,
            })
    host_slope = sum(p["per_hour"]["slope"] or 0.0 for p in procs if p["metric"] == "rss_mb")
    tto = time_to_limit_h(headroom, host_slope)
    return {
        "source": source, "confidence": confidence, "warmup_requests": warmup_requests,
        "points": len(points), "host_available_mb_end": headroom,
        "host_rss_slope_mb_per_h": host_slope, "host_time_to_oom_h": None if tto is None or math.isinf(tto) else tto,
        "processes": procs,
        "note": "time_to_oom_h: host headroom at the end / growth per hour (GPU headroom needs the watchdog)",
    }
