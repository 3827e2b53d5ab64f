"""Matplotlib figures for the HTML report, returned as base64 PNG (no network, no files)."""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from vllm_guard.core.ledger import UNPLANNED  # noqa: E402
from vllm_guard.core.timefmt import epoch  # noqa: E402

from . import memory, thermal  # noqa: E402
from .ledgerread import LedgerData  # noqa: E402

MAX_POINTS = 5000


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _dates(t: np.ndarray) -> np.ndarray:
    return np.array(t, dtype="datetime64[ms]") if t.dtype.kind == "M" else (t * 1000).astype("datetime64[ms]")


def _markers(ax: Any, d: LedgerData) -> None:
    for i, r in enumerate(d.runtime.recycles):
        t = epoch(r.started_at)
        if t is not None:
            ax.axvline(_dates(np.array([t]))[0], color="tab:gray", ls="--", lw=1,
                       label="recycle" if i == 0 else None)
    for i, f in enumerate(x for x in d.runtime.failures if x.cls == UNPLANNED):
        t = epoch(f.at)
        if t is not None:
            ax.axvline(_dates(np.array([t]))[0], color="tab:red", lw=1.5, label="unplanned" if i == 0 else None)


def _finish(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def memory_plot(d: LedgerData) -> str | None:
    pts = memory.points_from_watchdog(d.ticks) or memory.points_from_soak(d.soak_samples)
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for role in sorted({p.role for p in pts}):
        sel = sorted((p for p in pts if p.role == role and p.rss_mb is not None), key=lambda p: p.t)
        if not sel:
            continue
        t = np.array([p.t for p in sel])
        gen = np.array([p.generation if p.generation is not None else -1 for p in sel])
        y = np.array([p.rss_mb for p in sel], float)
        y[1:][np.diff(gen) != 0] = np.nan  # break the line at each recycle
        ax.plot(_dates(t)[: len(y)], y, lw=1.5, label=f"{role} RSS")
    _markers(ax, d)
    _finish(ax, "Memory per process (RSS) with recycles", "MB")
    return _png(fig)


def latency_plot(d: LedgerData) -> str | None:
    r = d.requests
    if not r or not np.isfinite(r["sent_at"]).any():
        return None
    ok = np.array([e is None for e in d.errors])
    idx = np.flatnonzero(ok & np.isfinite(r["ttft_s"]))
    if idx.size > MAX_POINTS:
        idx = idx[np.linspace(0, idx.size - 1, MAX_POINTS).astype(int)]
    fig, ax = plt.subplots(figsize=(10, 4))
    t = _dates(r["sent_at"][idx])
    ax.scatter(t, 1000 * r["ttft_s"][idx], s=4, alpha=0.5, label="TTFT")
    ax.scatter(t, 1000 * r["e2e_sched_s"][idx], s=4, alpha=0.5, label="E2E from scheduled send")
    bad = np.flatnonzero(~ok & np.isfinite(r["sent_at"]))
    if bad.size:
        ax.scatter(_dates(r["sent_at"][bad]), np.full(bad.size, 0.0), marker="x", color="tab:red", label="error")
    _markers(ax, d)
    ax.set_yscale("symlog", linthresh=1.0)
    _finish(ax, "Latency over time", "ms")
    return _png(fig)


def thermal_plot(d: LedgerData) -> str | None:
    per = thermal.gpu_points(d.ticks)
    if not per:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    ax2 = ax.twinx()
    for uuid, pts in per.items():
        t = _dates(np.array([p.t for p in pts]))
        ax.plot(t, [p.temp_c if p.temp_c is not None else np.nan for p in pts], color="tab:red", label=f"temp {uuid[:12]}")
        ax2.plot(t, [p.sm_clock_mhz if p.sm_clock_mhz is not None else np.nan for p in pts], color="tab:blue",
                 label=f"SM clock {uuid[:12]}")
    ax2.set_ylabel("MHz")
    _finish(ax, "Temperature (left, C) and SM clock (right, MHz)", "C")
    return _png(fig)
