"""`vllm-guard report`: the typed figures of a ledger (`figures.Report`), rendered as text, JSON
or HTML from the same tree, so the three never disagree.

Everything is answered from what the runtime records of production traffic (its generations,
recycles and failures; every request at the proxy, per minute; its processes' memory); the
watchdog's samples (GPU thermals, power, its memory forecasts) and a soak's own requests, when
present, are shown and labelled as such. The `service` section is
`core.reliability.service_figures`: the one MTBF, as the exporter and the runtime's metrics port
show it. Per replica too when the box runs several.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_guard.core.ledger import SCHEMA_VERSION, newer_line
from vllm_guard.core.reliability import ServiceFigures, of_replica, replicas_of, service_figures
from vllm_guard.core.timefmt import utcnow

from . import attribution, cost, ledgerread, memory, sla, summary, tail, thermal, traffic
from .figures import (
    SCHEMA, IncidentFigures, IncidentRow, ReplicaFigures, Report, Summary, TableHealth, to_json,
)
from .latency import soak_report

COMPARE_SCHEMA = "vllm-guard-compare/2"


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


def _samples(d: ledgerread.LedgerData) -> TableHealth:
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
    return TableHealth(bool(d.ticks), len(d.ticks or []), p.bad, p.first or None, note)


def _incidents(d: ledgerread.LedgerData) -> IncidentFigures:
    if d.incidents is None:
        return IncidentFigures(False, "no incidents table (watchdog not installed here)")
    rows = [IncidentRow(i.kind, i.cause, i.cls, i.detected_at, i.action, i.restored_at) for i in d.incidents]
    return IncidentFigures(bool(rows), "" if rows else "incidents table empty", rows)


def _minutes(d: ledgerread.LedgerData) -> TableHealth:
    p = d.minute_problems
    note = (f"{p.bad} of {p.rows} of the runtime's minute rows do not match their schema and were not used; "
            f"first: {p.first}" if p.bad else "")
    return TableHealth(bool(d.edge_minutes), len(d.edge_minutes), p.bad, p.first or None, note)


def _replicas(d: ledgerread.LedgerData, opts: Options, now: float, blocks: list[traffic.Block], source: str | None,
              leak_procs: list[Any]) -> list[ReplicaFigures]:
    out = []
    for r in replicas_of(d.runtime):
        svc = service_figures(of_replica(d.runtime, r), now, opts.confidence)
        mine = [b for b in blocks if b.replica == r] if source == "runtime" else (blocks if r == 0 else [])
        rs = sla.sla_report(mine, source, opts.tiers, opts.sla_latency)
        leaks = [p for p in leak_procs if p.leak and (p.replica == r or (p.replica is None and len(
            replicas_of(d.runtime)) == 1))]
        out.append(ReplicaFigures(r, svc, traffic.traffic(mine, source, r), rs.run_tier, leaks))
    return out


def build(d: ledgerread.LedgerData, opts: Options | None = None, now: float | None = None) -> Report:
    opts = opts or Options()
    now = time.time() if now is None else now
    svc = service_figures(d.runtime, now, opts.confidence)
    label = ledger_label(svc, d.watchdog_meta)
    blocks, source = traffic.blocks_of(d, opts.sla_latency)
    box = traffic.per_minute(blocks)
    exact = traffic.exact_span(d, source)
    served = traffic.traffic(box, source, None, "no requests recorded: the runtime writes every request it serves "
                             "(an older runtime did not; run a soak, or serve with this version)",
                             exact)
    ends = d.requests.get("ended_at", np.array([]))
    if source == "runtime":
        ends = np.concatenate([np.full(b.completed, b.t + 30.0) for b in box]) if box else np.array([])
    t0, t1 = traffic.window(box, exact) if box else (None, None)
    reps = replicas_of(d.runtime)
    leak = memory.leak_report(d, reps)
    r = Report(
        schema=SCHEMA, generated_at=utcnow(), ledger=d.path, label=label,
        profile={"gpu_profile": d.watchdog_meta.gpu_profile, "gpu_budget_mb": d.watchdog_meta.gpu_budget_mb},
        service=svc, replicas=_replicas(d, opts, now, blocks, source, leak.processes), incidents=_incidents(d),
        leak=leak, attribution=attribution.attribution_report(d.ticks, opts.confidence,
                                                             warmup=memory.warmup_of(d)[0]),
        watchdog_samples=_samples(d),
        soak_status=TableHealth(bool(d.soak_status), len(d.soak_status), d.status_problems.bad,
                                d.status_problems.first or None),
        runtime_minutes=_minutes(d),
        thermal=thermal.thermal_report(d.ticks, ends[np.isfinite(ends)]),
        traffic=served, tail=tail.tail_report(d.waits, d.runtime), soak=soak_report(d.requests, d.errors, d.runs),
        sla=sla.sla_report(box, source, opts.tiers, opts.sla_latency),
        cost=cost.cost_report(d.ticks, served, t0, t1, svc, label, opts.prices),
        patches=_patch_states(d),
        empty=not (svc.present or d.ticks or d.errors or d.soak_samples or d.edge_minutes),
        summary=Summary([], None, None, None, None, None, None, None, None, [], None, None),
    )
    s = summary.summary(r)
    newer = newer_ledger(d)
    return dataclasses.replace(r, summary=dataclasses.replace(s, lines=[newer, *s.lines]) if newer else s)


def newer_ledger(d: ledgerread.LedgerData) -> str | None:
    """The summary's first line when a newer vllm-guard wrote the ledger: it is read for what
    this version knows, and the operator reading the report (maybe later, elsewhere) is told."""
    v = d.schema_version
    if v is None or v <= SCHEMA_VERSION:
        return None
    return (f"Ledger: {newer_line(d.path, v)}: this report reads only the tables and columns of schema "
            f"{SCHEMA_VERSION}; report with the newer vllm-guard for all of it")


def figures(db: str | Path, opts: Options | None = None, run_id: int | None = None
            ) -> tuple[Report, ledgerread.LedgerData]:
    d = ledgerread.load(db, run_id)
    r = build(d, opts)
    if r.empty:
        raise ledgerread.LedgerError(f"{d.path}: the ledger is empty (no generations, watchdog samples or soak "
                                     "requests): nothing to report yet")
    return r, d


def render(db: str | Path, fmt: str, opts: Options | None = None, run_id: int | None = None) -> str:
    r, d = figures(db, opts, run_id)
    if fmt == "json":
        return json.dumps(to_json(r), indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_html

        return render_html(r, d)
    from .text import render_text

    return render_text(r)


def render_compare(paths: list[str], fmt: str, opts: Options | None = None) -> str:
    from .compare import compare
    from .text import compare_rows

    opts = opts or Options()
    (fa, da), (fb, db_) = figures(paths[0], opts), figures(paths[1], opts)
    rows = compare_rows(fa, fb)
    verdict = compare(fa, da, fb, db_, opts)
    if fmt == "json":
        from .figures import clean

        out = {"schema": COMPARE_SCHEMA, "a": to_json(fa), "b": to_json(fb), "verdict": dataclasses.asdict(verdict),
               "rows": [{"figure": k, "a": a, "b": b} for k, a, b in rows]}
        return json.dumps(clean(out), indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        from .html import render_compare_html

        return render_compare_html(fa, da, fb, db_, rows, verdict)
    from .text import render_compare_text

    return render_compare_text(fa, fb, rows, verdict)
