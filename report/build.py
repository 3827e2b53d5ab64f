"""`vllm-guard report`: one figures dict from a ledger, rendered as text, JSON or HTML.

The JSON is the figures dict itself (keys documented in docs/REPORTS.md, `schema` versioned);
text and HTML are views of it, so the three never disagree.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.runtime.ledger import utcnow

from . import ledgerread, memory, service, thermal
from .latency import latency_report

SCHEMA = "vllm-guard-report/1"
COMPARE_SCHEMA = "vllm-guard-compare/1"


def _patch_states(d: ledgerread.LedgerData) -> Any:
    """Patch states per generation from the soak's status snapshots (the runtime keeps none)."""
    out = {}
    for s in d.soak_status:
        if s.get("patches"):
            out[str(s.get("generation"))] = s["patches"]
    return out or None


def ledger_label(svc: dict[str, Any], meta: dict[str, Any]) -> str:
    """GPU name(s), then the watchdog's profile and memory budget when it recorded them: two
    budgets emulated on one GPU (or two cards of one model) stay apart in `--compare`."""
    names = svc.get("gpu_names") or meta.get("watchdog.gpu_names") or []
    parts = [" / ".join(names) if names else ("no GPU" if svc.get("present") else "no runtime data")]
    profile = meta.get("watchdog.gpu_profile")
    if profile:
        parts.append(f"profile {profile}")
    budget = meta.get("watchdog.gpu_budget_mb")
    if budget:
        parts.append(f"{float(budget) / 1024:g} GiB budget")
    return " · ".join(parts)


def build(d: ledgerread.LedgerData, confidence: float = 0.90, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    svc = service.service(d.generations, d.recycles, d.failures, now, confidence)
    wd = memory.points_from_watchdog(d.samples)
    pts, src = (wd, "watchdog") if wd else (memory.points_from_soak(d.soak_samples), "soak")
    leak = memory.leak_report(pts, src if pts else None, confidence)
    if d.incidents is None:
        incidents: dict[str, Any] = {"present": False, "note": "no incidents table (watchdog not installed here)", "list": []}
    else:
        incidents = {"present": bool(d.incidents), "note": "" if d.incidents else "incidents table empty",
                     "list": [{k: i.get(k) for k in ("kind", "cause", "class", "detected_at", "action", "restored_at")}
                              for i in d.incidents]}
    ends = d.requests.get("ended_at", np.array([]))
    label = ledger_label(svc, d.meta)
    return {
        "schema": SCHEMA, "generated_at": utcnow(), "ledger": d.path, "label": label,
        "profile": {"gpu_profile": d.meta.get("watchdog.gpu_profile"),
                    "gpu_budget_mb": d.meta.get("watchdog.gpu_budget_mb")},
        "service": svc,
        "incidents": incidents, "leak": leak,
        "watchdog_samples": {"present": bool(d.samples), "count": len(d.samples or []),
                             "note": "" if d.samples else "no watchdog samples (table absent or empty)"},
        "thermal": thermal.thermal_report(d.samples, ends[np.isfinite(ends)]),
        "latency": latency_report(d.requests, d.errors, d.runs),
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


def figures(db: str | Path, confidence: float = 0.90, run_id: int | None = None) -> tuple[dict[str, Any], ledgerread.LedgerData]:
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
