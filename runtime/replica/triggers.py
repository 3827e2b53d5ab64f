"""When a serving generation is replaced: pure functions of its readings and `now`.

Nothing here reads a clock, a process or the proxy; the supervisor gathers a `Readings` each
tick and asks `recycle_trigger`. Precedence, first match wins:

1. memory growth since the warm-up baseline (GPU, then host RSS): *preventive* — a leak caught
   is reported as one even when a count limit is reached at the same moment;
2. `max_requests` (+ jitter), then `max_uptime`: *scheduled*;
3. idle for `idle_after` while some limit is at least `idle_fraction` used: *scheduled*,
   opportunistic (the cold start falls in a quiet moment instead of under load).

A generation's backlog — requests that arrived while no generation served (a recycle, a start)
and were dispatched to it when it came up — does not count toward its `max_requests`
(`frontdoor.target.counts_toward_limit`): otherwise a generation that inherits as many queued requests as its
limit reaches the limit the moment it comes up, and the next recycle stalls the rest again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_guard.core.config import RecycleConfig
from vllm_guard.core.ledger import EndClass

from ..frontdoor.target import limit_reached

MAX_REQUESTS = "max_requests"
MAX_UPTIME = "max_uptime"
GPU_MEMORY_GROWTH = "gpu_memory_growth"
GPU_MEMORY_FORECAST = "gpu_memory_forecast"  # a standby parked ready beside a generation whose memory runs out (`decide`)
HOST_RSS_GROWTH = "host_rss_growth"
IDLE_OPPORTUNISTIC = "idle_opportunistic"


@dataclass(frozen=True)
class Growth:
    """Memory of the generation's process tree above its warm-up baseline (MB)."""

    rss_mb: float
    gpu_mb: float | None = None  # None without NVML


@dataclass(frozen=True)
class Readings:
    """What the triggers look at, gathered by the supervisor at one instant."""

    ready_at: float  # monotonic time the generation became ready
    requests: int  # requests that count toward the limit (arrived after ready)
    limit: int | None  # this generation's max_requests + jitter; None: no count limit
    idle_for: float = 0.0  # seconds with nothing in flight or queued (0 while busy)
    growth: Growth | None = None  # None until the warm-up baseline is taken


@dataclass(frozen=True)
class Trigger:
    reason: str
    cls: EndClass


def generation_limit(cfg: RecycleConfig, rng: random.Random | None = None) -> int | None:
    """max_requests + randint(0, jitter) for one generation (gunicorn); None when off."""
    if not cfg.max_requests:
        return None
    jitter = cfg.max_requests_jitter
    return cfg.max_requests + ((rng or random).randint(0, jitter) if jitter else 0)


def recycle_trigger(cfg: RecycleConfig, r: Readings, now: float) -> Trigger | None:
    """The trigger that applies now, or None."""
    g = r.growth
    if g is not None:
        if cfg.max_gpu_memory_growth_mb and g.gpu_mb is not None and g.gpu_mb >= cfg.max_gpu_memory_growth_mb:
            return Trigger(GPU_MEMORY_GROWTH, EndClass.PREVENTIVE)
        if cfg.max_host_rss_growth_mb and g.rss_mb >= cfg.max_host_rss_growth_mb:
            return Trigger(HOST_RSS_GROWTH, EndClass.PREVENTIVE)
    if limit_reached(r.requests, r.limit):
        return Trigger(MAX_REQUESTS, EndClass.SCHEDULED)
    if cfg.max_uptime and now - r.ready_at >= cfg.max_uptime:
        return Trigger(MAX_UPTIME, EndClass.SCHEDULED)
    if cfg.idle_fraction and r.idle_for >= cfg.idle_after and limit_fraction(cfg, r, now) >= cfg.idle_fraction:
        return Trigger(IDLE_OPPORTUNISTIC, EndClass.SCHEDULED)
    return None


def limit_fraction(cfg: RecycleConfig, r: Readings, now: float) -> float:
    """How far the generation is toward its nearest limit (0 .. 1 and beyond)."""
    parts = [0.0]
    if r.limit:
        parts.append(r.requests / r.limit)
    if cfg.max_uptime:
        parts.append(max(0.0, now - r.ready_at) / cfg.max_uptime)
    g = r.growth
    if g is not None:
        if cfg.max_gpu_memory_growth_mb and g.gpu_mb is not None:
            parts.append(g.gpu_mb / cfg.max_gpu_memory_growth_mb)
        if cfg.max_host_rss_growth_mb:
            parts.append(g.rss_mb / cfg.max_host_rss_growth_mb)
    return max(parts)
