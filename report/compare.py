"""`--compare`: which box is better on each figure, and whether the difference is significant.

One line per figure, each with the test that decides it at the report's confidence:
- unplanned failures: the two counts are Poisson over their up times; given the total, A's
  count is binomial with p = T_A / (T_A + T_B) when the rates are equal (the conditional test,
  exact: `scipy.stats.binomtest`);
- leak slopes (per process and memory kind): significant when the two intervals do not
  overlap (conservative);
- latency (TTFT, ITL, E2E): Mann-Whitney U on the per-request values of successful requests;
- error rate: Fisher's exact test on failed/ok counts;
- availability, throughput, SLA, cost: shown as they are (no sampling model for them here).
The overall line first: the box that wins more significant figures, reliability first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

from .ledgerread import LedgerData

LATENCY = (("TTFT", "ttft_s"), ("ITL", "itl_mean_s"), ("E2E", "e2e_s"))


def _line(figure: str, better: str | None, significant: bool | None, text: str, test: str,
          p: float | None = None) -> dict[str, Any]:
    return {"figure": figure, "better": better, "significant": significant, "text": text, "test": test,
            "p_value": p}


def _who(a_wins: bool) -> str:
    return "A" if a_wins else "B"


def failures_line(fa: dict[str, Any], fb: dict[str, Any], alpha: float) -> dict[str, Any]:
    sa, sb = fa["service"], fb["service"]
    if not sa.get("present") or not sb.get("present"):
        return _line("unplanned failures", None, None, "unplanned failures: a ledger without runtime data", "none")
    ra, rb = sa["failures_unplanned"], sb["failures_unplanned"]
    ta, tb = sa["up_h"], sb["up_h"]
    desc = f"A {ra} in {ta:.3g} h up, B {rb} in {tb:.3g} h up"
    if ra + rb == 0 or ta <= 0 or tb <= 0:
        return _line("unplanned failures", None, False, f"unplanned failures: none on either box ({desc}): "
                     "no difference measurable yet", "conditional binomial")
    p = float(stats.binomtest(ra, ra + rb, ta / (ta + tb)).pvalue)
    better = _who(ra / ta < rb / tb)
    sig = p < alpha
    verdict = (f"{better} fails less often (significant, p = {p:.2g})" if sig
               else f"no significant difference (p = {p:.2g})")
    return _line("unplanned failures", better, sig, f"unplanned failures: {verdict}; {desc}", "conditional binomial", p)


def _leaks(f: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["role"], p["metric"]): p["per_100_requests"] for p in f["leak"]["processes"]
            if p["metric"] in ("rss_mb", "gpu_mb") and p["per_100_requests"]["slope"] is not None}


def _opening(sig: bool, claim: str) -> str:
    """The start of a verdict line, up to the test's figures in parentheses."""
    return f"{claim} (significant: " if sig else "no significant difference ("


def leak_lines(fa: dict[str, Any], fb: dict[str, Any]) -> list[dict[str, Any]]:
    la, lb = _leaks(fa), _leaks(fb)
    out = []
    for key in sorted(set(la) & set(lb)):
        a, b = la[key], lb[key]
        kind = "GPU" if key[1] == "gpu_mb" else "host RSS"
        name = f"leak {key[0]} {kind}"
        if None in (a["low"], a["high"], b["low"], b["high"]):
            out.append(_line(name, None, None, f"{name}: no interval on one side", "interval overlap"))
            continue
        better = _who(a["slope"] < b["slope"])
        sig = a["high"] < b["low"] or b["high"] < a["low"]
        out.append(_line(name, better, sig,
                         f"{name}: " + _opening(sig, f"{better} grows slower") + "intervals "
                         f"A [{a['low']:.3g}, {a['high']:.3g}], B [{b['low']:.3g}, {b['high']:.3g}] MB/100 requests)",
                         "interval overlap"))
    return out


def _ok_values(d: LedgerData, col: str) -> np.ndarray:
    if not d.errors:
        return np.array([])
    ok = np.array([e is None for e in d.errors])
    v = d.requests[col][ok]
    return v[np.isfinite(v)]


def latency_lines(da: LedgerData, db: LedgerData, alpha: float) -> list[dict[str, Any]]:
    out = []
    for name, col in LATENCY:
        a, b = _ok_values(da, col), _ok_values(db, col)
        if a.size < 2 or b.size < 2:
            out.append(_line(name, None, None, f"{name}: too few requests on one side", "Mann-Whitney U"))
            continue
        p = float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)
        ma, mb = float(np.median(a)), float(np.median(b))
        pa, pb = float(np.percentile(a, 99)), float(np.percentile(b, 99))
        better = _who(ma < mb)
        sig = p < alpha
        head = _opening(sig, f"{better} is faster")
        out.append(_line(name, better, sig,
                         f"{name}: {head}Mann-Whitney p = {p:.2g}): median {ma * 1000:.1f} vs {mb * 1000:.1f} ms, "
                         f"P99 {pa * 1000:.1f} vs {pb * 1000:.1f} ms", "Mann-Whitney U", p))
    return out


def errors_line(fa: dict[str, Any], fb: dict[str, Any], alpha: float) -> dict[str, Any]:
    la, lb = fa["latency"], fb["latency"]
    if not la.get("present") or not lb.get("present"):
        return _line("error rate", None, None, "error rate: no soak requests on one side", "Fisher exact")
    ea, eb = la["failed"], lb["failed"]
    na, nb = la["requests"], lb["requests"]
    if ea + eb == 0:
        return _line("error rate", None, False, f"error rate: no failed request on either ({na} vs {nb} requests)",
                     "Fisher exact")
    p = float(stats.fisher_exact([[ea, na - ea], [eb, nb - eb]]).pvalue)
    better = _who(ea / na < eb / nb)
    sig = p < alpha
    head = _opening(sig, f"{better} fails fewer requests")
    return _line("error rate", better, sig,
                 f"error rate: {head}Fisher p = {p:.2g}): {100 * ea / na:.3g} % vs {100 * eb / nb:.3g} %", "Fisher exact", p)


def _plain(name: str, a: float | None, b: float | None, higher_better: bool, fmt: str) -> dict[str, Any]:
    if a is None or b is None:
        return _line(name, None, None, f"{name}: not measured on one side", "none")
    if fmt.format(a) == fmt.format(b):
        return _line(name, None, None, f"{name}: equal ({fmt.format(a)})", "none")
    better = _who((a > b) == higher_better)
    return _line(name, better, None, f"{name}: {better} ({fmt.format(a)} vs {fmt.format(b)}; no test)", "none")


def verdict_lines(fa: dict[str, Any], da: LedgerData, fb: dict[str, Any], db: LedgerData,
                  confidence: float) -> dict[str, Any]:
    alpha = 1.0 - confidence
    lines = [failures_line(fa, fb, alpha)]
    sa, sb = fa["service"], fb["service"]
    lines.append(_plain("availability", sa.get("availability"), sb.get("availability"), True, "{:.4%}"))
    lines += leak_lines(fa, fb)
    lines.append(errors_line(fa, fb, alpha))
    lines += latency_lines(da, db, alpha)
    lines.append(_plain("throughput (output tok/s)", fa["latency"].get("output_tokens_per_s"),
                        fb["latency"].get("output_tokens_per_s"), True, "{:.1f}"))
    ca, cb = fa["cost"].get("per_million_tokens"), fb["cost"].get("per_million_tokens")
    cur = {(f.get("prices") or {}).get("currency") for f in (fa["cost"], fb["cost"])} - {None}
    unit = f" {cur.pop()}" if len(cur) == 1 else ""
    lines.append(_plain("cost per M tokens", ca and ca["cost"], cb and cb["cost"], False, "{:,.2f}" + unit))
    ta, tb = fa["cost"].get("tokens_per_kwh"), fb["cost"].get("tokens_per_kwh")
    lines.append(_plain("tokens per kWh", ta, tb, True, "{:,.0f}"))
    sig = [x for x in lines if x["significant"] and x["better"]]
    wins = {w: sum(1 for x in sig if x["better"] == w) for w in ("A", "B")}
    rel = next((x for x in lines if x["figure"] == "unplanned failures"), None)
    if not sig:
        overall = (f"No significant difference at {confidence:.0%} on any tested figure "
                   f"(A: {fa['label']}, B: {fb['label']})")
        best = None
    else:
        best = "A" if wins["A"] > wins["B"] else "B" if wins["B"] > wins["A"] else (
            rel["better"] if rel and rel["significant"] else None)
        names = ", ".join(x["figure"] for x in sig if x["better"] == best) if best else ""
        overall = (f"{best} ({fa['label'] if best == 'A' else fb['label']}) is better: "
                   f"significant at {confidence:.0%} on {names} ({wins[best]} of {len(sig)} significant figures)"
                   if best else f"Mixed: A wins {wins['A']}, B wins {wins['B']} significant figures at {confidence:.0%}")
    return {"overall": overall, "better": best, "confidence": confidence, "lines": lines}
