"""`vllm-guard report --db A --db B ...` (or a directory of ledgers): one report for a fleet.

Each ledger is one box. Boxes are grouped by GPU model (the compare label: the GPU name, with
the watchdog's profile and budget when it recorded them). Per GPU model the up time, unplanned
failures and downtime are pooled over its boxes, and the pooled MTBF gets the chi-square bounds
of `core.reliability.mtbf` (the exponential model: one failure process per box, rates equal, so
the counts add and so do the up times). Between GPU models the compare verdict is the one of
`--compare`, on pooled data: the conditional binomial test on the pooled failure counts, and the
block bootstrap over every per-minute block of every box of each model for latency and errors.
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_guard.core import ledger as L
from vllm_guard.core.errors import UsageError
from vllm_guard.core.reliability import MTBF, availability, mtbf

from . import traffic as T
from .build import Options, figures
from .compare import PRACTICAL_PCT, VerdictLine, block_lines, failure_counts_line
from .figures import Report, clean

SCHEMA = "vllm-guard-fleet/1"


@dataclass(frozen=True)
class BoxRow:
    ledger: str
    label: str
    hosts: list[str]
    up_h: float
    observed_h: float
    failures_unplanned: int
    downtime_planned_s: float
    downtime_unplanned_s: float
    availability: float | None
    mtbf: MTBF | None
    requests: int
    ttft_p99_s: float | None
    sla_run_tier: str | None
    leaks: list[str]


@dataclass(frozen=True)
class ModelRow:
    label: str
    boxes: int
    up_h: float
    failures_unplanned: int
    downtime_planned_s: float
    downtime_unplanned_s: float
    availability: float | None
    mtbf: MTBF  # pooled: T = sum of up times, r = sum of failures
    requests: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    error_rate: float | None


@dataclass(frozen=True)
class ModelVerdict:
    a: str
    b: str
    overall: str
    better: str | None  # the label of the better model, or None
    lines: list[VerdictLine]


@dataclass(frozen=True)
class Fleet:
    schema: str
    confidence: float
    practical_pct: float
    boxes: list[BoxRow]
    models: list[ModelRow]
    verdicts: list[ModelVerdict] = field(default_factory=list)


def ledgers_of(paths: list[str]) -> list[str]:
    """Ledger files: each path a ledger file or a state dir (its ledger), or a directory of
    ledgers (every `*.sqlite` in it and every `*/ledger.sqlite` under it)."""
    out: list[str] = []
    for p in map(Path, paths):
        if p.is_dir() and not (p / L.LEDGER_NAME).exists():
            found = sorted({*p.glob("*.sqlite"), *p.glob(f"*/{L.LEDGER_NAME}")})
            if not found:
                raise UsageError(f"--db has value {str(p)!r}: a directory with no ledger in it (no *.sqlite, no "
                                 f"*/{L.LEDGER_NAME})")
            out += [str(f) for f in found]
        else:
            out.append(str(L.db_path(p)))
    return out


def _box(r: Report) -> BoxRow:
    s = r.service
    return BoxRow(r.ledger, r.label, s.hosts, s.up_h, s.observed_h, s.failures_unplanned, s.downtime_planned_s,
                  s.downtime_unplanned_s, s.availability, s.mtbf, r.traffic.requests, r.traffic.ttft_s.p99,
                  r.sla.run_tier, [p.verdict.split(":")[0] for p in r.leak.leaks() if p.replica is None])


def _model(label: str, reps: list[Report], blocks: list[T.Block], confidence: float) -> ModelRow:
    up = sum(r.service.up_h for r in reps)
    fails = sum(r.service.failures_unplanned for r in reps)
    planned = sum(r.service.downtime_planned_s for r in reps)
    unplanned = sum(r.service.downtime_unplanned_s for r in reps)
    tot = T.total(blocks)
    q = T.quantiles(tot.ttft)
    served = tot.completed + tot.failed
    return ModelRow(label, len(reps), round(up, 4), fails, round(planned, 1), round(unplanned, 1),
                    availability(up * 3600.0, planned + unplanned), mtbf(up, fails, confidence), tot.requests,
                    q.p50, q.p99, tot.failed / served if served else None)


def _verdict(a: ModelRow, b: ModelRow, ba: list[T.Block], bb: list[T.Block], alpha: float,
             confidence: float) -> ModelVerdict:
    lines = [failure_counts_line(a.failures_unplanned, a.up_h, b.failures_unplanned, b.up_h, alpha),
             *block_lines(ba, bb, "pooled", "pooled", alpha)]
    wins = [x for x in lines if x.better]
    count = {w: sum(1 for x in wins if x.better == w) for w in ("A", "B")}
    best = "A" if count["A"] > count["B"] else "B" if count["B"] > count["A"] else lines[0].better
    name = {"A": a.label, "B": b.label}
    if not wins or best is None:
        overall = (f"No difference between {a.label} and {b.label} at {confidence:.0%} and {PRACTICAL_PCT:g} % "
                   f"({a.boxes} vs {b.boxes} boxes, pooled)" if not wins else
                   f"Mixed: {a.label} better on {count['A']}, {b.label} on {count['B']} figures")
        return ModelVerdict(a.label, b.label, overall, None, lines)
    figs = ", ".join(x.figure for x in wins if x.better == best)
    return ModelVerdict(a.label, b.label, f"{name[best]} is better than {name['B' if best == 'A' else 'A']}: on "
                        f"{figs} ({a.boxes} vs {b.boxes} boxes, pooled)", name[best], lines)


def fleet(paths: list[str], opts: Options | None = None) -> Fleet:
    opts = opts or Options()
    files = ledgers_of(paths)
    if len(files) < 2:
        raise UsageError(f"a fleet report needs two or more ledgers (got {len(files)}: {', '.join(files)})")
    reps: list[Report] = []
    blocks: list[list[T.Block]] = []
    for f in files:
        r, d = figures(f, opts)
        reps.append(r)
        blocks.append(T.per_minute(T.blocks_of(d, opts.sla_latency)[0]))
    by: dict[str, list[int]] = {}
    for i, r in enumerate(reps):
        by.setdefault(r.label, []).append(i)
    models = {lab: _model(lab, [reps[i] for i in idx], [b for i in idx for b in blocks[i]], opts.confidence)
              for lab, idx in sorted(by.items())}
    pooled = {lab: [b for i in idx for b in blocks[i]] for lab, idx in by.items()}
    alpha = 1.0 - opts.confidence
    verdicts = [_verdict(models[x], models[y], pooled[x], pooled[y], alpha, opts.confidence)
                for x, y in itertools.combinations(sorted(models), 2)]
    return Fleet(SCHEMA, opts.confidence, PRACTICAL_PCT, [_box(r) for r in reps], list(models.values()), verdicts)


# -- rendering ----------------------------------------------------------------------------------
def _h(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g} h"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.3f} %"


def model_line(m: ModelRow) -> str:
    return (f"{m.label}: {m.boxes} box{'es' if m.boxes != 1 else ''}, MTBF {m.mtbf.headline()}; availability "
            f"{_pct(m.availability)} (downtime planned {m.downtime_planned_s:.0f} s, unplanned "
            f"{m.downtime_unplanned_s:.0f} s); {m.requests} requests, TTFT p99 {_ms(m.ttft_p99_s)}")


def render_text(f: Fleet) -> str:
    out = [f"vllm-guard fleet report  {len(f.boxes)} boxes, {len(f.models)} GPU model(s)", "", "PER GPU MODEL (pooled)"]
    out += [f"  {model_line(m)}" for m in f.models]
    out += ["", "VERDICT PER GPU MODEL"]
    for v in f.verdicts:
        out.append(f"  {v.overall}")
        out += [f"    {'+' if x.better else ' '} {x.text}" for x in v.lines]
    if not f.verdicts:
        out.append("  one GPU model: nothing to compare")
    out += ["", "PER BOX"]
    for b in f.boxes:
        out.append(f"  {b.label} ({b.ledger}; {', '.join(b.hosts) or '-'}): up {_h(b.up_h)}, unplanned "
                   f"{b.failures_unplanned}, MTBF {b.mtbf.headline() if b.mtbf else '-'}, availability "
                   f"{_pct(b.availability)}, {b.requests} requests, TTFT p99 {_ms(b.ttft_p99_s)}, SLA "
                   f"{b.sla_run_tier or '-'}, leaks: {', '.join(b.leaks) or 'none shown'}")
    return "\n".join(out) + "\n"


def to_json(f: Fleet) -> dict[str, Any]:
    return dict(clean(dataclasses.asdict(f)))


def render_html(f: Fleet) -> str:
    from .html import _CSS, _table

    def mtbf_cells(m: MTBF | None) -> list[Any]:
        if m is None:
            return ["-", "-", "-"]
        return [m.mtbf_h, m.lower_one_sided_h, f"{_h(m.two_sided_low_h)} - {_h(m.two_sided_high_h)}"
                if m.two_sided_low_h is not None else "-"]

    models = _table(["GPU model", "boxes", "up h", "unplanned", "MTBF h", f"MTBF >= h ({f.confidence:.0%})",
                     "interval", "availability %", "planned down s", "unplanned down s", "requests", "TTFT p99 ms"],
                    [[m.label, m.boxes, m.up_h, m.failures_unplanned, *mtbf_cells(m.mtbf),
                      None if m.availability is None else 100 * m.availability, m.downtime_planned_s,
                      m.downtime_unplanned_s, m.requests, None if m.ttft_p99_s is None else 1000 * m.ttft_p99_s]
                     for m in f.models], "models")
    boxes = _table(["ledger", "GPU model", "up h", "unplanned", "MTBF h", "MTBF >= h", "interval", "availability %",
                    "requests", "TTFT p99 ms", "SLA", "leaks"],
                   [[b.ledger, b.label, b.up_h, b.failures_unplanned, *mtbf_cells(b.mtbf),
                     None if b.availability is None else 100 * b.availability, b.requests,
                     None if b.ttft_p99_s is None else 1000 * b.ttft_p99_s, b.sla_run_tier or "-",
                     ", ".join(b.leaks) or "none shown"] for b in f.boxes], "boxes")
    verdicts = "".join(
        f'<p class="overall">{html.escape(v.overall)}</p><ul>'
        + "".join(f'<li class="{"sig" if x.better else "ns"}">{html.escape(x.text)}</li>' for x in v.lines) + "</ul>"
        for v in f.verdicts) or '<p class="note">one GPU model: nothing to compare</p>'
    lines = "".join(f"<li>{html.escape(model_line(m))}</li>" for m in f.models)
    body = (f"<h1>vllm-guard fleet report: {len(f.boxes)} boxes, {len(f.models)} GPU model(s)</h1>"
            f'<section class="verdict" id="verdict"><ul>{lines}</ul>{verdicts}<p class="note">Pooled per GPU model: '
            f"up time and unplanned failures summed over its boxes, MTBF with chi-square bounds at "
            f"{f.confidence:.0%}; a model is better only where the difference is significant and at least "
            f"{f.practical_pct:g} %.</p></section>"
            f'<h2 id="models">Per GPU model</h2>{models}<h2 id="boxes">Per box</h2>{boxes}'
            f"<h2>All figures</h2><pre>{html.escape(render_text(f))}</pre>"
            f"<details><summary>JSON</summary><pre>{html.escape(json.dumps(to_json(f), indent=1))}</pre></details>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>vllm-guard fleet report</title>"
            f"<style>{_CSS}</style></head><body>{body}</body></html>\n")


def render(paths: list[str], fmt: str, opts: Options | None = None) -> str:
    f = fleet(paths, opts)
    if fmt == "json":
        return json.dumps(to_json(f), indent=2, sort_keys=True) + "\n"
    if fmt == "html":
        return render_html(f)
    return render_text(f)
