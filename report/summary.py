"""The verdict block: the five answers an operator came for, first, as lines of text.

(1) how reliable the box is (MTBF with its bounds; availability, planned vs unplanned
downtime), (2) how fast each process leaks, per memory kind, (3) when it runs out of memory
(only for a leak shown), (4) which SLA tier it met in each hour, (5) what a million tokens cost.
Then recycles, traffic, where its slowest first tokens waited, the soak's own view when one
ran, thermals, the causes of the leaks shown (attribution, for a process and memory kind the
leak rule holds for), and a line per replica when there are several. Built from the typed figures only, so the text report, the HTML
and the JSON (`summary`) say the same.
"""

from __future__ import annotations

from vllm_guard.core.reliability import ServiceFigures

from . import cost, sla, tail
from .figures import (
    LeakFigures, ProcessLeak, ReplicaFigures, Report, SoakFigures, Summary, ThermalFigures, TrafficFigures,
)
from .memory import hours


def _h(v: float | None) -> str:
    return "-" if v is None else hours(v)


def _s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f} s" if v < 600 else _h(v / 3600)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v >= 0.1 else f"{v * 1000:.1f} ms"


def mtbf_line(s: ServiceFigures) -> str:
    if not s.present or s.mtbf is None:
        return f"MTBF: {s.note or 'no runtime data'}"
    return f"MTBF {s.mtbf.headline()}"


def availability_line(s: ServiceFigures) -> str:
    if not s.present or s.availability is None:
        return "Availability: -"
    obs = s.observed_h * 3600 or 1.0
    pl, un = s.downtime_planned_s, s.downtime_unplanned_s
    return (f"Availability {100 * s.availability:.3f} % of {_h(s.observed_h)}: planned downtime "
            f"(recycles) {_s(pl)} ({100 * pl / obs:.2f} %), unplanned {_s(un)} ({100 * un / obs:.2f} %)")


def recycles_line(s: ServiceFigures) -> str:
    if not s.present:
        return "Recycles: -"
    planned = s.recycles_scheduled + s.recycles_preventive
    per_gen = s.requests_served / s.generations if s.generations else 0
    return (f"Recycles: {planned} planned ({s.recycles_scheduled} scheduled, {s.recycles_preventive} preventive), "
            f"{s.failures_unplanned} unplanned; {s.requests_served} requests in {s.generations} "
            f"generation{'' if s.generations == 1 else 's'} ({per_gen:.0f} per generation)")


def _box(leak: LeakFigures) -> list[ProcessLeak]:
    return [p for p in leak.processes if p.replica is None and p.metric in ("rss_mb", "gpu_mb", "swap_mb")]


def leak_lines(leak: LeakFigures) -> list[str]:
    if not leak.present:
        return [f"Leaks: {leak.note}"]
    procs = _box(leak)
    shown = [p for p in procs if p.leak]
    if shown:
        return [f"Leak {p.verdict}" for p in shown]
    judged = [p for p in procs if p.per_100_requests is not None]
    if not judged:
        return [f"Leaks: no leak shown yet ({len(procs)} process/memory series, none with enough points after "
                f"the {leak.warmup_requests}-request warm-up)"]
    top = max(judged, key=lambda p: p.per_100_requests.slope if p.per_100_requests else 0.0)
    return [f"Leaks: none shown in {len(procs)} process/memory series; fastest: {top.verdict}"]


def oom_line(leak: LeakFigures) -> str:
    fc = [p for p in _box(leak) if p.time_to_oom_h is not None]
    if not fc:
        return "Out of memory: no forecast (no leak shown)" if leak.present else "Out of memory: -"
    p = min(fc, key=lambda p: p.time_to_oom_h or 0.0)
    assert p.time_to_oom_h is not None
    return f"Out of memory: first {p.verdict.split(':')[0]} in {hours(p.time_to_oom_h)} at the current leak"


def traffic_line(t: TrafficFigures) -> str:
    if not t.present:
        return f"Traffic: {t.note}"
    tok = f", {t.output_tokens_per_s:.4g} output tok/s" if t.output_tokens_per_s else ""
    rate = f"{t.throughput_rps:.3g} req/s" if t.throughput_rps else "-"
    return (f"Traffic ({t.source}): {t.requests} requests in {_h(t.span_s / 3600)}, {rate}{tok}; "
            f"TTFT p50 {_ms(t.ttft_s.p50)} p99 {_ms(t.ttft_s.p99)}; ITL p50 {_ms(t.itl_s.p50)} p99 {_ms(t.itl_s.p99)}; "
            f"E2E p50 {_ms(t.e2e_s.p50)} p99 {_ms(t.e2e_s.p99)}; failed {t.failed}, rejected {t.rejected}, "
            f"client gone {t.disconnected}")


def soak_line(s: SoakFigures) -> str | None:
    if not s.present:
        return None
    return (f"Soak (its own client view): {s.requests} requests, errors {s.failed} ({100 * (s.error_rate or 0):.3g} %); "
            f"TTFT p99 {_ms(s.ttft_s.p99)} (from the scheduled send {_ms(s.ttft_sched_s.p99)}); "
            f"E2E p99 {_ms(s.e2e_s.p99)}")


def thermal_line(t: ThermalFigures) -> str:
    if not t.present:
        return f"Thermals: {t.note}"
    parts = []
    for g in t.gpus:
        drop = "-" if g.clock_drop_pct is None else f"{g.clock_drop_pct:.1f} %"
        hot = "-" if g.max_temp_c is None else f"{g.max_temp_c:.0f} C"
        parts.append(f"{g.name}: throttled {_pct(g.throttled_share)} of the time (heat/HW), power-capped "
                     f"{_pct(g.power_capped_share)}, clock drop {drop} (worst window), max {hot}")
    return "Thermals: " + "; ".join(parts)


def replica_line(r: ReplicaFigures) -> str:
    s = r.service
    mtbf = s.mtbf.headline() if s.present and s.mtbf is not None else "-"
    leaks = ", ".join(p.verdict.split(":")[0] for p in r.leaks) or "none shown"
    t = r.traffic
    lat = f"TTFT p99 {_ms(t.ttft_s.p99)}, {t.requests} requests" if t.present else "no requests recorded"
    return f"Replica {r.replica}: MTBF {mtbf}; SLA {r.sla_run_tier or '-'} in every hour; {lat}; leaks: {leaks}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def summary(r: Report) -> Summary:
    """The verdict lines (in order) and the figures they quote, for JSON readers."""
    s = r.service
    lines = [mtbf_line(s), availability_line(s), *leak_lines(r.leak), oom_line(r.leak),
             f"SLA: {sla.headline(r.sla)}", f"Cost: {cost.headline(r.cost)}", recycles_line(s), traffic_line(r.traffic)]
    if r.tail.present:
        lines.append(tail.headline(r.tail))
    soak = soak_line(r.soak)
    if soak:
        lines.append(soak)
    lines.append(thermal_line(r.thermal))
    shown = {(p.role, p.metric) for p in _box(r.leak) if p.leak}
    lines += [f"Leak cause: {a.line}" for a in r.attribution.processes if a.line and (a.role, a.metric) in shown]
    if len(r.replicas) > 1:
        lines += [replica_line(x) for x in r.replicas]
    m = s.mtbf
    return Summary(
        lines=lines, mtbf_h=m.mtbf_h if m else None, mtbf_low_h=m.two_sided_low_h if m else None,
        mtbf_high_h=m.two_sided_high_h if m else None, mtbf_lower_one_sided_h=m.lower_one_sided_h if m else None,
        failures_unplanned=s.failures_unplanned if s.present else None, availability=s.availability,
        downtime_planned_s=s.downtime_planned_s if s.present else None,
        downtime_unplanned_s=s.downtime_unplanned_s if s.present else None,
        leaks=[p for p in _box(r.leak) if p.leak], sla_run_tier=r.sla.run_tier,
        cost_per_million_tokens=r.cost.per_million_tokens.cost if r.cost.per_million_tokens else None)
