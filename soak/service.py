"""Service figures from the runtime's tables: up time, MTBF, MTTR, availability, reboots.

Up time is the sum of each generation's serving interval (ready -> end; still serving -> now).
An unplanned event is a generation that ended `unplanned` or a `failures` row of class
unplanned (one per generation at most: a crash and its failure row are one event). Planned
recycles (scheduled, preventive) are listed apart and never count against MTBF. A boot_id
change between consecutive generations is a host reboot: the gap is unplanned downtime.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from vllm_guard.runtime.ledger import UNPLANNED, parse_iso

from .mtbf import availability, mtbf


def _t(text: str | None) -> float | None:
    return parse_iso(text).timestamp() if text else None


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def service(gens: list[dict[str, Any]], recycles: list[dict[str, Any]], failures: list[dict[str, Any]],
            now: float, confidence: float = 0.90) -> dict[str, Any]:
    if not gens:
        return {"present": False, "note": "no generations in this ledger (the runtime did not write here)"}
    up_s = 0.0
    planned_down = unplanned_down = 0.0
    reboots: list[dict[str, Any]] = []
    fail_by_gen: dict[int, dict[str, Any]] = {}
    for f in failures:
        if f.get("class", UNPLANNED) == UNPLANNED:
            fail_by_gen.setdefault(int(f["generation"]), f)
    events: dict[int, dict[str, Any]] = {}
    # The window opens when service first began: the first cold start is not an outage.
    start = _t(gens[0].get("ready_at")) or _t(gens[0]["started_at"]) or now
    end = start
    for i, g in enumerate(gens):
        ready, ended = _t(g.get("ready_at")), _t(g.get("ended_at"))
        stop = ended if ended is not None else now
        if ready is not None and stop > ready:
            up_s += stop - ready
        end = max(end, stop)
        gen = int(g["generation"])
        unplanned = g.get("end_class") == UNPLANNED or gen in fail_by_gen
        if unplanned:
            f = fail_by_gen.get(gen, {})
            events[gen] = {"generation": gen, "kind": f.get("kind") or g.get("end_reason") or "unplanned",
                           "at": f.get("at") or g.get("ended_at"), "restored_at": f.get("restored_at"),
                           "detail": f.get("detail"), "exit_code": f.get("exit_code")}
        nxt = gens[i + 1] if i + 1 < len(gens) else None
        if nxt is None:
            continue
        next_ready = _t(nxt.get("ready_at")) or _t(nxt.get("started_at")) or stop
        gap = max(0.0, next_ready - stop)
        rebooted = bool(g.get("boot_id") and nxt.get("boot_id") and g["boot_id"] != nxt["boot_id"])
        if rebooted:
            reboots.append({"from_boot_id": g["boot_id"], "to_boot_id": nxt["boot_id"], "gap_from": _iso(stop),
                            "gap_to": _iso(next_ready), "gap_s": round(gap, 1)})
            if gen not in events:
                events[gen] = {"generation": gen, "kind": "host_reboot", "at": _iso(stop), "restored_at": _iso(next_ready),
                               "detail": "boot_id changed", "exit_code": None}
        if unplanned or rebooted:
            unplanned_down += gap
            ev = events[gen]
            if not ev.get("restored_at"):
                ev["restored_at"] = _iso(next_ready)
        else:
            planned_down += gap
    for ev in events.values():
        a, b = _t(ev.get("at")), _t(ev.get("restored_at"))
        ev["restore_s"] = round(b - a, 1) if a is not None and b is not None and b >= a else None
    restores = [e["restore_s"] for e in events.values() if e["restore_s"] is not None]
    observed = max(0.0, end - start)
    r = len(events)
    m = mtbf(up_s / 3600.0, r, confidence)
    planned = [x for x in recycles if x.get("class") != UNPLANNED]
    return {
        "present": True,
        "observed_from": _iso(start), "observed_to": _iso(end), "observed_h": round(observed / 3600, 4),
        "up_h": round(up_s / 3600, 4), "down_h": round(max(0.0, observed - up_s) / 3600, 4),
        "downtime_planned_s": round(planned_down, 1), "downtime_unplanned_s": round(unplanned_down, 1),
        "availability": availability(up_s, max(0.0, observed - up_s)),
        "generations": len(gens), "failures_unplanned": r, "mtbf": m.to_dict(),
        "mttr_s": round(sum(restores) / len(restores), 1) if restores else None,
        "unplanned_events": sorted(events.values(), key=lambda e: e["at"] or ""),
        "reboots": reboots,
        "recycles": {
            "scheduled": sum(1 for x in planned if x.get("class") == "scheduled"),
            "preventive": sum(1 for x in planned if x.get("class") == "preventive"),
            "list": [{k: x.get(k) for k in ("generation", "trigger", "class", "started_at", "in_flight",
                                            "queued", "max_queued", "duration_s", "downtime_s")} for x in planned],
        },
        "gpu_names": sorted({g["gpu_name"] for g in gens if g.get("gpu_name")}),
        "models": sorted({g["model"] for g in gens if g.get("model")}),
        "vllm_versions": sorted({g["vllm_version"] for g in gens if g.get("vllm_version")}),
        "hosts": sorted({g["host"] for g in gens if g.get("host")}),
    }
