"""The one MTBF: up time, unplanned events, MTBF with chi-square bounds, MTTR, availability.

Every place that shows MTBF (the watchdog's exporter, `vllm-guard report` in text, JSON and
HTML, the runtime's metrics port) calls `service_figures` on the runtime's tables, so they agree.

Rules (GUIDE §3, MIL-HDBK-781 time-truncated test):
- Up time is the sum of each generation's serving interval (ready -> end; serving -> now);
  downtime is the gaps between one serving generation's end and the next one's ready, per
  replica (planned after a recycle, unplanned after a failure or a reboot). A generation that
  never served (a successor stopped while it started) opens no gap of its own: the outage it
  sits in is the last serving generation's gap, counted once; if it failed, that gap is
  unplanned from its failure on. With replicas, both are replica-hours.
- An unplanned event is a generation that ended `unplanned`, or that has a `failures` row of
  class unplanned (a crash and its failure row are one event), or a host reboot between two
  generations (a boot_id change). Planned recycles (scheduled, preventive) never count.
- Failures are matched to the generation *row* they happened in (number and time), so
  generation numbers reused by an older runtime still count as separate events.
- MTBF = T / r; one-sided lower bound 2T / chi2(1 - a; 2r + 2); two-sided interval
  [2T / chi2(1 - a/2; 2r + 2), 2T / chi2(a/2; 2r)]. With r = 0 only the lower bound exists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .ledger import FailureRow, GenerationRow, RecycleRow, RuntimeHistory, UNPLANNED
from .timefmt import epoch, iso_from_epoch


@dataclass(frozen=True)
class MTBF:
    up_hours: float
    failures: int
    confidence: float
    mtbf_h: float | None  # None when r = 0 (no finite point estimate)
    lower_one_sided_h: float
    two_sided_low_h: float | None
    two_sided_high_h: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def headline(self) -> str:
        """`240 h (90 % interval 93-881 h)` or, with no failure, `>= 313 h at 90 %`."""
        pct = f"{self.confidence * 100:g} %"
        if self.mtbf_h is None:
            return f">= {_h(self.lower_one_sided_h)} at {pct} (no unplanned failure in {_h(self.up_hours)})"
        return (f"{_h(self.mtbf_h)} ({pct} interval {_h(self.two_sided_low_h)} - {_h(self.two_sided_high_h)}, "
                f"{self.failures} unplanned in {_h(self.up_hours)})")


def _h(hours: float | None) -> str:
    if hours is None:
        return "-"
    if hours < 1:
        return f"{hours * 60:.3g} min"
    return f"{hours:.3g} h"


def mtbf(up_hours: float, failures: int, confidence: float = 0.90, bounds: bool = True) -> MTBF:
    """MTBF with chi-square bounds at `confidence` (0.90 -> 90 % lower bound and 90 % interval).
    `bounds=False` gives the point estimate alone (NaN bounds) without importing scipy: the
    watchdog's exporter runs in a process that must stay light."""
    if up_hours < 0 or failures < 0:
        raise ValueError(f"up_hours={up_hours}, failures={failures}: must not be negative")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence has value {confidence!r}: must be in (0, 1)")
    if not bounds:
        nan = math.nan
        return MTBF(up_hours, failures, confidence, up_hours / failures if failures else None, nan,
                    nan if failures else None, nan if failures else None)
    from scipy.special import chdtri  # inverse chi-square survival: chi2.ppf(q, k) = chdtri(k, 1 - q)

    def chi2_ppf(q: float, k: int) -> float:
        return float(chdtri(k, 1.0 - q))

    alpha = 1.0 - confidence
    t2 = 2.0 * up_hours
    lower = float(t2 / chi2_ppf(1.0 - alpha, 2 * failures + 2))
    if failures == 0:
        return MTBF(up_hours, 0, confidence, None, lower, None, None)
    lo = float(t2 / chi2_ppf(1.0 - alpha / 2.0, 2 * failures + 2))
    hi = float(t2 / chi2_ppf(alpha / 2.0, 2 * failures))
    return MTBF(up_hours, failures, confidence, up_hours / failures, lower, lo, hi)


def availability(up_s: float, down_s: float) -> float | None:
    """Share of wall time in service; None when nothing was observed."""
    total = up_s + down_s
    return None if total <= 0 else up_s / total


@dataclass(frozen=True)
class UnplannedEvent:
    generation: int
    kind: str
    at: str | None
    restored_at: str | None
    detail: str | None
    exit_code: int | None
    restore_s: float | None


@dataclass(frozen=True)
class ServiceFigures:
    present: bool
    note: str = ""
    observed_from: str | None = None
    observed_to: str | None = None
    observed_h: float = 0.0
    up_h: float = 0.0
    down_h: float = 0.0
    downtime_planned_s: float = 0.0
    downtime_unplanned_s: float = 0.0
    availability: float | None = None
    generations: int = 0
    failures_unplanned: int = 0
    mtbf: MTBF | None = None
    mttr_s: float | None = None
    unplanned_events: list[UnplannedEvent] = field(default_factory=list)
    reboots: list[dict[str, Any]] = field(default_factory=list)
    recycles_scheduled: int = 0
    recycles_preventive: int = 0
    recycles: list[RecycleRow] = field(default_factory=list)
    requests_served: int = 0
    gpu_names: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    vllm_versions: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recycles"] = {
            "scheduled": self.recycles_scheduled, "preventive": self.recycles_preventive,
            "list": [{"generation": r.generation, "trigger": r.trigger, "class": r.cls, "started_at": r.started_at,
                      "in_flight": r.in_flight, "queued": r.queued, "max_queued": r.max_queued,
                      "duration_s": r.duration_s, "downtime_s": r.downtime_s, "strategy": r.strategy,
                      "replica": r.replica} for r in self.recycles],
        }
        d.pop("recycles_scheduled")
        d.pop("recycles_preventive")
        return d


def _failure_owner(f: FailureRow, gens: list[GenerationRow]) -> int | None:
    """Index of the generation row a failure belongs to: same number, latest start <= its time."""
    at = epoch(f.at)
    best: int | None = None
    for i, g in enumerate(gens):
        if g.generation != f.generation:
            continue
        start = epoch(g.started_at)
        if at is None or start is None or start <= at + 1.0:
            best = i
    return best


def now_or_end(gens: list[GenerationRow], rows: list[int], now: float) -> float:
    """Where an unrestored outage ends so far: the last of the later generations' ends (the
    ledger's observed window), or now while one of them is still open."""
    ends = [epoch(gens[j].ended_at) for j in rows]
    return now if any(e is None for e in ends) else max(e for e in ends if e is not None)


def service_figures(h: RuntimeHistory, now: float, confidence: float = 0.90, bounds: bool = True) -> ServiceFigures:
    """Figures for the whole ledger (all replicas) from the runtime's tables; pure. `bounds`
    as in `mtbf()`."""
    gens = h.generations
    if not gens:
        return ServiceFigures(False, "no generations in this ledger (the runtime did not write here)")
    fail_by_row: dict[int, FailureRow] = {}
    for row in h.failures:
        if row.cls != UNPLANNED:
            continue
        owner = _failure_owner(row, gens)
        if owner is not None:
            fail_by_row.setdefault(owner, row)
    up_s = planned_down = unplanned_down = 0.0
    reboots: list[dict[str, Any]] = []
    events: dict[int, dict[str, Any]] = {}
    # The window opens when service first began: the first cold start is not an outage.
    start = epoch(gens[0].ready_at) or epoch(gens[0].started_at) or now
    end = start
    by_replica: dict[int, list[int]] = {}
    for i, g in enumerate(gens):
        by_replica.setdefault(g.replica, []).append(i)
    for i, g in enumerate(gens):
        ready, ended = epoch(g.ready_at), epoch(g.ended_at)
        stop = ended if ended is not None else now
        if ready is not None and stop > ready:
            up_s += stop - ready
        end = max(end, stop)
        unplanned = g.end_class == UNPLANNED or i in fail_by_row
        if unplanned:
            f: FailureRow | None = fail_by_row.get(i)
            events[i] = {"generation": g.generation, "kind": (f.kind if f else None) or g.end_reason or "unplanned",
                         "at": (f.at if f else None) or g.ended_at, "restored_at": f.restored_at if f else None,
                         "detail": f.detail if f else None, "exit_code": f.exit_code if f else None}
        same = by_replica[g.replica]
        k = same.index(i)
        if k + 1 >= len(same):
            continue
        nxt = gens[same[k + 1]]
        # restored means serving again: the first later generation of this replica that was ready
        later = same[k + 1:]
        served_at = next((n for n, j in enumerate(later) if epoch(gens[j].ready_at) is not None), None)
        served = gens[later[served_at]] if served_at is not None else None
        next_ready = epoch(served.ready_at) if served is not None else None
        if ready is None and next_ready is not None and any(epoch(gens[j].ready_at) is not None for j in same[:k]):
            # never served, inside the gap of the last generation that did: that gap counts it
            if unplanned and not events[i].get("restored_at"):
                events[i]["restored_at"] = iso_from_epoch(next_ready)
            continue
        if unplanned and next_ready is None:
            unplanned_down += max(0.0, now_or_end(gens, same[k + 1:], now) - stop)  # not restored (yet)
            continue
        next_ready = next_ready or epoch(nxt.started_at) or stop
        gap = max(0.0, next_ready - stop)
        rebooted = bool(g.boot_id and nxt.boot_id and g.boot_id != nxt.boot_id)
        if rebooted:
            reboots.append({"from_boot_id": g.boot_id, "to_boot_id": nxt.boot_id, "gap_from": iso_from_epoch(stop),
                            "gap_to": iso_from_epoch(next_ready), "gap_s": round(gap, 1)})
            if i not in events:
                events[i] = {"generation": g.generation, "kind": "host_reboot", "at": iso_from_epoch(stop),
                             "restored_at": iso_from_epoch(next_ready), "detail": "boot_id changed", "exit_code": None}
        if unplanned or rebooted:
            unplanned_down += gap
            if not events[i].get("restored_at"):
                events[i]["restored_at"] = iso_from_epoch(next_ready)
            continue
        # planned, unless a successor that never served failed inside it: unplanned from then on
        failed_in_gap = [t for j in later[:served_at or 0]
                         if (gens[j].end_class == UNPLANNED or j in fail_by_row)
                         and (t := epoch(gens[j].ended_at)) is not None]
        cut = min(max(min(failed_in_gap), stop), next_ready) if failed_in_gap and served is not None else next_ready
        planned_down += max(0.0, cut - stop)
        unplanned_down += max(0.0, next_ready - max(cut, stop))
    out_events = []
    for ev in events.values():
        a, b = epoch(ev["at"]), epoch(ev["restored_at"])
        out_events.append(UnplannedEvent(restore_s=round(b - a, 1) if a is not None and b is not None and b >= a
                                         else None, **ev))
    out_events.sort(key=lambda e: e.at or "")
    restores = [e.restore_s for e in out_events if e.restore_s is not None]
    observed = max(0.0, end - start)
    planned = [x for x in h.recycles if x.cls != UNPLANNED]
    return ServiceFigures(
        present=True,
        observed_from=iso_from_epoch(start), observed_to=iso_from_epoch(end), observed_h=round(observed / 3600, 4),
        up_h=round(up_s / 3600, 4), down_h=round((planned_down + unplanned_down) / 3600, 4),
        downtime_planned_s=round(planned_down, 1), downtime_unplanned_s=round(unplanned_down, 1),
        availability=availability(up_s, planned_down + unplanned_down),
        generations=len(gens), failures_unplanned=len(out_events), mtbf=mtbf(up_s / 3600.0, len(out_events), confidence, bounds),
        mttr_s=round(sum(restores) / len(restores), 1) if restores else None,
        unplanned_events=out_events, reboots=reboots,
        recycles_scheduled=sum(1 for x in planned if x.cls == "scheduled"),
        recycles_preventive=sum(1 for x in planned if x.cls == "preventive"),
        recycles=planned,
        requests_served=sum(g.requests_served or 0 for g in gens),
        gpu_names=sorted({g.gpu_name for g in gens if g.gpu_name}),
        models=sorted({g.model for g in gens if g.model}),
        vllm_versions=sorted({g.vllm_version for g in gens if g.vllm_version}),
        hosts=sorted({g.host for g in gens if g.host}),
    )


def of_replica(h: RuntimeHistory, replica: int) -> RuntimeHistory:
    """One replica's rows: its generations, its recycles, the failures of its generations."""
    gens = [g for g in h.generations if g.replica == replica]
    numbers = {g.generation for g in gens}
    return RuntimeHistory(gens, [r for r in h.recycles if r.replica == replica],
                          [f for f in h.failures if f.generation in numbers])


def replicas_of(h: RuntimeHistory) -> list[int]:
    return sorted({g.replica for g in h.generations})
