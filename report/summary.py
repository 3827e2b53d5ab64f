"""The verdict block: the answers an operator came for, first, as lines of text.

Which box is reliable (MTBF with its bounds), how its downtime splits (planned recycles vs
unplanned), how fast each process leaks and when it runs out of memory, which SLA tier it
meets, how fast it is, whether its GPUs throttle, what a million tokens cost. Built from the
figures dict only, so the text report, the HTML and the JSON (`summary`) say the same.
"""

from __future__ import annotations

from typing import Any

from vllm_guard.core.reliability import MTBF

from . import cost, sla

ROLE = {"api_server": "API server", "engine_core": "EngineCore", "worker": "worker", "helper": "helper"}


def _h(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 1:
        return f"{v * 60:.3g} min"
    if v > 72:
        return f"{v / 24:.3g} days"
    return f"{v:.3g} h"


def _s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f} s" if v < 600 else _h(v / 3600)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v >= 0.1 else f"{v * 1000:.1f} ms"


def mtbf_line(s: dict[str, Any]) -> str:
    if not s.get("present") or s.get("mtbf") is None:
        return f"MTBF: {s.get('note') or 'no runtime data'}"
    m = MTBF(**s["mtbf"])
    return f"MTBF {m.headline()}"


def availability_line(s: dict[str, Any]) -> str:
    if not s.get("present") or s.get("availability") is None:
        return "Availability: -"
    obs = s["observed_h"] * 3600 or 1.0
    pl, un = s["downtime_planned_s"], s["downtime_unplanned_s"]
    return (f"Availability {100 * s['availability']:.3f} % of {_h(s['observed_h'])}: planned downtime "
            f"(recycles) {_s(pl)} ({100 * pl / obs:.2f} %), unplanned {_s(un)} ({100 * un / obs:.2f} %)")


def recycles_line(s: dict[str, Any]) -> str:
    if not s.get("present"):
        return "Recycles: -"
    r = s["recycles"]
    planned = r["scheduled"] + r["preventive"]
    served = s["requests_served"]
    per_gen = served / s["generations"] if s["generations"] else 0
    return (f"Recycles: {planned} planned ({r['scheduled']} scheduled, {r['preventive']} preventive), "
            f"{s['failures_unplanned']} unplanned; {served} requests in {s['generations']} generation{'' if s['generations'] == 1 else 's'} "
            f"({per_gen:.0f} per generation)")


def _growing(p: dict[str, Any]) -> bool:
    s = p["per_100_requests"]
    return s["slope"] is not None and s["low"] is not None and s["low"] > 0


def leak_lines(leak: dict[str, Any]) -> list[str]:
    procs = [p for p in leak["processes"] if p["metric"] in ("rss_mb", "gpu_mb")]
    if not procs:
        return [f"Leaks: {leak['note']}"]
    out = []
    for p in procs:
        if not _growing(p):
            continue
        s, h = p["per_100_requests"], p["per_hour"]
        kind = "GPU" if p["metric"] == "gpu_mb" else "host RSS"
        tto = p["time_to_oom_h"]
        budget = "GPU headroom" if p["metric"] == "gpu_mb" else "host available memory"
        out.append(f"Leak {ROLE.get(p['role'], p['role'])} {kind}: {s['slope']:+.3g} MB/100 requests "
                   f"[{s['low']:.3g}, {s['high']:.3g}], {h['slope']:+.4g} MB/h; out of memory in "
                   f"{_h(tto) if tto is not None else 'never at this rate' if h['slope'] is not None and h['slope'] <= 0 else '-'}"
                   f" ({budget})")
    if not out:
        out.append(f"Leaks: none significant at {leak.get('confidence', 0.9):.0%} "
                   f"({len(procs)} process/memory series fitted)")
    return out


def latency_line(lat: dict[str, Any]) -> str:
    if not lat.get("present"):
        return f"Latency: {lat['note']}"
    t, i, e = lat["ttft_s"], lat["itl_mean_s"], lat["e2e_s"]
    tp = lat["throughput_rps"]
    tok = lat["output_tokens_per_s"]
    return (f"Throughput {tp:.3g} req/s, {tok:.4g} output tok/s" if tp and tok else "Throughput -") + (
        f"; TTFT p50 {_ms(t['p50'])} p99 {_ms(t['p99'])}; ITL p50 {_ms(i['p50'])} p99 {_ms(i['p99'])}; "
        f"E2E p50 {_ms(e['p50'])} p99 {_ms(e['p99'])}; errors {lat['failed']} of {lat['requests']} "
        f"({100 * lat['error_rate']:.3g} %)")


def thermal_line(t: dict[str, Any]) -> str:
    if not t.get("present"):
        return f"Thermals: {t['note']}"
    parts = []
    for g in t["gpus"]:
        thr, cap = g["throttled_share"], g["power_capped_share"]
        drop = "-" if g["clock_drop_pct"] is None else f"{g['clock_drop_pct']:.1f} %"
        hot = "-" if g["max_temp_c"] is None else f"{g['max_temp_c']:.0f} C"
        parts.append(f"{g['name']}: throttled {_pct(thr)} of the time (heat/HW), power-capped {_pct(cap)}, "
                     f"clock drop {drop}, max {hot}")
    return "Thermals: " + "; ".join(parts)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def summary(f: dict[str, Any]) -> dict[str, Any]:
    """The verdict lines (in order) and the figures they quote, for JSON readers."""
    s = f["service"]
    lines = [mtbf_line(s), availability_line(s), recycles_line(s), *leak_lines(f["leak"])]
    att = f.get("attribution") or {}
    lines += [f"Leak cause: {x}" for x in att.get("lines", [])]
    lines += [f"SLA: {sla.headline(f['sla'])}", latency_line(f["latency"]), thermal_line(f["thermal"]),
              f"Cost: {cost.headline(f['cost'])}"]
    m = s.get("mtbf") or {}
    return {
        "lines": lines,
        "mtbf_h": m.get("mtbf_h"), "mtbf_low_h": m.get("two_sided_low_h"), "mtbf_high_h": m.get("two_sided_high_h"),
        "mtbf_lower_one_sided_h": m.get("lower_one_sided_h"), "failures_unplanned": s.get("failures_unplanned"),
        "availability": s.get("availability"), "downtime_planned_s": s.get("downtime_planned_s"),
        "downtime_unplanned_s": s.get("downtime_unplanned_s"),
        "leaks": [{"role": p["role"], "metric": p["metric"], "per_100_requests": p["per_100_requests"],
                   "per_hour": p["per_hour"], "time_to_oom_h": p["time_to_oom_h"]}
                  for p in f["leak"]["processes"] if _growing(p)],
        "sla_run_tier": f["sla"].get("run_tier"),
    }
