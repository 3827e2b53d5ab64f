"""The self-contained HTML report: the verdict first, then one section per question with its
figures and plots on one time axis, then the full text report and the JSON figures.

No scripts, no external CSS or fonts: it opens from a file on a machine without network.
"""

from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

from . import plots
from .compare import Verdict
from .figures import Report, to_json
from .ledgerread import LedgerData
from .text import render_compare_text, render_text

_CSS = """body{font-family:sans-serif;margin:1.5em;max-width:1150px;color:#222}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}
figure{margin:.6em 0}img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.note{color:#777}
.verdict{border:2px solid #345;background:#f4f8fc;padding:.6em 1em;margin:.8em 0}
.verdict li{margin:.25em 0}.overall{font-size:1.15em;font-weight:bold}
.sig{color:#064}.ns{color:#666}h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.2em}"""


def _img(b64: str | None, alt: str, note: str) -> str:
    if b64 is None:
        return f'<p class="note plot-missing">{html.escape(alt)}: {html.escape(note)}</p>'
    return f'<figure><img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"></figure>'


def _table(head: list[str], rows: list[list[Any]], cls: str) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(v))}</td>" for v in r) + "</tr>" for r in rows)
    return (f'<table class="figures {cls}"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + f"</tr>{body}</table>")


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 2)


def _sections(f: Report, d: LedgerData) -> str:
    s, lk, t, sl = f.service, f.leak, f.traffic, f.sla
    rel = _table(["replica", "up h", "unplanned", "MTBF", "availability %", "planned down s", "unplanned down s"],
                 [["all", s.up_h, s.failures_unplanned, s.mtbf.headline() if s.mtbf else s.note,
                   None if s.availability is None else 100 * s.availability, s.downtime_planned_s,
                   s.downtime_unplanned_s]]
                 + ([[r.replica, r.service.up_h, r.service.failures_unplanned,
                      r.service.mtbf.headline() if r.service.mtbf else "-",
                      None if r.service.availability is None else 100 * r.service.availability,
                      r.service.downtime_planned_s, r.service.downtime_unplanned_s] for r in f.replicas]
                    if len(f.replicas) > 1 else []), "reliability")
    leaks = _table(["replica", "process", "memory", "MB/100 requests", "interval", "MB/h", "points", "verdict",
                    "time to OOM h"],
                   [["all" if p.replica is None else p.replica, p.role, p.metric,
                     p.per_100_requests.slope if p.per_100_requests else None,
                     f"[{p.per_100_requests.low:.3g}, {p.per_100_requests.high:.3g}]" if p.per_100_requests else "-",
                     p.per_hour.slope if p.per_hour else None, p.points, p.verdict, p.time_to_oom_h]
                    for p in lk.processes], "leaks") if lk.processes else f'<p class="note">{html.escape(lk.note)}</p>'
    hours = _table(["hour", "from (UTC)", "requests", "failed", f"{sl.latency} P99 ms", "tier"],
                   [[h.hour, h.start, h.requests, h.failed, _ms(h.p99_s), h.tier or "none"] for h in sl.per_hour],
                   "sla") if sl.present else f'<p class="note">{html.escape(sl.note)}</p>'
    tr = _table(["", "p50 ms", "p95 ms", "p99 ms"],
                [[n, _ms(q.p50), _ms(q.p95), _ms(q.p99)] for n, q in (("TTFT", t.ttft_s), ("ITL", t.itl_s),
                                                                      ("E2E", t.e2e_s))], "latency") \
        if t.present else f'<p class="note">{html.escape(t.note)}</p>'
    c = f.cost
    cost = _table(["figure", "value"], [
        ["cost per M output tokens", f"{c.per_million_tokens.cost:,.2f} {c.prices.currency}"
         if c.per_million_tokens and c.prices else "-"],
        ["output tokens", c.output_tokens], ["output tokens/s", t.output_tokens_per_s],
        ["tokens per kWh", c.tokens_per_kwh], ["TCO", f"{c.tco.total:,.0f} {c.prices.currency}"
                                               if c.tco and c.tco.total and c.prices else "-"]], "cost") \
        + "".join(f'<p class="note">{html.escape(n)}</p>' for n in c.notes)
    tl = f.tail
    tail = (_table(["waited through", "part", "of the slowest", "of all requests"],
                   [[c.kind, "", c.tail, c.all] for c in tl.kinds]
                   + [[c.kind, c.part, c.tail, c.all] for c in tl.parts], "tail")
            + _table(["arrived (UTC)", "replica", "generation", "TTFT ms", "waited through", "what"],
                     [[r.at, r.replica, r.generation, _ms(r.ttft_s), r.kind, r.what] for r in tl.slowest_requests],
                     "slowest")
            + f'<p class="note">the slowest {100 * (1 - tl.quantile):.0f} %: {tl.slowest} of {tl.requests} requests, '
              f'TTFT ≥ {_ms(tl.threshold_s)} ms</p>') if tl.present else f'<p class="note">{html.escape(tl.note)}</p>'
    no_mem = lk.note if not lk.processes else "no readings of this kind"
    soak = ""
    if f.soak.present:
        q = f.soak
        soak = ("<h2>Soak (the load generator's own view of its requests)</h2>" + _table(
            ["", "p50 ms", "p99 ms"], [[n, _ms(x.p50), _ms(x.p99)] for n, x in (
                ("TTFT", q.ttft_s), ("TTFT from the scheduled send", q.ttft_sched_s), ("E2E", q.e2e_s),
                ("E2E from the scheduled send", q.e2e_sched_s))], "soak")
            + f'<p class="note">{q.requests} soak requests, {q.failed} failed: '
              f'{html.escape(", ".join(f"{k} {v}" for k, v in q.errors.items()) or "no errors")}</p>')
    return "".join((
        '<h2 id="reliability">Reliability</h2>', rel,
        '<h2 id="memory">Memory: leaks and time to out of memory</h2>', leaks,
        _img(plots.memory_plot(d, lk, "gpu_mb"), "GPU memory per process", f"{no_mem} (GPU: needs NVML)"),
        _img(plots.memory_plot(d, lk, "rss_mb"), "host memory per process", no_mem),
        f'<h2 id="sla">SLA per hour ({html.escape(sl.source or "-")} requests)</h2>', hours,
        '<h2 id="latency">Latency</h2>', tr,
        _img(plots.latency_plot(d, sl, sl.latency), "latency over time", t.note or "no requests recorded"),
        '<h2 id="tail">Where the slowest first tokens waited</h2>', tail,
        '<h2 id="throughput">Throughput</h2>',
        _img(plots.throughput_plot(d), "throughput over time", t.note or "no requests recorded"),
        '<h2 id="cost">Cost</h2>', cost, soak,
        '<h2 id="thermals">Thermals</h2>',
        _img(plots.thermal_plot(d), "GPU temperature and clocks", f.thermal.note),
    ))


def _verdict(f: Report, title: str = "Verdict") -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in f.summary.lines)
    conf = f.service.mtbf.confidence if f.service.mtbf else 0.9
    return (f'<section class="verdict" id="verdict"><h2>{html.escape(title)}</h2><ul>{items}</ul>'
            f'<p class="note">Ledger {html.escape(f.ledger)}; times are UTC; MTBF intervals at {conf:.0%}, '
            f"leak intervals at {f.leak.confidence:.0%}.</p></section>")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{body}</body></html>\n")


def render_html(f: Report, d: LedgerData) -> str:
    body = (f"<h1>vllm-guard report: {html.escape(f.label)}</h1>{_verdict(f)}{_sections(f, d)}"
            f"<h2>All figures</h2><pre>{html.escape(render_text(f))}</pre>"
            f"<h2>Figures (JSON)</h2><details><summary>show</summary><pre>"
            f"{html.escape(json.dumps(to_json(f), indent=1, sort_keys=True))}</pre></details>")
    return _page(f"vllm-guard report {f.label}", body)


def render_compare_html(fa: Report, da: LedgerData, fb: Report, db: LedgerData,
                        rows: list[tuple[str, Any, Any]], verdict: Verdict) -> str:
    cell = (lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = "".join(f'<li class="{"sig" if x.better else "ns"}">{html.escape(x.text)}</li>' for x in verdict.lines)
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(cell(a))}</td><td>{html.escape(cell(b))}</td></tr>"
                    for k, a, b in rows)
    body = (f"<h1>vllm-guard compare: A {html.escape(fa.label)} vs B {html.escape(fb.label)}</h1>"
            f'<section class="verdict" id="verdict"><p class="overall">{html.escape(verdict.overall)}</p>'
            f"<ul>{lines}</ul><p class=\"note\">Green: a difference, significant at {verdict.confidence:.0%} and at "
            f"least {verdict.practical_pct:g} %. A: {html.escape(fa.ledger)}; B: {html.escape(fb.ledger)}.</p></section>"
            f"{_verdict(fa, 'A: ' + fa.label)}{_verdict(fb, 'B: ' + fb.label)}"
            f"<h2>Side by side</h2><table><tr><th>figure</th><th>A</th><th>B</th></tr>{table}</table>"
            f"<h1>A: {html.escape(fa.label)}</h1>{_sections(fa, da)}"
            f"<h1>B: {html.escape(fb.label)}</h1>{_sections(fb, db)}"
            f"<h2>All figures</h2><pre>{html.escape(render_compare_text(fa, fb, rows, verdict))}</pre>"
            f"<details><summary>verdict (JSON)</summary><pre>"
            f"{html.escape(json.dumps(dataclasses.asdict(verdict), indent=1, default=str))}</pre></details>")
    return _page("vllm-guard compare", body)
