"""`vllm-guard report`: one figures dict from a ledger, rendered as text, JSON or HTML.

The JSON is the figures dict itself (keys documented in docs/REPORTS.md, `schema` versioned);
text and HTML are views of it, so the three never disagree. The `service` section is
`core.reliability.service_figures(...).to_dict()`: the one MTBF, as the exporter and
`vllm-guard status` show it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.core.reliability import ServiceFigures, service_figures
from vllm_guard.core.timefmt import utcnow

from . import attribution, cost, ledgerread, memory, sla, summary, thermal
from .latency import latency_report

SCHEMA = "vllm-guard-report/1"
COMPARE_SCHEMA = "vllm-guard-compare/1"


@dataclass(frozen=True)
class Options:
    """What the operator chose beyond the ledger: confidence, SLA tiers, prices."""

    confidence: float = 0.90
    tiers: tuple[tuple[str, float | None], ...] = sla.DEFAULT_TIERS
    sla_latency: str = "ttft"
    prices: cost.Prices | None = None


def _patch_states(d: ledgerread.LedgerData) -> dict[str, Any] | None:
    """Patch states per generation from the soak's status records (the runtime keeps none)."""
    out: dict[str, Any] = {}
    for s in d.soak_status:
        if s.patches:
            out[str(s.generation)] = {pid: r.model_dump(mode="json") for pid, r in s.patches.items()}
    return out or None


def ledger_label(svc: ServiceFigures, meta: ledgerread.WatchdogMeta) -> str:
    """GPU name(s), then the watchdog's profile and memory budget when it recorded them: two
    budgets emulated on one GPU (or two cards of one model) stay apart in `--compare`."""
    names = svc.gpu_names or list(meta.gpu_names)
    parts = [" / ".join(names) if names else ("no GPU" if svc.present else "no runtime data")]
    if meta.gpu_profile:
        parts.append(f"profile {meta.gpu_profile}")
    if meta.gpu_budget_mb:
        parts.append(f"{meta.gpu_budget_mb / 1024:g} GiB budget")
    return " · ".join(parts)


def _samples_section(d: ledgerread.LedgerData) -> dict[str, Any]:
    p = d.tick_problems
    if d.ticks is None:
        note = "no watchdog samples (table absent)"
    elif p.bad:
        note = (f"{p.bad} of {p.rows} watchdog sample ticks do not match the sample schema and were not used "
                f"(a watchdog of another version?); first: {p.first}")
    elif d.meta_problems.bad:
        note = f"watchdog meta rows that do not match and were not used: {d.meta_problems.first}"
    elif not d.ticks:
        note = "no watchdog samples (table empty)"
    else:
        note = ""
    return {"present": bool(d.ticks), "count": len(d.ticks or []), "invalid": p.bad,
            "first_error": p.first or None, "note": note}


def build(d: ledgerread.LedgerData, opts: Options | None = None, now: float | None = None) -> dict[str, Any]:
    opts = opts or Options()
    confidence = opts.confidence
    now = time.time() if now is None else now
    svc = service_figures(d.runtime, now, confidence)
    wd = memory.points_from_watchdog(d.ticks)
    pts, src = (wd, "watchdog") if wd else (memory.points_from_soak(d.soak_samples), "soak")
    headroom, headroom_from = memory.gpu_headroom(d.ticks, d.watchdog_meta.gpu_budget_mb)
    leak = memory.leak_report(pts, src if pts else None, confidence, gpu_headroom_mb=headroom,
                              gpu_headroom_from=headroom_from)
    if d.incidents is None:
        incidents: dict[str, Any] = {"present": False, "note": "no incidents table (watchdog not installed here)", "list": []}
    else:
        incidents = {"present": bool(d.incidents), "note": "" if d.incidents else "incidents table empty",
                     "list": [{"kind": i.kind, "cause": i.cause, "class": i.cls, "detected_at": i.detected_at,
                               "action": i.action, "restored_at": i.restored_at} for i in d.incidents]}
    ends = d.requests.get("ended_at", np.array([]))
    sp = d.status_problems
    label = ledger_label(svc, d.watchdog_meta)
    service = svc.to_dict()
    lat = latency_report(d.requests, d.errors, d.runs, svc.requests_served)
    f: dict[str, Any] = {
        "schema": SCHEMA, "generated_at": utcnow(), "ledger": d.path, "label": label,
        "profile": {"gpu_profile": d.watchdog_meta.gpu_profile, "gpu_budget_mb": d.watchdog_meta.gpu_budget_mb},
        "service": service,
        "incidents": incidents, "leak": leak,
        "attribution": attribution.attribution_report(d.ticks, confidence),
        "watchdog_samples": _samples_section(d),
        "soak_status": {"count": len(d.soak_status), "invalid": sp.bad, "first_error": sp.first or None},
        "thermal": thermal.thermal_report(d.ticks, ends[np.isfinite(ends)]),
        "latency": lat,
        "sla": sla.sla_report(d.requests, d.errors, opts.tiers, opts.sla_latency),
        "cost": cost.cost_report(d.ticks, lat, d.requests, service, label, opts.prices),
        "patches": _patch_states(d),
        "empty": not (svc.present or d.ticks or d.errors or d.soak_samples),
    }
    f["summary"] = summary.summary(_clean(f))
    return f


def _clean(o: Any) -> Any:
    """JSON-safe: NaN/inf -> null, numpy scalars -> Python."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def figures(db: str | Path, opts: Options | None = None, run_id: int | None = None
            ) -> tuple[dict[str, Any], ledgerread.LedgerData]:
    d = ledgerread.load(db, run_id)
    f = _clean(build(d, opts))
    if f["empty"]:
        raise ledgerread.LedgerError(f"{d.path}: the ledger is empty (no generations, watchdog samples or soak "
                                     "requests): nothing to report yet")
    return f, d


def render(db: str | Path, fmt: str, opts: Options | None = None, run_id: int | None = None) -> str:
    f, d = figures(db, opts, run_id)
    if fmt == "json":
        return json.dumps(f, indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_html

        return render_html(f, d)
    from .text import render_text

    return render_text(f)


def render_compare(paths: list[str], fmt: str, opts: Options | None = None) -> str:
    from .compare import verdict_lines
    from .text import compare_rows

    opts = opts or Options()
    (fa, da), (fb, db_) = figures(paths[0], opts), figures(paths[1], opts)
    rows = compare_rows(fa, fb)
    verdict = verdict_lines(fa, da, fb, db_, opts.confidence)
    if fmt == "json":
        out = {"schema": COMPARE_SCHEMA, "a": fa, "b": fb, "verdict": verdict,
               "rows": [{"figure": k, "a": a, "b": b} for k, a, b in rows]}
        return json.dumps(_clean(out), indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_compare_html

        return render_compare_html(fa, da, fb, db_, rows, verdict)
    from .text import render_compare_text

    return render_compare_text(fa, fb, rows, verdict)
