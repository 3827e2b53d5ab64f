"""The self-contained HTML report: tables from the figures dict, plots as base64 PNG.

No scripts, no external CSS or fonts: it opens from a file on a machine without network.
"""

from __future__ import annotations

import html
import json
from typing import Any

from . import plots
from .ledgerread import LedgerData
from .text import render_compare_text, render_text

_CSS = """body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:13px}
figure{margin:1em 0}img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.note{color:#777}"""


def _img(b64: str | None, alt: str, note: str) -> str:
    if b64 is None:
        return f'<p class="note">{html.escape(alt)}: {html.escape(note)}</p>'
    return f'<figure><img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"></figure>'


def _plots(f: dict[str, Any], d: LedgerData) -> str:
    return "".join((
        "<h2>Memory</h2>", _img(plots.memory_plot(d), "memory over time", f["leak"]["note"] or "no memory samples"),
        "<h2>Latency</h2>", _img(plots.latency_plot(d), "latency over time", "no soak requests"),
        "<h2>Temperature and clocks</h2>", _img(plots.thermal_plot(d), "temperature and clocks", f["thermal"]["note"]),
    ))


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{body}</body></html>\n")


def render_html(f: dict[str, Any], d: LedgerData) -> str:
    body = (f"<h1>vllm-guard report: {html.escape(f['label'])}</h1>"
            f"<pre>{html.escape(render_text(f))}</pre>{_plots(f, d)}"
            f"<h2>Figures (JSON)</h2><details><summary>show</summary><pre>"
            f"{html.escape(json.dumps(f, indent=1, sort_keys=True))}</pre></details>")
    return _page(f"vllm-guard report {f['label']}", body)


def render_compare_html(fa: dict[str, Any], da: LedgerData, fb: dict[str, Any], db: LedgerData,
                        rows: list[tuple[str, Any, Any]]) -> str:
    cell = (lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(cell(a))}</td><td>{html.escape(cell(b))}</td></tr>"
                    for k, a, b in rows)
    body = (f"<h1>vllm-guard compare: {html.escape(fa['label'])} vs {html.escape(fb['label'])}</h1>"
            f"<table><tr><th>figure</th><th>A: {html.escape(fa['ledger'])}</th><th>B: {html.escape(fb['ledger'])}</th></tr>"
            f"{table}</table><h1>A: {html.escape(fa['label'])}</h1>{_plots(fa, da)}"
            f"<h1>B: {html.escape(fb['label'])}</h1>{_plots(fb, db)}"
            f"<pre>{html.escape(render_compare_text(fa, fb, rows))}</pre>")
    return _page("vllm-guard compare", body)
