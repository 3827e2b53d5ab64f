"""The terminal view of a report's typed figures (and the side-by-side compare table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_guard.core.stats import Slope

from .figures import Quantiles, Report

if TYPE_CHECKING:
    from .compare import Verdict


def fmt(v: Any, unit: str = "", nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}{unit}"
    return f"{v}{unit}"


def g4(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.4g}{unit}"


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _interval(s: Slope | None, nd: int = 2) -> str:
    return "-" if s is None else f"{s.slope:.{nd}f} [{s.low:.{nd}f}, {s.high:.{nd}f}]"


def _q(name: str, q: Quantiles) -> str:
    return f"  {name:<13} p50 {ms(q.p50)}  p95 {ms(q.p95)}  p99 {ms(q.p99)}"


def _patch_line(p: dict[str, Any]) -> str:
    """`engine_core: fault-injection, idle-release` (applied patches of one process's report)."""
    applied = [name for name, st in p["patches"].items() if st["state"] == "applied"]
    return f"{p['process']}: {', '.join(applied) or 'none applied'}"


def verdict_block(f: Report) -> list[str]:
    """The answers first: the summary's lines (the same in HTML and JSON)."""
    return [f"  {line}" for line in f.summary.lines]


def _service(f: Report) -> list[str]:
    s = f.service
    if not s.present or s.mtbf is None:
        return ["SERVICE", f"  {s.note}"]
    m = s.mtbf
    conf = int(round(100 * m.confidence))
    two = f"{g4(m.two_sided_low_h)}-{g4(m.two_sided_high_h)} h" if m.two_sided_low_h is not None else "n/a (no failure)"
    out = [
        "SERVICE",
        f"  observed {fmt(s.observed_h, ' h', 3)}, up {fmt(s.up_h, ' h', 3)}, availability "
        f"{fmt(None if s.availability is None else 100 * s.availability, ' %', 3)}",
        f"  unplanned failures {s.failures_unplanned}; MTBF {g4(m.mtbf_h, ' h')} "
        f"(>= {g4(m.lower_one_sided_h)} h at {conf} % one-sided; {conf} % two-sided {two}); MTTR {fmt(s.mttr_s, ' s')}",
        f"  downtime planned {fmt(s.downtime_planned_s, ' s')}, unplanned {fmt(s.downtime_unplanned_s, ' s')}; "
        f"host reboots {len(s.reboots)}",
        f"  requests served {s.requests_served} in {s.generations} generations (the runtime's count)",
        f"  recycles: {s.recycles_scheduled} scheduled, {s.recycles_preventive} preventive",
    ]
    for r in s.recycles[-10:]:
        out.append(f"    - gen {r.generation} {r.trigger} ({r.cls}) at {r.started_at}, in flight {r.in_flight}, "
                   f"queued {r.queued}, took {fmt(r.duration_s, ' s')}")
    for e in s.unplanned_events[-10:]:
        out.append(f"    ! gen {e.generation} {e.kind} at {e.at}, restored after {fmt(e.restore_s, ' s')}")
    if len(f.replicas) > 1:
        for rep in f.replicas:
            rs = rep.service
            out.append(f"  replica {rep.replica}: up {fmt(rs.up_h, ' h', 3)}, unplanned {rs.failures_unplanned}, "
                       f"MTBF {rs.mtbf.headline() if rs.mtbf else '-'}, availability "
                       f"{fmt(None if rs.availability is None else 100 * rs.availability, ' %', 3)}")
    return out


def _leaks(f: Report) -> list[str]:
    lk = f.leak
    out = ["LEAKS" + (f"  (source: {lk.source} readings; warm-up {lk.warmup_requests} requests, {lk.warmup_from}; "
                      f"noise floor {lk.noise_floor_mb_per_100:g} MB/100 requests; {lk.confidence:.0%} intervals)"
                      if lk.present else "")]
    if not lk.processes:
        out.append(f"  {lk.note}")
    for p in lk.processes:
        who = f"replica {p.replica} " if p.replica is not None else ""
        out.append(f"  {who}{p.role:<11} {p.metric:<7} {_interval(p.per_100_requests)} MB/100 req, "
                   f"{_interval(p.per_hour)} MB/h, last {fmt(p.last_mb, ' MB')}, {p.points} points, "
                   f"{p.generations} generation(s): {'LEAK' if p.leak else 'no leak shown'}; "
                   f"time to OOM {fmt(p.time_to_oom_h, ' h')}")
    att = f.attribution
    for a in att.processes:
        if a.features:
            feats = ", ".join(f"{x.feature} {x.mb_per_unit:+.3g} [{x.low:.3g}, {x.high:.3g}] MB/{x.unit}"
                              for x in a.features)
            why = f" ({a.withheld})" if a.withheld else ""
            out.append(f"  cause? {a.role} {a.metric}: {feats}" + (f" -> {a.cause}" if a.cause else why))
    if att.counters_missing:
        out.append(f"  (not counted by this runtime, so not attributed: {', '.join(att.counters_missing)})")
    for gen, procs in sorted((f.patches or {}).items()):
        out.append(f"  patches, generation {gen}: " + "; ".join(_patch_line(p) for p in procs.values()))
    return out


def _thermal(f: Report) -> list[str]:
    t = f.thermal
    out = ["THERMAL"] + ([f"  {t.note}"] if not t.present else [])
    for g in t.gpus:
        out.append(f"  {g.name} {g.uuid}: max {fmt(g.max_temp_c, ' C', 0)}, throttled "
                   f"{fmt(None if g.throttled_share is None else 100 * g.throttled_share, ' %')}, power capped "
                   f"{fmt(None if g.power_capped_share is None else 100 * g.power_capped_share, ' %')}, SM clock p50 "
                   f"{fmt(g.sm_clock_p50_mhz, ' MHz', 0)} of {fmt(g.sm_clock_max_mhz, ' MHz', 0)} "
                   f"(drop {fmt(g.clock_drop_pct, ' %')} in the worst window); throughput throttled "
                   f"{fmt(g.throughput_throttled_rps, ' req/s', 2)} vs {fmt(g.throughput_unthrottled_rps, ' req/s', 2)}")
    return out


def _sla(f: Report) -> list[str]:
    sl = f.sla
    out = [f"SLA (P99 per hour of {sl.source or '-'} requests; a failed request meets no bound)"]
    if not sl.present:
        out.append(f"  {sl.note}")
    for h in sl.per_hour:
        out.append(f"  hour {h.hour} from {h.start}: {h.requests} requests ({h.failed} failed), {sl.latency} P99 "
                   f"{ms(h.p99_s)} -> {h.tier or 'no tier'}")
    return out


def _cost(f: Report) -> list[str]:
    c = f.cost
    out = ["COST", f"  energy {fmt(c.energy_kwh, ' kWh', 4)}, mean power {fmt(c.mean_power_w, ' W', 0)} over "
                   f"{c.gpus_metered} GPU(s); output tokens {fmt(c.output_tokens)}"
                   + (f" ({c.tokens_from})" if c.tokens_from else "") + f"; tokens/kWh {fmt(c.tokens_per_kwh, '', 0)}"]
    pr = c.prices
    if c.per_million_tokens and pr:
        pm = c.per_million_tokens
        out.append(f"  {pm.cost:,.2f} {pr.currency} per M output tokens at {pm.output_tokens_per_s:.4g} tok/s "
                   f"({pm.hourly:,.3f} {pr.currency}/h; power {pm.power_w:.0f} W from {pm.power_from})")
    if c.tco and pr:
        t = c.tco
        parts = ", ".join(f"{k} {fmt(v, '', 0)}" for k, v in t.parts.items())
        out.append(f"  {t.years:g}-year TCO {fmt(t.total, '', 0)} {pr.currency} ({parts}); outages/month "
                   f"{fmt(t.outages_per_month, '', 2)} from {t.outages_from}")
        out.append(f"  prices: {pr.box} from {pr.file}" + (f" ({pr.source})" if pr.source else ""))
    out += [f"  {n}" for n in c.notes]
    return out


def _traffic(f: Report) -> list[str]:
    t = f.traffic
    out = [f"TRAFFIC ({t.source or '-'}: " + ("every request the runtime's proxy served, per minute)"
                                                if t.source == "runtime" else "the soak's own requests)")]
    if not t.present:
        return out + [f"  {t.note}"]
    out.append(f"  requests {t.requests} in {t.minutes} minutes: completed {t.completed}, failed {t.failed}, "
               f"rejected {t.rejected}, client gone {t.disconnected}; {fmt(t.throughput_rps, ' req/s', 2)}, "
               f"{fmt(t.output_tokens_per_s, ' output tok/s')}; tokens in {t.prompt_tokens}, out {t.output_tokens} "
               f"(known for {t.usage_known} of {t.completed} completed)")
    out += [_q("TTFT", t.ttft_s), _q("ITL", t.itl_s), _q("E2E", t.e2e_s)]
    for h in t.per_hour:
        out.append(f"  hour {h.hour} from {h.start}: {h.requests} requests, {h.failed} failed, TTFT p99 "
                   f"{ms(h.ttft_s.p99)}, E2E p99 {ms(h.e2e_s.p99)}, {fmt(h.throughput_rps, ' req/s', 2)}")
    for rep in f.replicas if len(f.replicas) > 1 else []:
        rt = rep.traffic
        out.append(f"  replica {rep.replica}: {rt.requests} requests, TTFT p99 {ms(rt.ttft_s.p99)}, "
                   f"SLA {rep.sla_run_tier or '-'} in every hour")
    return out


def _tail(f: Report) -> list[str]:
    t = f.tail
    if not t.present:
        return []
    out = [f"TTFT TAIL (the slowest {100 * (1 - t.quantile):.0f} %: {t.slowest} of {t.requests} requests, "
           f"≥ {ms(t.threshold_s)}; what each waited through, beside the share of all requests)"]
    out += [f"  {c.kind:<8} {c.tail:>6} ({100 * c.tail / t.slowest:5.1f} %)  "
            f"of all {c.all:>8} ({100 * c.all / t.requests:5.1f} %)" for c in t.kinds]
    out += [f"    {c.kind:<8} {c.part:<28} {c.tail:>6}  of all {c.all:>8} ({100 * c.all / t.requests:5.1f} %)"
            for c in t.parts if c.tail]
    out += [f"  {r.at} replica {r.replica} generation {r.generation}: {ms(r.ttft_s)} {r.kind}"
            + (f" ({r.what})" if r.what else "") for r in t.slowest_requests]
    return out


def _soak(f: Report) -> list[str]:
    s = f.soak
    if not s.present:
        return []  # production traffic alone: nothing to say of a soak that never ran
    out = ["SOAK (the load generator's own view of its requests)"]
    out.append(f"  requests {s.requests}, failed {s.failed} ({100 * (s.error_rate or 0):.3f} %), "
               f"{fmt(s.throughput_rps, ' req/s', 2)}, {fmt(s.output_tokens_per_s, ' tok/s')}")
    for name, q in (("TTFT", s.ttft_s), ("TTFT (sched)", s.ttft_sched_s), ("ITL", s.itl_mean_s), ("E2E", s.e2e_s),
                    ("E2E (sched)", s.e2e_sched_s)):
        out.append(_q(name, q))
    out += [f"  error {cat}: {n}" for cat, n in s.errors.items()]
    return out


def render_text(f: Report) -> str:
    out = [f"vllm-guard report  {f.label}  ({f.ledger})", "", "VERDICT", *verdict_block(f), ""]
    for part in (_service, _leaks, _thermal, _sla, _cost, _traffic, _tail, _soak):
        lines = part(f)
        out += [*lines, ""] if lines else []
    if not f.incidents.present:
        out.append(f"INCIDENTS  {f.incidents.note}")
    else:
        out += ["INCIDENTS"] + [f"  {i.detected_at} {i.kind} ({i.cls}): {i.cause} -> {i.action}"
                                for i in f.incidents.list[-20:]]
    for t in (f.watchdog_samples, f.runtime_minutes):
        if t.invalid:
            out.append(f"note: {t.note}")
    st = f.soak_status
    if st.invalid:
        out.append(f"note: {st.invalid} of {st.count + st.invalid} soak status records do not match the "
                   f"schema and were not used (a soak of another version?); first: {st.first_error}")
    return "\n".join(out) + "\n"


def _leak(f: Report, role: str, metric: str) -> float | None:
    for p in f.leak.processes:
        if p.replica is None and p.role == role and p.metric == metric and p.per_100_requests is not None:
            return p.per_100_requests.slope
    return None


def compare_rows(a: Report, b: Report) -> list[tuple[str, Any, Any]]:
    """The figures worth a side-by-side look: (name, A, B)."""
    def row(name: str, get: Any) -> tuple[str, Any, Any]:
        def safe(r: Report) -> Any:
            try:
                return get(r)
            except AttributeError:
                return None
        return name, safe(a), safe(b)

    rows = [
        ("label", a.label, b.label),
        row("up h", lambda r: r.service.up_h), row("availability", lambda r: r.service.availability),
        row("unplanned failures", lambda r: r.service.failures_unplanned),
        row("MTBF h", lambda r: r.service.mtbf.mtbf_h), row("MTBF lower h", lambda r: r.service.mtbf.lower_one_sided_h),
        row("MTBF interval low h", lambda r: r.service.mtbf.two_sided_low_h),
        row("MTBF interval high h", lambda r: r.service.mtbf.two_sided_high_h),
        row("downtime planned s", lambda r: r.service.downtime_planned_s),
        row("downtime unplanned s", lambda r: r.service.downtime_unplanned_s),
        row("recycles scheduled", lambda r: r.service.recycles_scheduled),
        row("recycles preventive", lambda r: r.service.recycles_preventive),
        row("generations", lambda r: r.service.generations), row("MTTR s", lambda r: r.service.mttr_s),
        row("requests served", lambda r: r.service.requests_served),
        row("SLA tier (every hour)", lambda r: r.sla.run_tier), row("SLA P99 s", lambda r: r.sla.run_p99_s),
        row("tokens per kWh", lambda r: r.cost.tokens_per_kwh),
        row("cost per M tokens", lambda r: r.cost.per_million_tokens.cost), row("TCO", lambda r: r.cost.tco.total),
        row("traffic source", lambda r: r.traffic.source), row("requests", lambda r: r.traffic.requests),
        row("error rate", lambda r: r.traffic.error_rate), row("throughput req/s", lambda r: r.traffic.throughput_rps),
        row("output tok/s", lambda r: r.traffic.output_tokens_per_s),
        row("TTFT p50 s", lambda r: r.traffic.ttft_s.p50), row("TTFT p99 s", lambda r: r.traffic.ttft_s.p99),
        row("ITL p50 s", lambda r: r.traffic.itl_s.p50), row("E2E p99 s", lambda r: r.traffic.e2e_s.p99),
    ]
    keys = sorted({(p.role, p.metric) for f in (a, b) for p in f.leak.processes if p.replica is None})
    rows += [(f"leak {role} {metric} MB/100req", _leak(a, role, metric), _leak(b, role, metric)) for role, metric in keys]
    ta, tb = (f.thermal.gpus[0] if f.thermal.gpus else None for f in (a, b))
    for name, key in (("max temp C", "max_temp_c"), ("throttled share", "throttled_share"),
                      ("power capped share", "power_capped_share"), ("SM clock drop %", "clock_drop_pct")):
        rows.append((name, getattr(ta, key, None), getattr(tb, key, None)))
    return rows


def render_compare_text(a: Report, b: Report, rows: list[tuple[str, Any, Any]], verdict: Verdict) -> str:
    w = max(len(r[0]) for r in rows)
    cell = (lambda v: fmt(v, nd=4) if isinstance(v, float) else fmt(v))  # noqa: E731
    out = [f"vllm-guard compare  A: {a.label} ({a.ledger})  vs  B: {b.label} ({b.ledger})", "",
           verdict.overall, ""]
    out += [f"  {'+' if x.better and x.significant and x.practical else ' '} {x.text}" for x in verdict.lines]
    out += [f"  (+ a difference: significant at {verdict.confidence:.0%} and at least {verdict.practical_pct:g} %)", ""]
    for name, f in (("A", a), ("B", b)):
        out += [f"VERDICT {name}: {f.label}", *verdict_block(f), ""]
    out += [f"{'':<{w}}  {'A: ' + a.ledger:<40}  B: {b.ledger}"]
    out += [f"{k:<{w}}  {cell(x):<40}  {cell(y)}" for k, x, y in rows]
    return "\n".join(out) + "\n"
