"""Derive the replay fixtures' NVML traces from a recorded base trace (documented generator).

    python -m vllm_guard.watchdog.tracegen --base tests/fixtures/watchdog/nvml_h200.jsonl \
        --out-dir tests/fixtures/watchdog

The base is a trace recorded by the live sampler (`bench/gpu_nvml_record.py`): idle samples
then load samples. From it the generator keeps the record shape, the driver, which fields are
supported, and the sample-to-sample noise of temperature and power; onto that it lays:

* `nvml_thermal_4090.jsonl` — the seed's story on an RTX 4090 (GeForce: no ECC, no remapped
  rows, no Xid events): 5 min idle, then 3 h of load; temperature rises toward 93.5 C with a
  45 min time constant (92 C after 3 h); from 83 C (the GeForce target) the SW thermal bit
  0x20 is set and the SM clock falls linearly from 2520 MHz to 2130 MHz at 92 C; from 90 C
  (the assumed slowdown threshold) the HW thermal bit 0x40 too. The meta line's `story` holds
  the throttle share the detector must find over the last `window_s`, at the end and at
  checkpoints every 15 min of load.
* `nvml_h200_steady.jsonl` — the base GPU serving for 20 min without any slowdown: the
  negative case (no thermal incident).

Without a recorded base (`--synth-base`), a stand-in is built from the facts measured on the
H200 on 2026-11-29 (idle 345 MHz, reasons 0x1, 78-80 W, 33-37 C; serving 1980 MHz, 0x0, 122 W).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from vllm_guard.core import gpu
from vllm_guard.core.nvml import SCHEMA
from .trace import TraceWriter, read_trace

STEP_S = 30.0
T0 = 1796000000.0  # fixed epoch: the fixtures are byte-for-byte reproducible
STORY = {"idle_s": 300.0, "load_s": 3 * 3600.0, "t_inf_c": 93.5, "tau_s": 2700.0, "target_c": 83.0,
         "slowdown_c": 90.0, "shutdown_c": 95.0, "max_mhz": 2520, "throttled_mhz": 2130, "hot_c": 92.0,
         "window_s": 600.0, "load_w": 430.0, "limit_w": 450.0, "idle_w": 30.0, "idle_mhz": 210}
GEFORCE_UNSUPPORTED = ("ecc", "remapped_rows", "xid_events")


def synth_base(seed: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A stand-in H200 trace (60 s idle + 120 s load at 1 Hz) from the README's measured facts."""
    rng = random.Random(seed)
    meta = {"kind": "meta", "schema": SCHEMA, "host": "standin", "at_s": T0, "driver": "580.95.05",
            "cuda_driver": "13.0", "error": None, "standin": True,
            "gpus": {"GPU-00000000-0000-0000-0000-000000000200": {"name": "NVIDIA H200", **{k: True for k in (
                "memory", "processes", "temperature", "temp_thresholds", "sm_clock", "sm_clock_max",
                "clock_reasons", "power", "power_limit", "utilization", "ecc", "remapped_rows",
                "persistence", "xid_events")}}}}
    samples = []
    for i in range(180):
        load = i >= 60
        g = {"index": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000200", "name": "NVIDIA H200",
             "pci_bus_id": "00000000:18:00.0", "temp_slowdown_c": 87, "temp_shutdown_c": 92,
             "sm_clock_max_mhz": 1980, "mem_total_mb": 143771.0,
             "mem_used_mb": 22653.0 if load else 615.0,
             "processes": [{"pid": 4242, "used_mb": 22038.0}] if load else [],
             "temp_c": rng.randint(38, 42) if load else rng.randint(33, 37),
             "sm_clock_mhz": 1980 if load else 345, "clock_reasons": 0 if load else 1,
             "power_w": round(122 + rng.uniform(-3, 3), 1) if load else round(rng.uniform(78, 80), 1),
             "power_limit_w": 700.0, "util_pct": 100 if load else 0, "ecc_uncorrected": 0,
             "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
             "persistence": 1}
        samples.append({"kind": "sample", "at_s": T0 + i, "driver": meta["driver"], "cuda_driver": "13.0",
                        "gpus": [g], "xids": [], "error": None, "label": "load" if load else "idle"})
    return meta, samples


def _phase(samples: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    got = [s for s in samples if s.get("label") == label and s.get("gpus")]
    if not got:  # an unlabelled trace: busy = not idle-bit
        idle = label == "idle"
        got = [s for s in samples if s.get("gpus") and bool((s["gpus"][0].get("clock_reasons") or 0) & 1) == idle]
    return got or [s for s in samples if s.get("gpus")]


def _noise(samples: list[dict[str, Any]], key: str) -> list[float]:
    """Sample-to-sample residuals of one field around its mean (the base's real jitter)."""
    vals = [float(s["gpus"][0][key]) for s in samples if s["gpus"][0].get(key) is not None]
    if not vals:
        return [0.0]
    mean = sum(vals) / len(vals)
    return [v - mean for v in vals]


def thermal_story(meta: dict[str, Any], samples: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    st = STORY
    idle, load = _phase(samples, "idle"), _phase(samples, "load")
    t_noise, p_noise = _noise(load, "temp_c"), _noise(load, "power_w")
    uuid = "GPU-4090aaaa-0000-0000-0000-000000000001"
    out: list[dict[str, Any]] = []
    flags: list[tuple[float, bool]] = []
    n_idle, n_load = int(st["idle_s"] // STEP_S), int(st["load_s"] // STEP_S) + 1
    base_load_c = sum(float(s["gpus"][0]["temp_c"]) for s in load) / len(load)
    for i in range(n_idle + n_load):
        busy = i >= n_idle
        src = (load[(i - n_idle) % len(load)] if busy else idle[i % len(idle)])
        g = copy.deepcopy(src["gpus"][0])
        g.update(uuid=uuid, name="NVIDIA GeForce RTX 4090", index=0, mem_total_mb=24564.0,
                 temp_slowdown_c=int(st["slowdown_c"]), temp_shutdown_c=int(st["shutdown_c"]),
                 sm_clock_max_mhz=st["max_mhz"], power_limit_w=st["limit_w"],
                 ecc_uncorrected=None, remapped_rows=None)
        if busy:
            t = (i - n_idle) * STEP_S
            temp = st["t_inf_c"] - (st["t_inf_c"] - base_load_c) * math.exp(-t / st["tau_s"])
            temp = round(temp + max(-1.0, min(1.0, t_noise[i % len(t_noise)])))
            frac = min(1.0, max(0.0, (temp - st["target_c"]) / (st["hot_c"] - st["target_c"])))
            mhz = int(round((st["max_mhz"] - frac * (st["max_mhz"] - st["throttled_mhz"])) / 15) * 15)
            bits = (0x20 if temp >= st["target_c"] else 0) | (0x40 if temp >= st["slowdown_c"] else 0)
            power = st["load_w"] * mhz / st["max_mhz"] + p_noise[i % len(p_noise)]
            g.update(temp_c=temp, sm_clock_mhz=mhz, clock_reasons=bits, power_w=round(power, 1), util_pct=100,
                     mem_used_mb=21400.0, processes=[{"pid": 4242, "used_mb": 20810.0}])
        else:
            g.update(sm_clock_mhz=st["idle_mhz"], clock_reasons=0x1, power_w=st["idle_w"], util_pct=0,
                     mem_used_mb=480.0, processes=[])
        at = T0 + i * STEP_S
        flags.append((at, gpu.throttled(g["clock_reasons"])))
        out.append({"kind": "sample", "at_s": at, "driver": meta.get("driver"), "cuda_driver": meta.get("cuda_driver"),
                    "gpus": [g], "xids": [], "error": None, "label": "load" if busy else "idle"})
    def share_at(now: float) -> float:
        win = [f for at, f in flags if 0 <= now - at <= st["window_s"]]
        return round(sum(win) / len(win), 4)

    last = out[-1]["at_s"]
    checkpoints = [{"at_s": r["at_s"], "throttle_share": share_at(r["at_s"]), "temp_c": r["gpus"][0]["temp_c"],
                    "sm_mhz": r["gpus"][0]["sm_clock_mhz"]} for r in out[n_idle::30]]
    caps = {k: (False if k in GEFORCE_UNSUPPORTED else v)
            for k, v in next(iter(meta["gpus"].values())).items() if k != "name"}
    story = {"window_s": st["window_s"], "throttle_share_last_window": share_at(last), "checkpoints": checkpoints,
             "throttle_share_load": round(sum(f for _, f in flags[n_idle:]) / n_load, 4),
             "final_temp_c": out[-1]["gpus"][0]["temp_c"], "final_sm_mhz": out[-1]["gpus"][0]["sm_clock_mhz"],
             "params": st, "base_standin": bool(meta.get("standin"))}
    new_meta = {**meta, "at_s": T0, "gpus": {uuid: {"name": "NVIDIA GeForce RTX 4090", **caps}}, "story": story}
    return new_meta, out


def steady(meta: dict[str, Any], samples: list[dict[str, Any]], seconds: float = 1200.0,
           step: float = 10.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    load = _phase(samples, "load")
    out = []
    for i in range(int(seconds // step)):
        rec = copy.deepcopy(load[i % len(load)])
        rec["at_s"] = T0 + i * step
        out.append(rec)
    return {**meta, "at_s": T0, "story": {"throttle_share_last_window": 0.0}}, out


def write(path: Path, meta: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    w = TraceWriter(path, meta)
    for s in samples:
        w.write(s)
    w.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="derive replay fixtures from a recorded NVML trace")
    ap.add_argument("--base", help="recorded trace (bench/gpu_nvml_record.py)")
    ap.add_argument("--synth-base", action="store_true", help="use the stand-in built from measured facts")
    ap.add_argument("--out-dir", default="tests/fixtures/watchdog")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    if args.base:
        meta, samples = read_trace(args.base)
    elif args.synth_base:
        meta, samples = synth_base()
        write(out / "nvml_h200_standin.jsonl", meta, samples)
    else:
        ap.error("give --base TRACE (recorded) or --synth-base")
    m, s = thermal_story(meta, samples)
    write(out / "nvml_thermal_4090.jsonl", m, s)
    m2, s2 = steady(meta, samples)
    write(out / "nvml_h200_steady.jsonl", m2, s2)
    print(json.dumps({"base": args.base or "standin", "thermal": m["story"]["throttle_share_last_window"],
                      "samples": len(s), "steady": len(s2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
