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
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.core.reliability import ServiceFigures, service_figures
from vllm_guard.core.timefmt import utcnow

from . import ledgerread, memory, thermal
from .latency import latency_report

SCHEMA = "vllm-guard-report/1"
COMPARE_SCHEMA = "vllm-guard-compare/1"


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


def build(d: ledgerread.LedgerData, confidence: float = 0.90, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    svc = service_figures(d.runtime, now, confidence)
    wd = memory.points_from_watchdog(d.ticks)
    pts, src = (wd, "watchdog") if wd else (memory.points_from_soak(d.soak_samples), "soak")
    leak = memory.leak_report(pts, src if pts else None, confidence)
    if d.incidents is None:
        incidents: dict[str, Any] = {"present": False, "note": "no incidents table (watchdog not installed here)", "list": []}
    else:
        incidents = {"present": bool(d.incidents), "note": "" if d.incidents else "incidents table empty",
                     "list": [{"kind": i.kind, "cause": i.cause, "class": i.cls, "detected_at": i.detected_at,
                               "action": i.action, "restored_at": i.restored_at} for i in d.incidents]}
    ends = d.requests.get("ended_at", np.array([]))
    sp = d.status_problems
    return {
        "schema": SCHEMA, "generated_at": utcnow(), "ledger": d.path, "label": ledger_label(svc, d.watchdog_meta),
        "profile": {"gpu_profile": d.watchdog_meta.gpu_profile, "gpu_budget_mb": d.watchdog_meta.gpu_budget_mb},
        "service": svc.to_dict(),
        "incidents": incidents, "leak": leak,
        "watchdog_samples": _samples_section(d),
        "soak_status": {"count": len(d.soak_status), "invalid": sp.bad, "first_error": sp.first or None},
        "thermal": thermal.thermal_report(d.ticks, ends[np.isfinite(ends)]),
        "latency": latency_report(d.requests, d.errors, d.runs, svc.requests_served),
        "patches": _patch_states(d),
    }


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


def figures(db: str | Path, confidence: float = 0.90, run_id: int | None = None
            ) -> tuple[dict[str, Any], ledgerread.LedgerData]:
    d = ledgerread.load(db, run_id)
    return _clean(build(d, confidence)), d


def render(db: str | Path, fmt: str, confidence: float = 0.90, run_id: int | None = None) -> str:
    f, d = figures(db, confidence, run_id)
    if fmt == "json":
        return json.dumps(f, indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_html

        return render_html(f, d)
    from .text import render_text

    return render_text(f)


def render_compare(paths: list[str], fmt: str, confidence: float = 0.90) -> str:
    from .text import compare_rows

    (fa, da), (fb, db_) = figures(paths[0], confidence), figures(paths[1], confidence)
    rows = compare_rows(fa, fb)
    if fmt == "json":
        out = {"schema": COMPARE_SCHEMA, "a": fa, "b": fb,
               "rows": [{"figure": k, "a": a, "b": b} for k, a, b in rows]}
        return json.dumps(_clean(out), indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_compare_html

        return render_compare_html(fa, da, fb, db_, rows)
    from .text import render_compare_text

    return render_compare_text(fa, fb, rows)
