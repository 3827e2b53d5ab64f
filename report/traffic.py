"""What was served, minute by minute: latency, throughput and tokens from mergeable blocks.

A block is one minute of one replica's requests: counts by outcome, tokens, and histograms of
TTFT, E2E and ITL (`core.latency`). The runtime writes them for every request it served
(`edge_minutes`: production traffic, no soak needed); a soak's own requests are put into the
same blocks (by the minute they ended). Every figure of the report's traffic, SLA and compare
verdicts is a merge of blocks, so an hour, a replica or the whole box is the same sum, and a
minute is the unit a time-structured test resamples (`compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from vllm_guard.core.latency import Histogram
from vllm_guard.core.timefmt import iso_from_epoch

from .figures import HourTraffic, Quantiles, TrafficFigures
from .hist import Hist, merged
from .ledgerread import EdgeMinute, LedgerData

QS = (0.50, 0.95, 0.99)
SOAK_LATENCY = {"ttft": "ttft_s", "e2e": "e2e_s", "ttft_sched": "ttft_sched_s", "e2e_sched": "e2e_sched_s"}


@dataclass
class Block:
    t: float  # the minute's start, epoch seconds
    replica: int | None
    requests: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    disconnected: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_known: int = 0
    ttft: Hist = field(default_factory=Hist)
    e2e: Hist = field(default_factory=Hist)
    itl: Hist = field(default_factory=Hist)


def total(blocks: Iterable[Block], t: float = 0.0, replica: int | None = None) -> Block:
    """The sum of blocks (counts added, histograms merged): an hour, a replica, the run."""
    bs = list(blocks)
    return Block(t, replica, sum(b.requests for b in bs), sum(b.completed for b in bs), sum(b.failed for b in bs),
                 sum(b.rejected for b in bs), sum(b.disconnected for b in bs), sum(b.prompt_tokens for b in bs),
                 sum(b.output_tokens for b in bs), sum(b.usage_known for b in bs), merged(b.ttft for b in bs),
                 merged(b.e2e for b in bs), merged(b.itl for b in bs))


def from_edge(rows: Sequence[EdgeMinute]) -> list[Block]:
    """The runtime's minutes (rows of one minute and replica, e.g. across a restart, merged)."""
    out: dict[tuple[int, int], list[Block]] = {}
    for r in rows:
        out.setdefault((r.minute, r.replica), []).append(Block(
            float(r.minute), r.replica, r.requests, r.completed, r.failed, r.rejected, r.disconnected,
            r.prompt_tokens, r.completion_tokens, r.usage_known, r.ttft, r.e2e, r.itl))
    return [v[0] if len(v) == 1 else total(v, float(k[0]), k[1]) for k, v in sorted(out.items())]


def from_soak(req: dict[str, np.ndarray], errors: list[str | None], latency: str = "ttft") -> list[Block]:
    """The soak's requests by the minute they ended. `latency` picks the column the TTFT or E2E
    histogram holds (`ttft_sched`: from the scheduled send); every error is a failed request."""
    if not errors:
        return []
    ttft_col = SOAK_LATENCY["ttft_sched"] if latency == "ttft_sched" else "ttft_s"
    e2e_col = SOAK_LATENCY["e2e_sched"] if latency == "e2e_sched" else "e2e_s"
    ends = np.where(np.isfinite(req["ended_at"]), req["ended_at"], req["sent_at"])
    out: dict[float, tuple[Block, list[Histogram]]] = {}
    for i, err in enumerate(errors):
        if not math.isfinite(ends[i]):
            continue
        t = math.floor(ends[i] / 60.0) * 60.0
        b, hs = out.setdefault(t, (Block(t, None), [Histogram(), Histogram(), Histogram()]))
        b.requests += 1
        if err is not None:
            b.failed += 1
            continue
        b.completed += 1
        tok = req["output_tokens"][i]
        if math.isfinite(tok):
            b.output_tokens += int(tok)
            b.usage_known += 1
        for h, col in zip(hs, (ttft_col, e2e_col, "itl_mean_s")):
            v = req[col][i]
            if math.isfinite(v):
                h.add(float(v))
    for b, hs in out.values():
        b.ttft, b.e2e, b.itl = (Hist.of(h) for h in hs)
    return [out[k][0] for k in sorted(out)]


def blocks_of(d: LedgerData, latency: str = "ttft") -> tuple[list[Block], str | None]:
    """The runtime's blocks when it recorded any, else the soak's; with the source's name."""
    edge = from_edge(d.edge_minutes)
    if edge:
        return edge, "runtime"
    soak = from_soak(d.requests, d.errors, latency)
    return (soak, "soak") if soak else ([], None)


def per_minute(blocks: Iterable[Block]) -> list[Block]:
    """Replicas merged: one block per minute (the box)."""
    out: dict[float, list[Block]] = {}
    for b in blocks:
        out.setdefault(b.t, []).append(b)
    return [total(v, t) for t, v in sorted(out.items())] if any(len(v) > 1 for v in out.values()) else \
        [v[0] for _, v in sorted(out.items())]


def quantiles(h: Hist) -> Quantiles:
    v = [h.quantile(q) for q in QS]
    return Quantiles(*(None if x is None or math.isinf(x) else x for x in v))


def window(blocks: Sequence[Block], within: tuple[float, float] | None = None) -> tuple[float, float]:
    """First start and last end of the minutes; the first and last minute are partial, so
    `within` (the first arrival and last end that request rows know) trims them when it falls
    inside them (the rows may cover only the retention's end of the run)."""
    lo, hi = min(b.t for b in blocks), max(b.t for b in blocks) + 60.0
    if within is not None:
        if lo <= within[0] < lo + 60.0:
            lo = within[0]
        if hi - 60.0 < within[1] <= hi:
            hi = within[1]
    return lo, hi


def span_s(blocks: Sequence[Block], within: tuple[float, float] | None = None) -> float:
    if not blocks:
        return 0.0
    lo, hi = window(blocks, within)
    return max(hi - lo, 1.0)


def exact_span(d: LedgerData, source: str | None) -> tuple[float, float] | None:
    """First start and last end of the requests behind the blocks, when the ledger knows them."""
    if source == "runtime":
        return d.edge_span
    sent, ended = d.requests.get("sent_at"), d.requests.get("ended_at")
    if source == "soak" and sent is not None and ended is not None and np.isfinite(sent).any() \
            and np.isfinite(ended).any():
        return float(np.nanmin(sent)), float(np.nanmax(ended))
    return None


def _rate(n: float, span: float) -> float | None:
    return n / span if span > 0 else None


def traffic(blocks: Sequence[Block], source: str | None, replica: int | None = None,
            note_none: str = "no requests recorded", within: tuple[float, float] | None = None) -> TrafficFigures:
    if not blocks:
        return TrafficFigures(False, note_none, source, replica)
    span = span_s(blocks, within)
    t0 = min(b.t for b in blocks)
    hours: list[HourTraffic] = []
    per_hour = {h: total(sel) for h, sel in by_hour(blocks).items()}
    tot = total(per_hour.values())
    for h, ht in per_hour.items():
        hs = min(span - 3600.0 * h, 3600.0)
        hours.append(HourTraffic(h, iso_from_epoch(t0 + 3600.0 * h) or "", ht.requests, ht.completed, ht.failed,
                                 quantiles(ht.ttft), quantiles(ht.e2e), quantiles(ht.itl),
                                 _rate(ht.requests, hs), _rate(ht.output_tokens, hs) if ht.usage_known else None))
    served = tot.completed + tot.failed
    return TrafficFigures(
        present=True, note="", source=source, replica=replica, minutes=len({b.t for b in blocks}),
        requests=tot.requests, completed=tot.completed, failed=tot.failed, rejected=tot.rejected,
        disconnected=tot.disconnected, error_rate=tot.failed / served if served else None,
        ttft_s=quantiles(tot.ttft), e2e_s=quantiles(tot.e2e), itl_s=quantiles(tot.itl), span_s=span,
        throughput_rps=_rate(tot.requests, span), prompt_tokens=tot.prompt_tokens, output_tokens=tot.output_tokens,
        usage_known=tot.usage_known, output_tokens_per_s=_rate(tot.output_tokens, span) if tot.usage_known else None,
        per_hour=hours)


def by_hour(blocks: Sequence[Block]) -> dict[int, list[Block]]:
    """Blocks grouped by hour since the first one, in order."""
    if not blocks:
        return {}
    t0 = min(b.t for b in blocks)
    out: dict[int, list[Block]] = {}
    for b in blocks:
        out.setdefault(int((b.t - t0) // 3600), []).append(b)
    return dict(sorted(out.items()))


def merged_latency(blocks: Iterable[Block], which: str) -> Hist:
    return merged(getattr(b, which) for b in blocks)
