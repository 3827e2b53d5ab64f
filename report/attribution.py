"""Leak attribution: which kind of request makes a process grow, and by how much per request.

A slope per 100 requests says *that* memory grows; an operator fixing it needs *what* makes it
grow: completed requests (a per-request leak in the engine), cancelled ones (state kept after a
client disconnect), errors, prompt or output tokens, streamed requests, or plain time. The
watchdog records, in each tick, the process memory and the runtime's request counters. Within
one generation (a recycle starts fresh processes) the memory change between two consecutive
ticks is regressed on the change of each counter in the same interval, plus the interval's
length in hours (growth that no request explains). Intervals that begin before the generation's
warm-up (`core.leak.warmed_up`, the same rule and setting as the leak slopes) are left out: a
generation's own start (weights, KV cache, CUDA graphs, a recycle's successor that the status
already names while it starts) is not a leak, and would otherwise dwarf one:

    dy_t = sum_k beta_k * dx_k,t + beta_time * dt_t + e_t      (no intercept; all generations)

First differences make the residuals close to independent (allocator steps, sampling noise),
so the ordinary least-squares interval at the report's confidence is honest; cumulative levels
would be a random walk and give intervals far too narrow. A counter that never moves, or that
moves in lockstep with another (collinear), cannot be told apart: it is left out and listed.

The named cause is the feature with the largest share of the growth (beta_k times its total
change) among those whose interval excludes zero; the others show their cost, or 0 when their
interval includes zero. Two rules keep a short or steady run from naming nonsense: a feature
that moved in fewer than MIN_MOVES intervals is never named (one cancelled request is not
evidence), and no cause is named when the one found would explain more than
MAX_EXPLAINED_SHARE times the growth the process showed: that happens when features move
almost together (constant load: completed requests and time), and the fit then trades huge
opposite costs that cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from vllm_guard.core import leak as rule
from vllm_guard.core.samples import StatusBrief, Tick
from vllm_guard.core.timefmt import epoch

from .figures import AttributionFigures, FeatureCost, ProcessAttribution

# feature -> (StatusBrief field, unit shown per "+X MB per <unit>", scale of the counter per unit)
FEATURES: dict[str, tuple[str, str, float]] = {
    "completed": ("completed", "completed request", 1.0),
    "cancelled": ("client_disconnects", "cancelled request", 1.0),
    "errored": ("failed", "errored request", 1.0),
    "prompt_tokens": ("prompt_tokens", "1000 prompt tokens", 1000.0),
    "output_tokens": ("output_tokens", "1000 output tokens", 1000.0),
    "streamed": ("streamed", "streamed request", 1.0),
}
TIME = "time"
KINDS = {"rss_mb": "RSS", "uss_mb": "USS", "gpu_mb": "GPU"}
ROLE_NAMES = {"api_server": "API server", "engine_core": "EngineCore", "worker": "worker", "helper": "helper"}
MIN_INTERVALS = 8
MIN_MOVES = 5  # intervals in which a feature changed before it can be named as a cause
MAX_EXPLAINED_SHARE = 1.5  # a named cause explains at most this times the observed growth


@dataclass(frozen=True)
class Obs:
    """One process's memory and the runtime's counters at one tick."""

    t: float
    generation: int
    pid: int
    mb: float
    counters: dict[str, float]
    requests: int | None = None  # requests its generation had taken (the warm-up's measure)


def _counters(st: StatusBrief) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (field, _, scale) in FEATURES.items():
        v = getattr(st, field, None)
        if v is not None:
            out[name] = float(v) / scale
    return out


def observations(ticks: list[Tick] | None) -> dict[tuple[str, str], list[Obs]]:
    """(role, kind) -> observations in time order, from ticks with procs and status."""
    out: dict[tuple[str, str], list[Obs]] = {}
    for s in ticks or []:
        t = epoch(s.at)
        if t is None or not s.procs or s.status is None:
            continue
        c = _counters(s.status)
        gpu: dict[int, float] = {}
        for g in s.nvml.gpus if s.nvml else []:
            for p in g.processes:
                if p.used_mb is not None:
                    gpu[p.pid] = gpu.get(p.pid, 0.0) + p.used_mb
        for pid_s, m in s.procs.items():
            pid = int(pid_s)
            for kind, mb in (("rss_mb", m.rss_mb), ("uss_mb", m.uss_mb), ("gpu_mb", gpu.get(pid))):
                if mb is not None:
                    out.setdefault((m.role.value, kind), []).append(
                        Obs(t, s.status.generation, pid, mb, c, s.status.requests_generation))
    return out


def _design(obs: list[Obs], warmup: int = rule.WARMUP_REQUESTS
            ) -> tuple[np.ndarray, np.ndarray, list[str], dict[str, float]]:
    """Rows of consecutive-tick differences within one (generation, pid), from a warmed-up tick
    on; the columns are the features that moved, then time in hours. Also the total change of
    each feature."""
    names = [n for n in FEATURES if any(n in o.counters for o in obs)]
    rows: list[list[float]] = []
    ys: list[float] = []
    prev: dict[tuple[int, int], Obs] = {}
    for o in sorted(obs, key=lambda o: o.t):
        key = (o.generation, o.pid)
        p = prev.get(key)
        prev[key] = o
        if p is None or not rule.warmed_up(p.requests, warmup):
            continue
        d = [o.counters.get(n, 0.0) - p.counters.get(n, 0.0) for n in names]
        if any(v < 0 for v in d):
            continue  # the runtime restarted its counters: no interval
        rows.append(d + [(o.t - p.t) / 3600.0])
        ys.append(o.mb - p.mb)
    x = np.array(rows, float).reshape(-1, len(names) + 1)
    cols = names + [TIME]
    totals = {c: float(x[:, i].sum()) for i, c in enumerate(cols)} if len(x) else {}
    return x, np.array(ys, float), cols, totals


def _independent(x: np.ndarray, cols: list[str]) -> tuple[list[int], list[str]]:
    """Columns kept (moved, and not a linear combination of those before), and why others left."""
    keep: list[int] = []
    dropped: list[str] = []
    for i, c in enumerate(cols):
        if not np.any(x[:, i]):
            dropped.append(f"{c}: never changed")
            continue
        trial = x[:, keep + [i]]
        if np.linalg.matrix_rank(trial, tol=1e-9 * max(1.0, float(np.abs(trial).max()))) < len(keep) + 1:
            dropped.append(f"{c}: moves with {', '.join(cols[k] for k in keep)} (collinear)")
            continue
        keep.append(i)
    return keep, dropped


def attribute(obs: list[Obs], confidence: float = 0.90, warmup: int = rule.WARMUP_REQUESTS) -> dict[str, Any]:
    """Per-feature cost (MB per unit) with its interval, and the named cause."""
    x, y, cols, totals = _design(obs, warmup)
    base: dict[str, Any] = {"intervals": int(len(y)), "features": [], "cause": None, "left_out": [],
                            "withheld": None}
    if len(y) < MIN_INTERVALS:
        return {**base, "note": f"{len(y)} tick intervals: too few to attribute (need {MIN_INTERVALS})"}
    keep, dropped = _independent(x, cols)
    base["left_out"] = dropped
    xs = x[:, keep]
    dof = len(y) - len(keep)
    if dof < 2:
        return {**base, "note": "too few intervals for the features that moved"}
    beta, *_ = np.linalg.lstsq(xs, y, rcond=None)
    resid = y - xs @ beta
    s2 = float(resid @ resid) / dof
    cov = s2 * np.linalg.pinv(xs.T @ xs)
    tq = float(stats.t.ppf(0.5 + confidence / 2.0, dof))
    growth = float(y.sum())
    feats: list[dict[str, Any]] = []
    for j, i in enumerate(keep):
        c = cols[i]
        se = math.sqrt(max(float(cov[j, j]), 0.0))
        b = float(beta[j])
        lo, hi = b - tq * se, b + tq * se
        feats.append({"feature": c, "unit": FEATURES[c][1] if c in FEATURES else "hour",
                      "mb_per_unit": b, "low": lo, "high": hi, "significant": lo > 0 or hi < 0,
                      "total_units": totals[c], "explained_mb": b * totals[c],
                      "moves": int(np.count_nonzero(x[:, i]))})
    sig = [f for f in feats if f["significant"] and f["explained_mb"] > 0 and f["moves"] >= MIN_MOVES]
    cause = max(sig, key=lambda f: f["explained_mb"]) if sig else None
    note, withheld = ("" if cause else "no feature explains growth at this confidence"), None
    if cause is not None and cause["explained_mb"] > MAX_EXPLAINED_SHARE * max(growth, 0.0):
        withheld = note = (f"no cause named: {cause['feature']} would explain {cause['explained_mb']:.3g} MB of "
                           f"{growth:.3g} MB of growth (features that move together, e.g. steady load and time)")
        cause = None
    return {**base, "features": feats, "cause": cause["feature"] if cause else None, "growth_mb": growth,
            "note": note, "withheld": withheld}


def _num(v: float) -> str:
    return f"{v:+.3g}" if abs(v) >= 0.001 else f"{v:+.2g}"


def headline(role: str, kind: str, a: dict[str, Any]) -> str:
    """`API server RSS: +0.31 MB per cancelled request [0.28, 0.34]; completed: 0`."""
    who = f"{ROLE_NAMES.get(role, role)} {KINDS.get(kind, kind)}"
    feats = {f["feature"]: f for f in a["features"]}
    if a["cause"] is None:
        return f"{who}: {a['note'] or 'no cause named'}"
    c = feats[a["cause"]]
    parts = [f"{who}: {_num(c['mb_per_unit'])} MB per {c['unit']} [{c['low']:.3g}, {c['high']:.3g}]"]
    for f in a["features"]:
        if f["feature"] == a["cause"]:
            continue
        name = "per hour" if f["feature"] == TIME else f["feature"]
        parts.append(f"{name}: {_num(f['mb_per_unit'])} MB [{f['low']:.3g}, {f['high']:.3g}]" if f["significant"]
                     else f"{name}: 0")
    return "; ".join(parts)


def _typed(role: str, kind: str, a: dict[str, Any], line: str | None) -> ProcessAttribution:
    feats = [FeatureCost(**{k: f[k] for k in FeatureCost.__dataclass_fields__}) for f in a["features"]]
    return ProcessAttribution(role=role, metric=kind, intervals=a["intervals"], growth_mb=a.get("growth_mb"),
                              cause=a["cause"], note=a.get("note", ""), withheld=a.get("withheld"),
                              left_out=list(a["left_out"]), features=feats, line=line)


def attribution_report(ticks: list[Tick] | None, confidence: float = 0.90,
                       min_growth_mb: float = 1.0, warmup: int = rule.WARMUP_REQUESTS) -> AttributionFigures:
    """Every (role, memory kind) with enough ticks; `lines` are the headlines of those that grew
    by at least `min_growth_mb` summed over their intervals."""
    by = observations(ticks)
    if not by:
        return AttributionFigures(False, "no watchdog ticks with both process memory and the runtime's counters",
                                  confidence)
    procs = []
    lines = []
    for (role, kind), obs in sorted(by.items()):
        a = attribute(obs, confidence, warmup)
        line = headline(role, kind, a) if a["cause"] is not None and a.get("growth_mb", 0.0) >= min_growth_mb else None
        procs.append(_typed(role, kind, a, line))
        if line:
            lines.append(line)
    seen = {n for obs in by.values() for o in obs for n in o.counters}
    missing = [n for n in FEATURES if n not in seen]
    return AttributionFigures(True, "", confidence, lines, missing, procs)
