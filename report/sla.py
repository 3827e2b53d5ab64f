"""SLA tiers per hour of the run: which tier did each hour meet?

A tier is a P99 latency bound (the field report's tiers: Interactive P99 < 500 ms, Batch P99
< 5 s, Offline: none). Each hour from the first minute is judged on its own P99 over *all* the
requests that ended in it (the runtime's per-minute histograms of every request it served, else
the soak's): a failed request did not meet any bound, so it counts as infinitely slow (an hour
with more than 1 % failures meets no bounded tier). The latency is TTFT by default (what a
user of an interactive service waits for; `--sla-latency e2e` judges whole answers; the
`_sched` variants, from the soak's scheduled send, apply to soak data; the proxy's clock starts
at arrival, which is its schedule).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from vllm_guard.core.errors import UsageError
from vllm_guard.core.timefmt import iso_from_epoch

from .figures import SlaFigures, SlaHour, SlaTier
from .hist import Hist, merged
from .traffic import Block, by_hour

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


def sla_report(blocks: Sequence[Block], source: str | None,
               tiers: tuple[tuple[str, float | None], ...] = DEFAULT_TIERS, latency: str = "ttft") -> SlaFigures:
    """Per hour from the first minute: the P99 of the chosen latency over every request that
    ended in it, a failed one (or one without the figure) counting as infinitely slow."""
    which = "e2e" if latency.startswith("e2e") else "ttft"
    base: dict[str, Any] = dict(source=source, latency=latency, quantile=QUANTILE, tiers=[SlaTier(n, b) for n, b in tiers])
    if not blocks:
        return SlaFigures(present=False, note="no requests recorded: the SLA needs request latencies", **base)
    t0 = min(b.t for b in blocks)
    rows: list[SlaHour] = []
    judged: list[Hist] = []
    for h, sel in by_hour(blocks).items():
        hist = _judged(sel, which)
        judged.append(hist)
        p = hist.quantile(QUANTILE / 100.0)
        p99 = p if p is not None and math.isfinite(p) else None
        rows.append(SlaHour(h, iso_from_epoch(t0 + 3600.0 * h) or "", sum(b.completed + b.failed for b in sel),
                            sum(b.failed for b in sel), p99, tier_of(p99, tiers) if hist.n else None))
    met = {n: sum(1 for r in rows if r.tier is not None and _rank(r.tier, tiers) <= i) for i, (n, _) in enumerate(tiers)}
    allp = merged(judged).quantile(QUANTILE / 100.0)
    worst = max((_rank(r.tier, tiers) for r in rows), default=len(tiers))
    return SlaFigures(present=True, note="", per_hour=rows, hours=len(rows), hours_met=met,
                      run_p99_s=allp if allp is not None and math.isfinite(allp) else None,
                      run_tier=tiers[worst][0] if worst < len(tiers) else None, **base)


def _judged(blocks: Sequence[Block], which: str) -> Hist:
    """The latencies of the requests the service answered or failed; failed and unmeasured as inf."""
    h = merged(getattr(b, which) for b in blocks)
    served = sum(b.completed + b.failed for b in blocks)
    h.inf += max(0, served - h.n)
    return h


def _rank(name: str | None, tiers: tuple[tuple[str, float | None], ...]) -> int:
    for i, (n, _) in enumerate(tiers):
        if n == name:
            return i
    return len(tiers)


def headline(s: SlaFigures) -> str:
    """`batch in every hour (TTFT, runtime); interactive 1 of 3 h (P99 < 500 ms), ...`."""
    if not s.present:
        return s.note
    parts = []
    for t in s.tiers:
        k = s.hours_met.get(t.name, 0)
        bound = "no bound" if t.bound_s is None else f"P99 < {_ms(t.bound_s)}"
        parts.append(f"{t.name} {k} of {s.hours} h ({bound})")
    lat = {"ttft": "TTFT", "e2e": "E2E"}.get(s.latency, s.latency)
    return f"{s.run_tier or 'none'} in every hour ({lat}, {s.source} requests); " + ", ".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:g} s"
