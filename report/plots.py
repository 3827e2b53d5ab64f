"""Matplotlib figures for the HTML report, returned as base64 PNG (no network, no files).

Every plot shares one time axis: the same window (`window(d)`), the same size and margins, so
the images line up one under the other, with UTC stated on the axis. Memory plots show each
process's readings per generation (the line breaks at a recycle), the Theil-Sen fit of each
generation after the warm-up, recycles (grey dashes) and unplanned failures (red), and where
memory runs out at the end for a leak shown (the headroom line with the forecast time). Latency
is per minute (p50 and p99 of TTFT and E2E, from the runtime's histograms or the soak's
requests) on a log axis with the SLA bounds drawn; throughput is requests and output tokens per
second per minute; thermals name every line in one legend.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from vllm_guard.core import gpu  # noqa: E402
from vllm_guard.core.ledger import UNPLANNED  # noqa: E402
from vllm_guard.core.stats import theil_sen  # noqa: E402
from vllm_guard.core.timefmt import epoch  # noqa: E402

from . import memory, thermal, traffic  # noqa: E402
from .figures import LeakFigures, SlaFigures  # noqa: E402
from .hist import each_quantile  # noqa: E402
from .ledgerread import LedgerData  # noqa: E402

UTC = dt.timezone.utc
SIZE = (11, 4.0)
MARGINS = {"left": 0.08, "right": 0.92, "top": 0.9, "bottom": 0.3}
ROLE_COLORS = {"api_server": "tab:blue", "engine_core": "tab:orange", "worker": "tab:green", "helper": "tab:purple"}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)  # no tight bbox: equal margins keep the time axes aligned
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _dates(t: np.ndarray) -> np.ndarray:
    return (np.asarray(t, float) * 1000).astype("datetime64[ms]")


def window(d: LedgerData) -> tuple[float, float] | None:
    """The run's time window: every generation, tick and soak request of the ledger."""
    ts: list[float] = []
    for g in d.runtime.generations:
        ts += [x for x in (epoch(g.started_at), epoch(g.ended_at)) if x is not None]
    for s in d.ticks or []:
        x = epoch(s.at)
        if x is not None:
            ts.append(x)
    for col in ("sent_at", "ended_at"):
        v = d.requests.get(col)
        if v is not None and np.isfinite(v).any():
            ts += [float(np.nanmin(v)), float(np.nanmax(v))]
    if d.edge_minutes:
        ts += [float(d.edge_minutes[0].minute), float(max(m.minute for m in d.edge_minutes) + 60)]
    if d.process_memory:
        ts += [d.process_memory[0].at, d.process_memory[-1].at]
    if not ts:
        return None
    lo, hi = min(ts), max(ts)
    pad = max(1.0, 0.01 * (hi - lo))
    return lo - pad, hi + pad


def _axes(d: LedgerData) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=SIZE)
    fig.subplots_adjust(**MARGINS)
    w = window(d)
    if w is not None:
        ax.set_xlim(_dates(np.array(w))[0], _dates(np.array(w))[1])
    return fig, ax


def _markers(ax: Any, d: LedgerData) -> None:
    for i, r in enumerate(d.runtime.recycles):
        t = epoch(r.started_at)
        if t is not None:
            ax.axvline(_dates(np.array([t]))[0], color="tab:gray", ls="--", lw=1,
                       label="recycle (planned)" if i == 0 else None)
    for i, f in enumerate(x for x in d.runtime.failures if x.cls == UNPLANNED):
        t = epoch(f.at)
        if t is not None:
            ax.axvline(_dates(np.array([t]))[0], color="tab:red", lw=1.5, label="unplanned failure" if i == 0 else None)


def _finish(ax: Any, title: str, ylabel: str, extra: list[Any] | None = None) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("time (UTC)")
    loc = mdates.AutoDateLocator(tz=UTC)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=UTC))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    for other in extra or []:
        h2, l2 = other.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4,
                  frameon=False)


def memory_plot(d: LedgerData, leak: LeakFigures, metric: str) -> str | None:
    """One memory kind (`rss_mb` host, `gpu_mb` GPU) per process role, with fits and headroom."""
    pts, _ = memory.points_of(d)
    pts = [p for p in pts if p.metric(metric) is not None]
    if not pts or not any(p.metric(metric) for p in pts):
        return None
    fig, ax = _axes(d)
    for role in sorted({p.role for p in pts}):
        sel = sorted((p for p in pts if p.role == role), key=lambda p: p.t)
        color = ROLE_COLORS.get(role, "tab:brown")
        for k, (key, group) in enumerate(_by_generation(sel).items()):
            t = np.array([p.t for p in group])
            y = np.array([p.metric(metric) for p in group], float)
            ax.plot(_dates(t), y, lw=1.2, color=color, label=role if k == 0 else None)
        fitted = False
        for key, s in memory.series(sel, metric, leak.warmup_requests).items():
            if len(s.t) < 5 or np.ptp(np.asarray(s.t)) <= 0:
                continue
            fit = theil_sen(s.t, s.y)
            if fit is None:
                continue
            t = np.asarray(s.t, float)
            icept = float(np.median(np.asarray(s.y, float) - fit.slope * t))
            ends = np.array([t[0], t[-1]])
            ax.plot(_dates(ends), icept + fit.slope * ends, color="black", lw=1, ls=":",
                    label=None if fitted else f"{role} fit per generation (after warm-up)")
            fitted = True
    _headroom(ax, leak, metric)
    _markers(ax, d)
    kind = "GPU memory (NVML, per process)" if metric == "gpu_mb" else "Host memory (RSS, per process)"
    _finish(ax, f"{kind}: readings, fitted growth, recycles", "MB")
    return _png(fig)


def _by_generation(sel: list[memory.MemPoint]) -> dict[tuple[int, int | None, int], list[memory.MemPoint]]:
    """One line per process of a generation (the line breaks at a recycle)."""
    out: dict[tuple[int, int | None, int], list[memory.MemPoint]] = {}
    for p in sel:
        out.setdefault((p.replica, p.generation, p.pid), []).append(p)
    return out


def _headroom(ax: Any, leak: LeakFigures, metric: str) -> None:
    """Where the fastest leak runs out: its last reading + the headroom left (leaks shown only)."""
    procs = [p for p in leak.processes if p.metric == metric and p.replica is None and p.time_to_oom_h is not None
             and p.last_mb is not None and p.headroom_mb is not None]
    if not procs:
        return
    p = min(procs, key=lambda p: p.time_to_oom_h or 0.0)
    assert p.last_mb is not None and p.headroom_mb is not None and p.time_to_oom_h is not None
    limit = p.last_mb + p.headroom_mb
    top = max(ax.get_ylim()[1], p.last_mb * 1.05)
    if limit <= top * 1.6:
        ax.axhline(limit, color="tab:red", ls="--", lw=1, label=f"out of memory ({p.role})")
    slope = p.per_hour.slope if p.per_hour is not None else 0.0
    ax.text(0.99, 0.03, f"forecast: {p.role} out of memory in {p.time_to_oom_h:.3g} h at {slope:+.3g} MB/h",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="tab:red",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})


def latency_plot(d: LedgerData, sla: SlaFigures, latency: str = "ttft") -> str | None:
    """Per minute: TTFT and E2E p50 and p99 (log scale), the SLA bounds, minutes with failures."""
    blocks, source = traffic.blocks_of(d, latency)
    box = traffic.per_minute(blocks)
    if not box:
        return None
    fig, ax = _axes(d)
    t = _dates(np.array([b.t + 30.0 for b in box]))
    for which, name, color in (("ttft", "TTFT", "tab:blue"), ("e2e", "E2E", "tab:orange")):
        for q, ls, lw in ((0.5, "-", 1.0), (0.99, "-", 2.0)):
            v = each_quantile([getattr(b, which) for b in box], q)
            y = np.where(np.isfinite(v), 1000 * v, np.nan)
            if np.isfinite(y).any():
                ax.plot(t, y, ls=ls, lw=lw, color=color, alpha=0.6 if q == 0.5 else 1.0,
                        marker="." if len(box) < 30 else None, label=f"{name} p{round(q * 100)} per minute")
    if ax.get_lines():
        ax.set_yscale("log")
    colors = ("tab:green", "tab:olive", "tab:cyan")
    for i, tier in enumerate(x for x in sla.tiers if x.bound_s is not None):
        ax.axhline(1000 * tier.bound_s, color=colors[i % 3], ls="--", lw=1.2,  # type: ignore[operator]
                   label=f"SLA {tier.name}: P99 < {1000 * tier.bound_s:g} ms")  # type: ignore[operator]
    bad = [b for b in box if b.failed]
    if bad:
        top = ax.get_ylim()[1]
        ax.scatter(_dates(np.array([b.t + 30.0 for b in bad])), np.full(len(bad), top * 0.8), marker="x",
                   color="tab:red", s=16, label=f"minutes with failed requests ({sum(b.failed for b in bad)})")
    _markers(ax, d)
    _finish(ax, f"Latency per minute ({source} requests, log scale) with SLA bounds", "ms")
    return _png(fig)


def throughput_plot(d: LedgerData) -> str | None:
    """Per minute: requests/s (left) and output tokens/s (right) of what was served."""
    blocks, source = traffic.blocks_of(d)
    box = traffic.per_minute(blocks)
    if not box:
        return None
    fig, ax = _axes(d)
    t = _dates(np.array([b.t + 30.0 for b in box]))
    ax.plot(t, [b.requests / 60.0 for b in box], color="tab:blue", lw=1.5, marker="." if len(box) < 30 else None,
            label="requests/s")
    ax.plot(t, [b.failed / 60.0 for b in box], color="tab:red", lw=1, label="failed/s")
    ax2 = ax.twinx()
    if any(b.usage_known for b in box):
        ax2.plot(t, [b.output_tokens / 60.0 for b in box], color="tab:green", lw=1.2, label="output tokens/s")
    ax2.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    _markers(ax, d)
    _finish(ax, f"Throughput per minute ({source} requests)", "requests/s", extra=[ax2])
    return _png(fig)


def thermal_plot(d: LedgerData) -> str | None:
    per = thermal.gpu_points(d.ticks)
    if not per:
        return None
    fig, ax = _axes(d)
    ax2 = ax.twinx()
    for uuid, pts in per.items():
        t = _dates(np.array([p.t for p in pts]))
        name = f"{pts[0].name} {uuid[:10]}" if len(per) > 1 else pts[0].name
        ax.plot(t, [p.temp_c if p.temp_c is not None else np.nan for p in pts], color="tab:red",
                label=f"temperature, {name}")
        ax2.plot(t, [p.sm_clock_mhz if p.sm_clock_mhz is not None else np.nan for p in pts], color="tab:blue",
                 lw=1, label=f"SM clock, {name}")
        hot = [p.t for p in pts if gpu.throttled(p.reasons)]
        if hot:
            ax.scatter(_dates(np.array(hot)), np.full(len(hot), ax.get_ylim()[0]), marker="|", color="black",
                       label="throttled (heat / HW)")
    ax2.set_ylabel("SM clock, MHz")
    _markers(ax, d)
    _finish(ax, "GPU temperature (left, °C) and SM clock (right, MHz)", "°C", extra=[ax2])
    return _png(fig)
