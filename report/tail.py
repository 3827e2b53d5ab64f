"""Where the slowest first tokens waited: is the TTFT tail the guard's, or the traffic's and vLLM's?

Each request the runtime served with a first token (its per-request rows, `edge_requests`) waited
from its arrival to that token. The report sets that wait beside the moments the runtime
recorded, and labels it with the first of these kinds it overlapped:

- `gap`: no generation served (a gated or cold recycle's downtime; a crash until the service was
  restored);
- `switch`: an overlap's switch, from the moment new requests went to the new generation until
  the old one's processes were gone (the two compute at once there);
- `standby`: another generation of the replica doing its engine's start beside the serving one,
  on the device they share (`core.phases.engine_work`: vLLM's profile run, its graph capture...),
  with the part;
- `beside`: the rest of such a start (imports, API server, parked at its gate): no engine work of
  its own; so is a start the ledger holds no phases for yet (the runtime writes them when a
  generation is ready and when it ends: a standby still parked has none);
- `none`: none of these: the load, or vLLM itself.

The counts over the slowest 1 % stand beside the counts over every request, so a kind of moment
over-represented in the tail stands out. Pure: rows in, figures out (numpy, one pass per moment
over the requests it can touch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from vllm_guard.core.ledger import GenerationRow, RuntimeHistory
from vllm_guard.core.phases import UNDER_WAY, engine_work
from vllm_guard.core.timefmt import epoch, iso_from_epoch

from .figures import SlowRequest, TailCount, TailFigures
from .ledgerread import Waits

KINDS = ("gap", "switch", "standby", "beside", "none")  # a wait takes the first kind it overlapped
QUANTILE = 0.99  # the tail: the slowest 1 %
SHOWN = 10  # slowest requests listed


@dataclass(frozen=True)
class Moment:
    """A stretch of time the runtime recorded that a request may have waited through."""

    start: float
    end: float
    kind: str
    replica: int
    what: str
    part: str = ""  # a start's part (standby, beside)


def _phases(g: GenerationRow) -> dict[str, float]:
    try:
        raw = json.loads(g.start_phases or "[]")
        return {str(p): float(s) for p, s in raw}
    except (ValueError, TypeError):
        return {}  # a row of another version: no parts for this start


def _start_moments(g: GenerationRow, serving: list[tuple[float, float]]) -> list[Moment]:
    """The stretches of a start made beside a serving generation of its replica (`serving`: the
    other generations' spans from ready to end)."""
    t0 = epoch(g.started_at)
    if t0 is None or not any(a <= t0 < b for a, b in serving):
        return []  # a first start, or one after a gap: nothing served beside it
    at = _phases(g)
    live = min(epoch(g.ready_at) or np.inf, epoch(g.ended_at) or np.inf)
    if not at:  # still under way (most often parked: the runtime writes phases at ready and at the end)
        return [Moment(t0, live, "beside", g.replica,
                       f"generation {g.generation} starting (no phases in the ledger yet)",
                       "its start (no phases in the ledger yet)")]
    work = engine_work(at) or (np.inf, np.inf)
    parked, opened = at.get("parked"), at.get("gate_opened")
    if parked is not None and opened is not None and opened > parked:  # parked: nothing else until the gate
        at = {p: s for p, s in at.items() if not parked < s < opened}
    marks = sorted((s, p) for p, s in at.items())
    out = []
    for (a, p), (b, _) in zip(marks, [*marks[1:], (np.inf, "")]):
        if t0 + a >= live or p in ("ready", "first_request"):
            continue
        kind = "standby" if work[0] <= a < work[1] and p != "parked" else "beside"
        part = UNDER_WAY.get(p, p)
        out.append(Moment(t0 + a, min(t0 + b, live), kind, g.replica, f"generation {g.generation} starting: {part}",
                          part))
    return out


def moments(h: RuntimeHistory) -> list[Moment]:
    """Every recorded stretch of the runtime's that a request may have waited through."""
    gens = {g.generation: g for g in h.generations}  # one number, one generation (across replicas too)
    out: list[Moment] = []
    for r in h.recycles:
        t = epoch(r.ready_at)
        if t is None:
            continue
        if r.downtime_s:
            out.append(Moment(t - r.downtime_s, t, "gap", r.replica, f"{r.strategy or 'a'} recycle of generation "
                              f"{r.generation} ({r.downtime_s:.2f} s without a serving generation)"))
        elif r.strategy == "overlap" and (old := gens.get(r.generation)) and (e := epoch(old.ended_at)) is not None:
            out.append(Moment(t, e, "switch", r.replica, f"the overlap switch from generation {r.generation}"))
    for f in h.failures:
        a, b = epoch(f.at), epoch(f.restored_at)
        if a is not None:
            rep = gens[f.generation].replica if f.generation in gens else 0
            out.append(Moment(a, b if b is not None else a, "gap", rep, f"{f.kind} of generation {f.generation}"))
    spans = {g.generation: (epoch(g.ready_at), epoch(g.ended_at) or np.inf) for g in h.generations}
    for g in h.generations:  # each row's times parsed once, above
        out += _start_moments(g, [(a, b) for o in h.generations if o.replica == g.replica and o is not g
                                  for a, b in [spans[o.generation]] if a is not None])
    return out


def label(w: Waits, ms: list[Moment]) -> np.ndarray:
    """For each request, the index in `ms` of the moment its wait is labelled with (-1: none)."""
    n = w.arrived.size
    out = np.full(n, -1)
    if n == 0 or not ms:
        return out
    order = np.argsort(w.arrived, kind="stable")
    arr, end, rep = w.arrived[order], (w.arrived + w.ttft_s)[order], w.replica[order]
    longest = float(np.nanmax(w.ttft_s))
    rank = {k: i for i, k in enumerate(KINDS)}
    # the lowest priority first, so a higher one (or an earlier moment of the same kind) overwrites
    for i in sorted(range(len(ms)), key=lambda i: (-rank[ms[i].kind], -ms[i].start)):
        m = ms[i]
        lo = int(np.searchsorted(arr, m.start - longest, "left"))
        hi = int(np.searchsorted(arr, m.end, "right"))
        if lo >= hi:
            continue
        hit = (end[lo:hi] >= m.start) & (rep[lo:hi] == m.replica)
        out[order[lo:hi][hit]] = i
    return out


def kinds_and_parts(w: Waits, h: RuntimeHistory) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Moment]]:
    """Per request: the kind of moment its wait is labelled with ("none" for none), the start's
    part ("" for none) and the moment's index in the list also returned (-1: none)."""
    ms = moments(h)
    lab = label(w, ms)
    kind = np.array([ms[i].kind if i >= 0 else "none" for i in lab])
    part = np.array([ms[i].part if i >= 0 else "" for i in lab])
    return kind, part, lab, ms


def tail_report(w: Waits, h: RuntimeHistory) -> TailFigures:
    n = w.arrived.size
    if n == 0:
        return TailFigures(False, "no request with a first token recorded (the runtime's per-request rows: an older "
                                  "runtime kept none, or `request_retention` is 0)")
    kind, part, lab, ms = kinds_and_parts(w, h)
    slow = np.argsort(-w.ttft_s, kind="stable")[:max(1, int(round(n * (1.0 - QUANTILE))))]
    counts = [TailCount(k, "", int((kind[slow] == k).sum()), int((kind == k).sum())) for k in KINDS]
    pairs = sorted({(k, p) for k, p in zip(kind.tolist(), part.tolist()) if p})
    parts = [TailCount(k, p, int(((kind[slow] == k) & (part[slow] == p)).sum()), int(((kind == k) & (part == p)).sum()))
             for k, p in pairs]
    rows = [SlowRequest(iso_from_epoch(float(w.arrived[i])) or "", int(w.replica[i]), int(w.generation[i]),
                        float(w.ttft_s[i]), str(kind[i]), ms[lab[i]].what if lab[i] >= 0 else "")
            for i in slow[:SHOWN]]
    return TailFigures(True, "", QUANTILE, n, int(slow.size), float(w.ttft_s[slow[-1]]), counts, parts, rows)


def headline(t: TailFigures) -> str:
    """The summary's line: where the slowest 1 % waited."""
    if not t.present:
        return f"TTFT tail: {t.note}"
    c = {x.kind: x.tail for x in t.kinds}
    thr = "-" if t.threshold_s is None else f"{t.threshold_s * 1000:.1f} ms"
    return (f"TTFT tail (the slowest {100 * (1 - t.quantile):.0f} %, {t.slowest} of {t.requests} requests, "
            f"≥ {thr}): {c['gap']} in a gap without a serving generation, {c['switch']} at an overlap's switch, "
            f"{c['standby']} while a successor's engine started beside the serving one, {c['beside']} while one "
            f"started otherwise (imports, parked), "
            f"{c['none']} at no moment of the runtime")
