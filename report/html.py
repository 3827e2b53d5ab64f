"""The self-contained HTML report: the verdict first, then the plots on one time axis, then the
full text report and the JSON figures.

No scripts, no external CSS or fonts: it opens from a file on a machine without network.
"""

from __future__ import annotations

import html
import json
from typing import Any

from . import plots
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


def _plots(f: dict[str, Any], d: LedgerData) -> str:
    leak = f["leak"]
    no_mem = "no memory samples" if not leak["processes"] else "no readings of this kind"
    return "".join((
        "<h2>Memory</h2>",
        _img(plots.memory_plot(d, leak, "gpu_mb"), "GPU memory per process", f"{no_mem} (GPU: needs the watchdog's NVML)"),
        _img(plots.memory_plot(d, leak, "rss_mb"), "host memory per process", no_mem),
        "<h2>Latency</h2>", _img(plots.latency_plot(d, f["sla"]), "latency over time", "no soak requests"),
        "<h2>Thermals</h2>", _img(plots.thermal_plot(d), "GPU temperature and clocks", f["thermal"]["note"]),
    ))


def _verdict(f: dict[str, Any], title: str = "Verdict") -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in f["summary"]["lines"])
    return (f'<section class="verdict" id="verdict"><h2>{html.escape(title)}</h2><ul>{items}</ul>'
            f'<p class="note">Ledger {html.escape(f["ledger"])}; times are UTC; intervals at '
            f'{f["service"]["mtbf"]["confidence"] if f["service"].get("mtbf") else f["leak"].get("confidence", 0.9):.0%}.'
            f"</p></section>")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{body}</body></html>\n")


def render_html(f: dict[str, Any], d: LedgerData) -> str:
    body = (f"<h1>vllm-guard report: {html.escape(f['label'])}</h1>{_verdict(f)}{_plots(f, d)}"
            f"<h2>All figures</h2><pre>{html.escape(render_text(f))}</pre>"
            f"<h2>Figures (JSON)</h2><details><summary>show</summary><pre>"
            f"{html.escape(json.dumps(f, indent=1, sort_keys=True))}</pre></details>")
    return _page(f"vllm-guard report {f['label']}", body)


def render_compare_html(fa: dict[str, Any], da: LedgerData, fb: dict[str, Any], db: LedgerData,
                        rows: list[tuple[str, Any, Any]], verdict: dict[str, Any]) -> str:
    cell = (lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = "".join(
        f'<li class="{"sig" if x["significant"] else "ns"}">{html.escape(x["text"])}</li>' for x in verdict["lines"])
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(cell(a))}</td><td>{html.escape(cell(b))}</td></tr>"
                    for k, a, b in rows)
    body = (f"<h1>vllm-guard compare: A {html.escape(fa['label'])} vs B {html.escape(fb['label'])}</h1>"
            f'<section class="verdict" id="verdict"><p class="overall">{html.escape(verdict["overall"])}</p>'
            f"<ul>{lines}</ul><p class=\"note\">Green: significant at {verdict['confidence']:.0%}. "
            f"A: {html.escape(fa['ledger'])}; B: {html.escape(fb['ledger'])}.</p></section>"
            f"{_verdict(fa, 'A: ' + fa['label'])}{_verdict(fb, 'B: ' + fb['label'])}"
            f"<h2>Side by side</h2><table><tr><th>figure</th><th>A</th><th>B</th></tr>{table}</table>"
            f"<h1>A: {html.escape(fa['label'])}</h1>{_plots(fa, da)}"
            f"<h1>B: {html.escape(fb['label'])}</h1>{_plots(fb, db)}"
            f"<h2>All figures</h2><pre>{html.escape(render_compare_text(fa, fb, rows, verdict))}</pre>")
    return _page("vllm-guard compare", body)
