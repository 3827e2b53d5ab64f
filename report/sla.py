"""SLA tiers per hour of the run: which tier did each hour meet?

A tier is a P99 latency bound (the field report's tiers: Interactive P99 < 500 ms, Batch P99
< 5 s, Offline: none). Each hour from the first send is judged on its own P99 over *all* its
requests: a failed request did not meet any bound, so it counts as infinitely slow (an hour
with more than 1 % failures meets no bounded tier). The latency is TTFT by default (what a
user of an interactive service waits for; `--sla-latency e2e` judges whole answers).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vllm_guard.core.errors import UsageError
from vllm_guard.core.timefmt import iso_from_epoch

DEFAULT_TIERS: tuple[tuple[str, float | None], ...] = (("interactive", 0.5), ("batch", 5.0), ("offline", None))
LATENCIES = {"ttft": "ttft_s", "e2e": "e2e_s", "ttft_sched": "ttft_sched_s", "e2e_sched": "e2e_sched_s"}
QUANTILE = 99.0


def _seconds(text: str, where: str) -> float | None:
    t = text.strip().lower()
    if t in ("none", "inf", ""):
        return None
    for suffix, k in (("ms", 0.001), ("s", 1.0), ("m", 60.0)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], k
            break
    else:
        scale = 1.0
    try:
        v = float(t) * scale
    except ValueError as e:
        raise UsageError(f"--sla has value {where!r}: {text!r} is not a duration (500ms, 5s, none)") from e
    if not math.isfinite(v) or v <= 0:
        raise UsageError(f"--sla has value {where!r}: {text!r} must be a positive duration")
    return v


def parse_tiers(text: str | None) -> tuple[tuple[str, float | None], ...]:
    """`interactive=500ms,batch=5s,offline=none` -> tiers, strictest first."""
    if not text:
        return DEFAULT_TIERS
    out: list[tuple[str, float | None]] = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--sla has value {text!r}: {item!r} is not NAME=BOUND (e.g. interactive=500ms)")
        out.append((name.strip(), _seconds(value, text)))
    return tuple(sorted(out, key=lambda t: math.inf if t[1] is None else t[1]))


def tier_of(p99: float | None, tiers: tuple[tuple[str, float | None], ...]) -> str | None:
    """The strictest tier whose bound the P99 meets (None: not even the loosest bounded one and
    there is no unbounded tier)."""
    for name, bound in tiers:
        if bound is None or (p99 is not None and p99 < bound):
            return name
    return None


def sla_report(req: dict[str, np.ndarray], errors: list[str | None],
               tiers: tuple[tuple[str, float | None], ...] = DEFAULT_TIERS, latency: str = "ttft") -> dict[str, Any]:
    col = LATENCIES[latency]
    base = {"latency": latency, "quantile": QUANTILE,
            "tiers": [{"name": n, "bound_s": b} for n, b in tiers]}
    if not errors or not np.isfinite(req["sent_at"]).any():
        return {**base, "present": False, "note": "no soak requests: the SLA needs per-request latencies",
                "per_hour": [], "hours": 0, "hours_met": {}, "run_tier": None, "run_p99_s": None}
    sent = req["sent_at"]
    lat = np.where(np.array([e is None for e in errors]), req[col], np.inf)
    lat = np.where(np.isnan(lat), np.inf, lat)  # a success without the figure: not met either
    t0 = float(np.nanmin(sent))
    hour = np.floor((sent - t0) / 3600.0)
    rows: list[dict[str, Any]] = []
    for h in np.unique(hour[np.isfinite(hour)]):
        m = hour == h
        p = float(np.percentile(lat[m], QUANTILE))
        p99 = p if math.isfinite(p) else None
        rows.append({"hour": int(h), "from": iso_from_epoch(t0 + 3600.0 * h), "requests": int(m.sum()),
                     "p99_s": p99, "tier": tier_of(p99, tiers)})
    met = {n: sum(1 for r in rows if r["tier"] is not None and _rank(r["tier"], tiers) <= i)
           for i, (n, _) in enumerate(tiers)}
    allp = float(np.percentile(lat[np.isfinite(sent)], QUANTILE))
    worst = max((_rank(r["tier"], tiers) for r in rows), default=len(tiers))
    return {**base, "present": True, "note": "", "per_hour": rows, "hours": len(rows), "hours_met": met,
            "run_p99_s": allp if math.isfinite(allp) else None,
            "run_tier": tiers[worst][0] if worst < len(tiers) else None}


def _rank(name: str | None, tiers: tuple[tuple[str, float | None], ...]) -> int:
    for i, (n, _) in enumerate(tiers):
        if n == name:
            return i
    return len(tiers)


def headline(s: dict[str, Any]) -> str:
    """`batch in every hour (3 of 3); interactive in 1 of 3 (TTFT P99 < 500 ms)`."""
    if not s["present"]:
        return s["note"]
    n = s["hours"]
    parts = []
    for t in s["tiers"]:
        k = s["hours_met"].get(t["name"], 0)
        bound = "no bound" if t["bound_s"] is None else f"P99 < {_ms(t['bound_s'])}"
        parts.append(f"{t['name']} {k} of {n} h ({bound})")
    lat = {"ttft": "TTFT", "e2e": "E2E"}.get(s["latency"], s["latency"])
    whole = s["run_tier"] or "none"
    return f"{whole} in every hour ({lat}); " + ", ".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:g} s"
