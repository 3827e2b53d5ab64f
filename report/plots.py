"""Matplotlib figures for the HTML report, returned as base64 PNG (no network, no files).

Every plot shares one time axis: the same window (`window(d)`), the same size and margins, so
the four images line up one under the other, with UTC stated on the axis. Memory plots show
each process's readings per generation (the line breaks at a recycle), the Theil-Sen fit of
each generation, recycles (grey dashes) and unplanned failures (red), and where memory runs
out at the end (the headroom line with the forecast time). Latency is on a log axis (positive
values only) with the SLA bounds drawn; thermals name every line in one legend.
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
from scipy.stats import theilslopes  # noqa: E402

from vllm_guard.core import gpu  # noqa: E402
from vllm_guard.core.ledger import UNPLANNED  # noqa: E402
from vllm_guard.core.timefmt import epoch  # noqa: E402

from . import memory, thermal  # noqa: E402
from .ledgerread import LedgerData  # noqa: E402

MAX_POINTS = 5000
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


def memory_plot(d: LedgerData, leak: dict[str, Any], metric: str) -> str | None:
    """One memory kind (`rss_mb` host, `gpu_mb` GPU) per process role, with fits and headroom."""
    pts = memory.points_from_watchdog(d.ticks) or memory.points_from_soak(d.soak_samples)
    pts = [p for p in pts if p.metric(metric) is not None]
    if not pts or not any(p.metric(metric) for p in pts):
        return None
    warm = leak.get("warmup_requests", 0)
    fig, ax = _axes(d)
    for role in sorted({p.role for p in pts}):
        sel = sorted((p for p in pts if p.role == role), key=lambda p: p.t)
        color = ROLE_COLORS.get(role, "tab:brown")
        t = np.array([p.t for p in sel])
        gen = np.array([p.generation if p.generation is not None else -p.pid for p in sel])
        y = np.array([p.metric(metric) for p in sel], float)
        yy = y.copy()
        yy[1:][np.diff(gen) != 0] = np.nan  # break the line at each recycle
        ax.plot(_dates(t), yy, lw=1.2, color=color, label=f"{role}")
        fitted = False
        for g in np.unique(gen):
            m = (gen == g) & np.array([p.requests is None or p.requests >= warm for p in sel])
            if m.sum() < 5 or np.ptp(t[m]) <= 0:
                continue
            res = theilslopes(y[m], t[m])
            ends = np.array([t[m][0], t[m][-1]])
            ax.plot(_dates(ends), res.intercept + res.slope * ends, color="black", lw=1, ls=":",
                    label=None if fitted else f"{role} fit per generation")
            fitted = True
    _headroom(ax, leak, metric)
    _markers(ax, d)
    kind = "GPU memory (NVML, per process)" if metric == "gpu_mb" else "Host memory (RSS, per process)"
    _finish(ax, f"{kind}: readings, fitted growth, recycles", "MB")
    return _png(fig)


def _headroom(ax: Any, leak: dict[str, Any], metric: str) -> None:
    """Where the fastest-growing process runs out: its last reading + the headroom left."""
    procs = [p for p in leak.get("processes", []) if p["metric"] == metric and p["time_to_oom_h"] is not None
             and p["last_mb"] is not None]
    if not procs:
        return
    p = min(procs, key=lambda p: p["time_to_oom_h"])
    head = leak.get("gpu_headroom_mb_end") if metric == "gpu_mb" else leak.get("host_available_mb_end")
    if head is None:
        return
    limit = p["last_mb"] + head
    top = max(ax.get_ylim()[1], p["last_mb"] * 1.05)
    if limit <= top * 1.6:
        ax.axhline(limit, color="tab:red", ls="--", lw=1, label=f"out of memory ({p['role']})")
    h = p["time_to_oom_h"]
    ax.text(0.99, 0.03, f"forecast: {p['role']} out of memory in {h:.3g} h at {p['per_hour']['slope']:+.3g} MB/h",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="tab:red",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})


def latency_plot(d: LedgerData, sla: dict[str, Any]) -> str | None:
    r = d.requests
    if not r or not np.isfinite(r["sent_at"]).any():
        return None
    ok = np.array([e is None for e in d.errors])
    idx = np.flatnonzero(ok & np.isfinite(r["ttft_s"]) & (r["ttft_s"] > 0))
    if idx.size > MAX_POINTS:
        idx = idx[np.linspace(0, idx.size - 1, MAX_POINTS).astype(int)]
    fig, ax = _axes(d)
    t = _dates(r["sent_at"][idx])
    ax.scatter(t, 1000 * r["ttft_s"][idx], s=4, alpha=0.5, color="tab:blue", label="TTFT")
    e2e = r["e2e_sched_s"][idx]
    good = np.isfinite(e2e) & (e2e > 0)
    ax.scatter(t[good], 1000 * e2e[good], s=4, alpha=0.4, color="tab:orange", label="E2E from scheduled send")
    ax.set_yscale("log")
    colors = ("tab:green", "tab:olive", "tab:cyan")
    for i, tier in enumerate(x for x in sla.get("tiers", []) if x["bound_s"] is not None):
        ax.axhline(1000 * tier["bound_s"], color=colors[i % 3], ls="--", lw=1.2,
                   label=f"SLA {tier['name']}: P99 < {1000 * tier['bound_s']:g} ms")
    bad = np.flatnonzero(~ok & np.isfinite(r["sent_at"]))
    if bad.size:
        top = ax.get_ylim()[1]
        ax.scatter(_dates(r["sent_at"][bad]), np.full(bad.size, top * 0.8), marker="x", color="tab:red", s=16,
                   label=f"failed request ({bad.size})")
    _markers(ax, d)
    _finish(ax, "Latency per request (log scale) with SLA bounds", "ms")
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
