"""`--compare`: which box is better on each figure, and only where the difference is real.

A box is called better on a figure only when the difference is both *practical* (at least
PRACTICAL_PCT, 5 % by default, of the other box's value) and *significant* at the report's
confidence, under a test that respects how the data was taken:
- latency (TTFT, ITL, E2E medians) and the error rate: a block bootstrap over per-minute blocks
  (the runtime's minute histograms, or the soak's requests put into minutes): requests of one
  minute share a batch, a recycle, a hot GPU, so they are not independent samples and a
  per-request test (Mann-Whitney over one run) calls tiny differences "significant". Each side's
  minutes are resampled with replacement (BOOT replicates, seeded), the figure recomputed from
  the merged histograms, and the interval of the relative difference read off. Fewer than
  MIN_BLOCKS minutes on either side: too short to tell.
- unplanned failures: the two counts are Poisson over their up times; given the total, A's
  count is binomial with p = T_A / (T_A + T_B) when the rates are equal (exact conditional test);
- leak slopes (per process and memory kind): a box leaks only by the leak rule (`core.leak`);
  when both do, significant when the two intervals do not overlap;
- availability, throughput, cost: shown as they are (no sampling model for them here), never
  counted for the overall verdict.
The overall line first: the box that wins more differences, reliability first; else "no
difference".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import stats

from vllm_guard.core.latency import quantiles

from . import traffic as T
from .figures import Report
from .hist import matrix, merged
from .ledgerread import LedgerData

PRACTICAL_PCT = 5.0
MIN_BLOCKS = 10  # minutes per side before a time-structured test can say anything
BOOT = 2000
MAX_BLOCKS = 2000  # longer runs: consecutive minutes merged into longer blocks
LATENCY = (("TTFT", "ttft"), ("ITL", "itl"), ("E2E", "e2e"))


@dataclass(frozen=True)
class VerdictLine:
    figure: str
    better: str | None  # "A", "B", or None (no difference, or not measured)
    significant: bool | None  # None: no test
    practical: bool | None
    text: str
    test: str
    p_value: float | None = None
    difference_pct: float | None = None  # (B - A) / A, in %
    low_pct: float | None = None
    high_pct: float | None = None


@dataclass(frozen=True)
class Verdict:
    overall: str
    better: str | None
    confidence: float
    practical_pct: float
    lines: list[VerdictLine]


def _who(a_wins: bool) -> str:
    return "A" if a_wins else "B"


def failures_line(fa: Report, fb: Report, alpha: float) -> VerdictLine:
    sa, sb = fa.service, fb.service
    if not sa.present or not sb.present:
        return VerdictLine("unplanned failures", None, None, None, "unplanned failures: a ledger without runtime data",
                           "none")
    return failure_counts_line(sa.failures_unplanned, sa.up_h, sb.failures_unplanned, sb.up_h, alpha)


def failure_counts_line(ra: int, ta: float, rb: int, tb: float, alpha: float) -> VerdictLine:
    """Two failure counts over their up times (one box's, or a GPU model's pooled)."""
    name = "unplanned failures"
    desc = f"A {ra} in {ta:.3g} h up, B {rb} in {tb:.3g} h up"
    if ra + rb == 0 or ta <= 0 or tb <= 0:
        return VerdictLine(name, None, False, False, f"{name}: none on either box ({desc}): no difference "
                           "measurable yet", "conditional binomial")
    p = float(stats.binomtest(ra, ra + rb, ta / (ta + tb)).pvalue)
    rate_a, rate_b = ra / ta, rb / tb
    better = _who(rate_a < rate_b)
    diff = 100.0 * (rate_b - rate_a) / rate_a if rate_a > 0 else math.inf
    sig, prac = p < alpha, abs(diff) >= PRACTICAL_PCT
    verdict = (f"{better} fails less often (significant, p = {p:.2g})" if sig and prac
               else f"no difference (p = {p:.2g})")
    return VerdictLine(name, better if sig and prac else None, sig, prac, f"{name}: {verdict}; {desc}",
                       "conditional binomial", p, diff if math.isfinite(diff) else None)


def leak_lines(fa: Report, fb: Report) -> list[VerdictLine]:
    la = {(p.role, p.metric): p for p in fa.leak.processes if p.replica is None and p.metric in ("rss_mb", "gpu_mb")}
    lb = {(p.role, p.metric): p for p in fb.leak.processes if p.replica is None and p.metric in ("rss_mb", "gpu_mb")}
    out = []
    for key in sorted(set(la) & set(lb)):
        a, b = la[key], lb[key]
        name = f"leak {key[0]} {'GPU' if key[1] == 'gpu_mb' else 'host RSS'}"
        sa, sb = a.per_100_requests, b.per_100_requests
        if sa is None or sb is None:
            out.append(VerdictLine(name, None, None, None, f"{name}: no slope on one side", "leak rule"))
            continue
        iv = (f"A [{sa.low:.3g}, {sa.high:.3g}], B [{sb.low:.3g}, {sb.high:.3g}] MB/100 requests")
        if not a.leak and not b.leak:
            out.append(VerdictLine(name, None, False, False, f"{name}: no difference: neither box shows a leak "
                                   f"({iv})", "leak rule"))
            continue
        better = _who(sa.slope < sb.slope)
        sig = sa.high < sb.low or sb.high < sa.low
        prac = abs(sa.slope - sb.slope) >= PRACTICAL_PCT / 100.0 * max(abs(sa.slope), abs(sb.slope))
        leaking = "only " + ("B" if better == "A" else "A") + " leaks" if (a.leak != b.leak) else "both leak"
        win = sig and prac
        text = (f"{name}: {better} grows slower ({leaking}; significant: intervals {iv})" if win
                else f"{name}: no difference ({leaking}; intervals {iv} overlap or differ by less than "
                     f"{PRACTICAL_PCT:g} %)")
        out.append(VerdictLine(name, better if win else None, sig, prac, text, "leak rule, interval overlap",
                               difference_pct=100.0 * (sb.slope - sa.slope) / abs(sa.slope) if sa.slope else None))
    return out


def _matrix(blocks: Sequence[T.Block], which: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-block bucket counts over the buckets any block uses: (blocks x buckets, bucket ids)."""
    return matrix([getattr(b, which) for b in blocks])


def coarsen(blocks: Sequence[T.Block], limit: int = MAX_BLOCKS) -> list[T.Block]:
    """At most `limit` blocks: consecutive minutes merged (longer blocks keep time structure)."""
    if len(blocks) <= limit:
        return list(blocks)
    k = math.ceil(len(blocks) / limit)
    return [T.total(blocks[i:i + k]) for i in range(0, len(blocks), k)]


def _weights(n: int, rng: np.random.Generator) -> np.ndarray:
    """BOOT resamples of n blocks with replacement, as counts per block (BOOT x n)."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=BOOT).astype(float)


def boot_median(blocks: Sequence[T.Block], which: str, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of the median (s) of the merged histograms of resampled blocks, by
    the one quantile rule (`core.latency.quantiles`); NaN for a replicate with no latency."""
    m, ids = _matrix(blocks, which)
    return quantiles(ids, _weights(len(blocks), rng) @ m, 0.5)


def boot_share(blocks: Sequence[T.Block], rng: np.random.Generator) -> np.ndarray:
    failed = np.array([b.failed for b in blocks], float)
    served = np.array([b.completed + b.failed for b in blocks], float)
    w = _weights(len(blocks), rng)
    return np.asarray((w @ failed) / np.maximum(w @ served, 1.0))


def _bootstrap_line(name: str, test: str, a: float, b: float, ra: np.ndarray, rb: np.ndarray, alpha: float,
                    fmt: Callable[[float], str], lower_better: bool = True) -> VerdictLine:
    """The relative difference (B - A) / A with its bootstrap interval; better only if both
    practical and significant."""
    if a <= 0 and b <= 0:
        return VerdictLine(name, None, False, False, f"{name}: no difference ({fmt(a)} on both)", test)
    d = 100.0 * (b - a) / a if a > 0 else math.inf
    rel = 100.0 * (rb - ra) / np.where(ra > 0, ra, np.nan)
    rel = rel[np.isfinite(rel)]
    lo, hi = (float(np.percentile(rel, 100 * alpha / 2)), float(np.percentile(rel, 100 * (1 - alpha / 2)))) \
        if rel.size else (-math.inf, math.inf)
    p = float(min(1.0, 2 * min((rel <= 0).mean(), (rel >= 0).mean()))) if rel.size else None
    sig = lo > 0 or hi < 0
    prac = abs(d) >= PRACTICAL_PCT
    better = _who((a < b) == lower_better)
    desc = (f"{fmt(a)} vs {fmt(b)}, B {d:+.1f} % [{lo:+.1f}, {hi:+.1f}]; {test}" if math.isfinite(d)
            else f"{fmt(a)} vs {fmt(b)}; {test}")
    if sig and prac:
        text = f"{name}: {better} is better ({desc})"
    elif sig:
        text = f"{name}: no difference (significant but under {PRACTICAL_PCT:g} %: {desc})"
    else:
        text = f"{name}: no difference ({desc})"
    return VerdictLine(name, better if sig and prac else None, sig, prac, text, test, p,
                       d if math.isfinite(d) else None, lo, hi)


def traffic_lines(da: LedgerData, db: LedgerData, alpha: float, latency: str) -> list[VerdictLine]:
    ba, src_a = T.blocks_of(da, latency)
    bb, src_b = T.blocks_of(db, latency)
    return block_lines(T.per_minute(ba), T.per_minute(bb), src_a, src_b, alpha)


def block_lines(ba: list[T.Block], bb: list[T.Block], src_a: str | None, src_b: str | None,
                alpha: float) -> list[VerdictLine]:
    """TTFT, ITL and E2E medians and the error rate of two sets of per-minute blocks (one box's
    minutes, or every minute of every box of a GPU model)."""
    ba, bb = coarsen(ba), coarsen(bb)
    names = [f"{n} median" for n, _ in LATENCY] + ["error rate"]
    if min(len(ba), len(bb)) < MIN_BLOCKS:
        why = (f"too few minutes to tell (A {len(ba)}, B {len(bb)}; a time-structured test needs {MIN_BLOCKS} per "
               "side)")
        return [VerdictLine(n, None, None, None, f"{n}: no difference: {why}", "block bootstrap") for n in names]
    rng = np.random.default_rng(0)
    src = src_a if src_a == src_b else f"{src_a} and {src_b}"
    test = f"block bootstrap over {len(ba)} and {len(bb)} per-minute blocks of {src} requests"
    out = []
    for name, which in LATENCY:
        ha, hb = merged(getattr(b, which) for b in ba), merged(getattr(b, which) for b in bb)
        qa, qb = ha.quantile(0.5), hb.quantile(0.5)
        if qa is None or qb is None or not ha.counts or not hb.counts:
            out.append(VerdictLine(f"{name} median", None, None, None, f"{name} median: not measured on one side",
                                   "block bootstrap"))
            continue
        out.append(_bootstrap_line(f"{name} median", test, qa, qb, boot_median(ba, which, rng),
                                   boot_median(bb, which, rng), alpha, lambda v: f"{v * 1000:.1f} ms"))
    ta, tb = T.total(ba), T.total(bb)
    ea = ta.failed / max(ta.completed + ta.failed, 1)
    eb = tb.failed / max(tb.completed + tb.failed, 1)
    out.append(_bootstrap_line("error rate", test, ea, eb, boot_share(ba, rng), boot_share(bb, rng), alpha,
                               lambda v: f"{100 * v:.3g} %"))
    return out


def _plain(name: str, a: float | None, b: float | None, higher_better: bool, fmt: str) -> VerdictLine:
    if a is None or b is None:
        return VerdictLine(name, None, None, None, f"{name}: not measured on one side", "none")
    if fmt.format(a) == fmt.format(b):
        return VerdictLine(name, None, None, None, f"{name}: equal ({fmt.format(a)})", "none")
    side = _who((a > b) == higher_better)
    return VerdictLine(name, None, None, None, f"{name}: {fmt.format(a)} vs {fmt.format(b)} ({side} ahead; no test, "
                       "not counted)", "none")


def compare(fa: Report, da: LedgerData, fb: Report, db: LedgerData, opts: object) -> Verdict:
    confidence = float(getattr(opts, "confidence", 0.90))
    latency = str(getattr(opts, "sla_latency", "ttft"))
    alpha = 1.0 - confidence
    lines = [failures_line(fa, fb, alpha),
             _plain("availability", fa.service.availability, fb.service.availability, True, "{:.4%}")]
    lines += leak_lines(fa, fb)
    lines += traffic_lines(da, db, alpha, latency)
    lines.append(_plain("throughput (output tok/s)", fa.traffic.output_tokens_per_s, fb.traffic.output_tokens_per_s,
                        True, "{:.1f}"))
    ca, cb = fa.cost.per_million_tokens, fb.cost.per_million_tokens
    cur = {f.cost.prices.currency for f in (fa, fb) if f.cost.prices} if fa.cost.prices or fb.cost.prices else set()
    unit = f" {cur.pop()}" if len(cur) == 1 else ""
    lines.append(_plain("cost per M tokens", ca.cost if ca else None, cb.cost if cb else None, False, "{:,.2f}" + unit))
    lines.append(_plain("tokens per kWh", fa.cost.tokens_per_kwh, fb.cost.tokens_per_kwh, True, "{:,.0f}"))
    wins = [x for x in lines if x.better]
    count = {w: sum(1 for x in wins if x.better == w) for w in ("A", "B")}
    rel = lines[0]
    if not wins:
        overall = (f"No difference at {confidence:.0%} and {PRACTICAL_PCT:g} % on any tested figure "
                   f"(A: {fa.label}, B: {fb.label})")
        best = None
    else:
        best = "A" if count["A"] > count["B"] else "B" if count["B"] > count["A"] else rel.better
        names = ", ".join(x.figure for x in wins if x.better == best) if best else ""
        overall = (f"{best} ({fa.label if best == 'A' else fb.label}) is better: on {names} ({count[best]} of "
                   f"{len(wins)} differences, each significant at {confidence:.0%} and at least {PRACTICAL_PCT:g} %)"
                   if best else f"Mixed: A better on {count['A']}, B on {count['B']} figures")
    return Verdict(overall, best, confidence, PRACTICAL_PCT, lines)

