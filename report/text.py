"""The terminal view of a report's figures dict (and the side-by-side compare table)."""

from __future__ import annotations

from typing import Any


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


def _interval(s: dict[str, Any], nd: int = 2) -> str:
    if s.get("slope") is None:
        return "-"
    return f"{s['slope']:.{nd}f} [{fmt(s['low'], nd=nd)}, {fmt(s['high'], nd=nd)}]"


def _patch_line(p: dict[str, Any]) -> str:
    """`engine_core: fault-injection, idle-release` (applied patches of one process's report)."""
    applied = [name for name, st in p["patches"].items() if st["state"] == "applied"]
    return f"{p['process']}: {', '.join(applied) or 'none applied'}"


def verdict_block(f: dict[str, Any]) -> list[str]:
    """The answers first: the summary's lines (the same in HTML and JSON)."""
    return [f"  {line}" for line in f["summary"]["lines"]]


def render_text(f: dict[str, Any]) -> str:
    out = [f"vllm-guard report  {f['label']}  ({f['ledger']})", "", "VERDICT", *verdict_block(f), ""]
    s = f["service"]
    out.append("SERVICE")
    if not s.get("present"):
        out.append(f"  {s['note']}")
    else:
        m = s["mtbf"]
        conf = int(round(100 * m["confidence"]))
        two = (f"{g4(m['two_sided_low_h'])}-{g4(m['two_sided_high_h'])} h" if m["two_sided_low_h"] is not None
               else "n/a (no failure)")
        out += [
            f"  observed {fmt(s['observed_h'], ' h', 3)}, up {fmt(s['up_h'], ' h', 3)}, availability "
            f"{fmt(None if s['availability'] is None else 100 * s['availability'], ' %', 3)}",
            f"  unplanned failures {s['failures_unplanned']}; MTBF {g4(m['mtbf_h'], ' h')} "
            f"(>= {g4(m['lower_one_sided_h'])} h at {conf} % one-sided; {conf} % two-sided {two}); "
            f"MTTR {fmt(s['mttr_s'], ' s')}",
            f"  downtime planned {fmt(s['downtime_planned_s'], ' s')}, unplanned {fmt(s['downtime_unplanned_s'], ' s')}; "
            f"host reboots {len(s['reboots'])}",
            f"  requests served {s['requests_served']} in {s['generations']} generations (the runtime's count)",
            f"  recycles: {s['recycles']['scheduled']} scheduled, {s['recycles']['preventive']} preventive",
        ]
        for r in s["recycles"]["list"][-10:]:
            out.append(f"    - gen {r['generation']} {r['trigger']} ({r['class']}) at {r['started_at']}, "
                       f"in flight {r['in_flight']}, queued {r['queued']}, took {fmt(r['duration_s'], ' s')}")
        for e in s["unplanned_events"][-10:]:
            out.append(f"    ! gen {e['generation']} {e['kind']} at {e['at']}, restored after {fmt(e['restore_s'], ' s')}")
    out += ["", "LEAKS" + (f"  (source: {f['leak']['source']} samples)" if f["leak"].get("source") else "")]
    if not f["leak"]["processes"]:
        out.append(f"  {f['leak']['note']}")
    for p in f["leak"]["processes"]:
        out.append(f"  {p['role']:<11} {p['metric']:<7} {_interval(p['per_100_requests'])} MB/100 req, "
                   f"{_interval(p['per_hour'])} MB/h, last {fmt(p['last_mb'], ' MB')}, "
                   f"time to OOM {fmt(p['time_to_oom_h'], ' h')}")
    att = f.get("attribution") or {}
    for p in att.get("processes", []):
        if p["features"]:
            feats = ", ".join(f"{x['feature']} {x['mb_per_unit']:+.3g} [{x['low']:.3g}, {x['high']:.3g}] MB/{x['unit']}"
                              for x in p["features"])
            why = f" ({p['withheld']})" if p["withheld"] else ""
            out.append(f"  cause? {p['role']} {p['metric']}: {feats}" + (f" -> {p['cause']}" if p["cause"] else why))
    if att.get("counters_missing"):
        out.append(f"  (not counted by this runtime, so not attributed: {', '.join(att['counters_missing'])})")
    for gen, procs in sorted((f.get("patches") or {}).items()):
        out.append(f"  patches, generation {gen}: " + "; ".join(_patch_line(p) for p in procs.values()))
    out += ["", "THERMAL"]
    t = f["thermal"]
    if not t["present"]:
        out.append(f"  {t['note']}")
    for g in t["gpus"]:
        out.append(f"  {g['name']} {g['uuid']}: max {fmt(g['max_temp_c'], ' C', 0)}, throttled "
                   f"{fmt(None if g['throttled_share'] is None else 100 * g['throttled_share'], ' %')}, power capped "
                   f"{fmt(None if g['power_capped_share'] is None else 100 * g['power_capped_share'], ' %')}, SM clock p50 "
                   f"{fmt(g['sm_clock_p50_mhz'], ' MHz', 0)} of {fmt(g['sm_clock_max_mhz'], ' MHz', 0)} "
                   f"(drop {fmt(g['clock_drop_pct'], ' %')}); throughput throttled {fmt(g['throughput_throttled_rps'], ' req/s', 2)}"
                   f" vs {fmt(g['throughput_unthrottled_rps'], ' req/s', 2)}")
    out += ["", "SLA (P99 per hour; a failed request meets no bound)"]
    sl = f["sla"]
    if not sl["present"]:
        out.append(f"  {sl['note']}")
    for h in sl["per_hour"]:
        out.append(f"  hour {h['hour']} from {h['from']}: {h['requests']} requests, {sl['latency']} P99 "
                   f"{ms(h['p99_s'])} -> {h['tier'] or 'no tier'}")
    out += ["", "COST"]
    c = f["cost"]
    out.append(f"  energy {fmt(c['energy_kwh'], ' kWh', 4)}, mean power {fmt(c['mean_power_w'], ' W', 0)} over "
               f"{c['gpus_metered']} GPU(s); output tokens {fmt(c['output_tokens'])}; tokens/kWh "
               f"{fmt(c['tokens_per_kwh'], '', 0)}")
    if c.get("per_million_tokens"):
        pm, pr = c["per_million_tokens"], c["prices"]
        out.append(f"  {pm['cost']:,.2f} {pr['currency']} per M output tokens at {pm['output_tokens_per_s']:.4g} tok/s "
                   f"({pm['hourly']:,.3f} {pr['currency']}/h; power {pm['power_w']:.0f} W from {pm['power_from']})")
    if c.get("tco") and c["prices"]:
        t, pr = c["tco"], c["prices"]
        parts = ", ".join(f"{k} {fmt(v, '', 0)}" for k, v in t["parts"].items())
        out.append(f"  {t['years']:g}-year TCO {fmt(t['total'], '', 0)} {pr['currency']} ({parts}); outages/month "
                   f"{fmt(t['outages_per_month'], '', 2)} from {t['outages_from']}")
        out.append(f"  prices: {pr['box']} from {pr['file']}" + (f" ({pr['source']})" if pr["source"] else ""))
    for n in c["notes"]:
        out.append(f"  {n}")
    out += ["", "LATENCY AND ERRORS"]
    lat = f["latency"]
    if not lat["present"]:
        out.append(f"  {lat['note']}")
    else:
        out.append(f"  requests {lat['requests']}, failed {lat['failed']} ({100 * lat['error_rate']:.3f} %), "
                   f"{fmt(lat['throughput_rps'], ' req/s', 2)}, {fmt(lat['output_tokens_per_s'], ' tok/s')}")
        for k, name in (("ttft_s", "TTFT"), ("ttft_sched_s", "TTFT (sched)"), ("itl_mean_s", "ITL"),
                        ("e2e_s", "E2E"), ("e2e_sched_s", "E2E (sched)")):
            q = lat[k]
            out.append(f"  {name:<13} p50 {ms(q['p50'])}  p95 {ms(q['p95'])}  p99 {ms(q['p99'])}")
        for cat, n in lat["errors"].items():
            out.append(f"  error {cat}: {n}")
    if not f["incidents"]["present"]:
        out += ["", f"INCIDENTS  {f['incidents']['note']}"]
    else:
        out += ["", "INCIDENTS"] + [f"  {i['detected_at']} {i['kind']} ({i['class']}): {i['cause']} -> {i['action']}"
                                    for i in f["incidents"]["list"][-20:]]
    if f["watchdog_samples"]["note"]:
        out.append(f"note: {f['watchdog_samples']['note']}")
    st = f["soak_status"]
    if st["invalid"]:
        out.append(f"note: {st['invalid']} of {st['count'] + st['invalid']} soak status records do not match the "
                   f"schema and were not used (a soak of another version?); first: {st['first_error']}")
    return "\n".join(out) + "\n"


def _leak(f: dict[str, Any], role: str, metric: str) -> float | None:
    for p in f["leak"]["processes"]:
        if p["role"] == role and p["metric"] == metric:
            return p["per_100_requests"]["slope"]
    return None


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The figures worth a side-by-side look: (name, A, B)."""
    def g(f: dict[str, Any], *path: str) -> Any:
        cur: Any = f
        for k in path:
            cur = cur.get(k) if isinstance(cur, dict) else None
        return cur
    rows = [("label", a["label"], b["label"])]
    for name, path in (("up h", ("service", "up_h")), ("availability", ("service", "availability")),
                       ("unplanned failures", ("service", "failures_unplanned")),
                       ("MTBF h", ("service", "mtbf", "mtbf_h")), ("MTBF lower h", ("service", "mtbf", "lower_one_sided_h")),
                       ("MTBF interval low h", ("service", "mtbf", "two_sided_low_h")),
                       ("MTBF interval high h", ("service", "mtbf", "two_sided_high_h")),
                       ("downtime planned s", ("service", "downtime_planned_s")),
                       ("downtime unplanned s", ("service", "downtime_unplanned_s")),
                       ("recycles scheduled", ("service", "recycles", "scheduled")),
                       ("recycles preventive", ("service", "recycles", "preventive")),
                       ("generations", ("service", "generations")),
                       ("MTTR s", ("service", "mttr_s")), ("requests served", ("service", "requests_served")),
                       ("SLA tier (every hour)", ("sla", "run_tier")), ("SLA P99 s", ("sla", "run_p99_s")),
                       ("tokens per kWh", ("cost", "tokens_per_kwh")),
                       ("cost per M tokens", ("cost", "per_million_tokens", "cost")),
                       ("TCO", ("cost", "tco", "total")),
                       ("soak requests", ("latency", "requests")),
                       ("error rate", ("latency", "error_rate")), ("throughput req/s", ("latency", "throughput_rps")),
                       ("output tok/s", ("latency", "output_tokens_per_s")),
                       ("TTFT p50 s", ("latency", "ttft_s", "p50")), ("TTFT p99 s", ("latency", "ttft_s", "p99")),
                       ("ITL p50 s", ("latency", "itl_mean_s", "p50")), ("E2E p99 s", ("latency", "e2e_s", "p99"))):
        rows.append((name, g(a, *path), g(b, *path)))
    roles = sorted({(p["role"], p["metric"]) for f in (a, b) for p in f["leak"]["processes"]})
    for role, metric in roles:
        rows.append((f"leak {role} {metric} MB/100req", _leak(a, role, metric), _leak(b, role, metric)))
    ta, tb = (f["thermal"]["gpus"][0] if f["thermal"]["gpus"] else {} for f in (a, b))
    for name, key in (("max temp C", "max_temp_c"), ("throttled share", "throttled_share"),
                      ("power capped share", "power_capped_share"), ("SM clock drop %", "clock_drop_pct")):
        rows.append((name, ta.get(key), tb.get(key)))
    return rows


def render_compare_text(a: dict[str, Any], b: dict[str, Any], rows: list[tuple[str, Any, Any]],
                        verdict: dict[str, Any]) -> str:
    w = max(len(r[0]) for r in rows)
    cell = (lambda v: fmt(v, nd=4) if isinstance(v, float) else fmt(v))  # noqa: E731
    out = [f"vllm-guard compare  A: {a['label']} ({a['ledger']})  vs  B: {b['label']} ({b['ledger']})", "",
           verdict["overall"], ""]
    out += [f"  {'+' if x['significant'] else ' '} {x['text']}" for x in verdict["lines"]]
    out += ["  (+ significant at the chosen confidence)", ""]
    for name, f in (("A", a), ("B", b)):
        out += [f"VERDICT {name}: {f['label']}", *verdict_block(f), ""]
    out += [f"{'':<{w}}  {'A: ' + a['ledger']:<40}  B: {b['ledger']}"]
    out += [f"{k:<{w}}  {cell(x):<40}  {cell(y)}" for k, x, y in rows]
    return "\n".join(out) + "\n"
