"""Leak figures per process and memory kind: the runtime's own readings (preferred: every
replica and generation at `memory_interval`), else the watchdog's samples, else the soak's.

Each process role's points are fitted within each generation (a recycle starts fresh
processes) and judged by the project's one leak rule (`core.leak.judge`: the slope's interval
clears the noise floor over the whole window and each half of it); a time to out-of-memory is
given only for a leak shown, else the verdict says "no leak shown yet" with the evidence.
Points before the warm-up (`core.leak.warmed_up`; the runtime's own setting when its ledger
says it) are left out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from vllm_guard.core import leak as rule
from vllm_guard.core.gpu import capped_total_mb
from vllm_guard.core.samples import Tick
from vllm_guard.core.stats import theil_sen
from vllm_guard.core.timefmt import epoch

from .figures import GenerationSlope, LeakFigures, ProcessLeak
from .ledgerread import LedgerData, ProcessMemoryRow, SoakSample

METRICS = ("rss_mb", "uss_mb", "swap_mb", "gpu_mb")
KIND = {"rss_mb": "host RSS", "uss_mb": "host USS", "swap_mb": "swap", "gpu_mb": "GPU"}
ROLE = {"api_server": "API server", "engine_core": "EngineCore", "worker": "worker", "helper": "helper"}


@dataclass(frozen=True)
class MemPoint:
    """One process's memory at one time, from any source."""

    t: float  # epoch seconds
    replica: int
    generation: int | None
    role: str
    pid: int
    requests: int | None  # requests its generation had taken
    rss_mb: float | None
    uss_mb: float | None
    swap_mb: float | None
    gpu_mb: float | None
    host_available_mb: float | None
    gpu_free_mb: float | None = None

    def metric(self, name: str) -> float | None:
        v: float | None = getattr(self, name)
        return v


def points_from_runtime(rows: list[ProcessMemoryRow]) -> list[MemPoint]:
    return [MemPoint(r.at, r.replica, r.generation, r.role, r.pid, r.requests, r.rss_mb, r.uss_mb, r.swap_mb,
                     r.gpu_mb, r.host_available_mb, r.gpu_free_mb) for r in rows]


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
            out.append(MemPoint(t, 0, gen, m.role.value, int(pid), req, m.rss_mb, m.uss_mb, m.swap_mb,
                                gpu_by_pid.get(int(pid)), avail))
    return out


def points_from_soak(rows: list[SoakSample]) -> list[MemPoint]:
    out = []
    for r in rows:
        t = epoch(r.at)
        if t is not None:
            out.append(MemPoint(t, 0, r.generation, r.role or "?", r.pid, r.requests_generation, r.rss_mb, r.uss_mb,
                                None, r.gpu_mb, r.host_available_mb))
    return out


def points_of(d: LedgerData) -> tuple[list[MemPoint], str | None]:
    """The best source this ledger has: the runtime's readings, the watchdog's, the soak's."""
    for pts, src in ((points_from_runtime(d.process_memory), "runtime"), (points_from_watchdog(d.ticks), "watchdog"),
                     (points_from_soak(d.soak_samples), "soak")):
        if pts:
            return pts, src
    return [], None


def warmup_of(d: LedgerData) -> tuple[int, str]:
    w = d.runtime_meta.memory_warmup_requests
    if w is not None:
        return w, "the runtime's [recycle] memory_warmup_requests, from its ledger"
    return rule.WARMUP_REQUESTS, "the default warm-up (core.leak)"


def series(points: list[MemPoint], metric: str, warmup: int) -> dict[Any, rule.Series]:
    """One series per generation (per pid without one), warmed-up points only, in time order."""
    cols: dict[Any, tuple[list[float], list[float], list[float]]] = defaultdict(lambda: ([], [], []))
    for p in sorted(points, key=lambda p: p.t):
        y = p.metric(metric)
        if y is None or p.requests is None or not rule.warmed_up(p.requests, warmup):
            continue
        key: Any = (p.replica, p.generation) if p.generation is not None else ("pid", p.pid)
        t, x, ys = cols[key]
        t.append(p.t)
        x.append(float(p.requests))
        ys.append(float(y))
    return {k: rule.Series(*v) for k, v in cols.items()}


def gpu_headroom(ticks: list[Tick] | None, budget_mb: float | None, points: list[MemPoint], cap_mb: float = 0.0
                 ) -> tuple[float | None, str]:
    """GPU MB left at the end, by the watchdog's rule: its GPU budget (meta) minus what the
    service's processes hold, else the least free memory of the GPUs (NVML total, capped at an
    injected budget `cap_mb` by core.gpu's rule, - used), from the watchdog's last NVML tick, else
    from the runtime's last reading (capped by the runtime already)."""
    last = next((s for s in reversed(ticks or []) if s.nvml is not None and s.nvml.gpus), None)
    if last is not None and last.nvml is not None:
        gpus = last.nvml.gpus
        if budget_mb:
            ours = {int(p) for p in (last.procs or {})}
            used = sum(p.used_mb or 0.0 for g in gpus for p in g.processes if not ours or p.pid in ours)
            return budget_mb - used, f"the watchdog's GPU budget {budget_mb:g} MB minus the service's {used:g} MB"
        sizes = [(capped_total_mb(g.mem_total_mb, cap_mb), g.mem_used_mb)
                 for g in gpus if g.mem_total_mb is not None and g.mem_used_mb is not None]
        if sizes:
            left, total = min((total - used, total) for total, used in sizes)
            of = f"an injected {total:g} MB budget" if cap_mb > 0 and total == cap_mb else f"{total:g} MB"
            return left, f"NVML free memory ({left:g} of {of})"
    own = [p for p in points if p.gpu_free_mb is not None]
    if own:
        p = max(own, key=lambda p: p.t)
        return p.gpu_free_mb, f"NVML free memory at the runtime's last reading ({p.gpu_free_mb:g} MB)"
    return None, "no GPU memory readings (NVML)"


def _line(role: str, metric: str, v: rule.LeakVerdict, tto: float | None, headroom_from: str) -> str:
    name = f"{ROLE.get(role, role)} {KIND[metric]}"
    if not v.shown or v.per_100 is None:
        return f"{name}: {v.why_not()}"
    s, h = v.per_100, v.per_hour
    per_h = f", {h.slope:+.4g} MB/h" if h is not None else ""
    oom = (f"out of memory in {hours(tto)} ({headroom_from})" if tto is not None
           else "no time to out of memory (not growing in time)" if h is not None and h.slope <= 0
           else f"no time to out of memory (headroom unknown: {headroom_from})")
    return (f"{name}: leaks {s.slope:+.3g} MB/100 requests [{s.low:.3g}, {s.high:.3g}]{per_h}; {oom}")


def hours(v: float) -> str:
    if v < 1:
        return f"{v * 60:.3g} min"
    if v > 72:
        return f"{v / 24:.3g} days"
    return f"{v:.3g} h"


def process_leaks(points: list[MemPoint], replica: int | None, warmup: int, host_headroom: float | None,
                  gpu_head: tuple[float | None, str]) -> list[ProcessLeak]:
    out: list[ProcessLeak] = []
    by_role: dict[str, list[MemPoint]] = defaultdict(list)
    for p in points:
        if replica is None or p.replica == replica:
            by_role[p.role or "?"].append(p)
    for role in sorted(by_role):
        pts = by_role[role]
        for metric in METRICS:
            if not any(p.metric(metric) for p in pts):
                continue
            ser = series(pts, metric, warmup)
            v = rule.judge(list(ser.values()))
            head, head_from = ((gpu_head[0], gpu_head[1]) if metric == "gpu_mb"
                               else (host_headroom, "host available memory"))
            tto = v.time_to_oom_h(head)
            gens = []
            for key, s in ser.items():
                g = theil_sen(s.x, s.y, rule.CONFIDENCE)
                gens.append(GenerationSlope(key[1] if isinstance(key[1], int) and key[0] != "pid" else -1,
                                            g.scaled(100.0) if g is not None else None))
            last = max(pts, key=lambda p: p.t).metric(metric)
            out.append(ProcessLeak(
                role=role, metric=metric, kind="gpu" if metric == "gpu_mb" else "host", replica=replica,
                leak=v.shown, verdict=_line(role, metric, v, tto, head_from), per_100_requests=v.per_100,
                halves_per_100_requests=v.halves, per_hour=v.per_hour, points=v.points, requests=v.requests,
                generations=v.generations, last_mb=last, headroom_mb=head, time_to_oom_h=tto, per_generation=gens))
    return out


def leak_report(d: LedgerData, replicas: list[int]) -> LeakFigures:
    points, source = points_of(d)
    warmup, warmup_from = warmup_of(d)
    if not points:
        return LeakFigures(False, "no memory readings in this ledger (the runtime records them every "
                           "[recycle] memory_interval; older ledgers: run the watchdog)", warmup_requests=warmup,
                           warmup_from=warmup_from)
    avail = [p.host_available_mb for p in sorted(points, key=lambda p: p.t) if p.host_available_mb]
    host = avail[-1] if avail else None
    gpu_head = gpu_headroom(d.ticks, d.watchdog_meta.gpu_budget_mb, points, d.watchdog_meta.gpu_cap_mb)
    procs = process_leaks(points, None, warmup, host, gpu_head)
    if len(replicas) > 1:
        for r in replicas:
            procs += process_leaks(points, r, warmup, host, gpu_head)
    return LeakFigures(
        present=True, note="time to out of memory: headroom at the end (host: available memory; GPU: the watchdog's "
        "budget or NVML's free memory) / growth per hour, only for a leak shown", source=source,
        confidence=rule.CONFIDENCE, warmup_requests=warmup, warmup_from=warmup_from,
        noise_floor_mb_per_100=rule.NOISE_FLOOR_MB_PER_100, points=len(points), host_available_mb_end=host,
        gpu_headroom_mb_end=gpu_head[0], gpu_headroom_from=gpu_head[1], processes=procs)
