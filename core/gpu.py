"""GPU rules that every package must apply the same way: which GPUs the service uses, and
what counts as throttled.

GPU selection has one key, `[server] gpus` (indexes or UUIDs, one replica per GPU or
tensor-parallel group): the runtime gives each replica `CUDA_VISIBLE_DEVICES=<its UUIDs>`
(`select_gpus`), `install` writes that key (never a unit-wide CUDA_VISIBLE_DEVICES), and the
watchdog watches the same GPUs (`service_gpus`).

GPU index: CUDA numbers devices fastest-first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`; NVML
numbers them by PCI bus. So an index in `CUDA_VISIBLE_DEVICES` names an NVML device only
under PCI_BUS_ID order; UUIDs always do. When neither holds, watch every GPU rather than
guess (on a box with mixed cards a guess watches the wrong one).

Throttling (NVML clock-event reasons): the clock is *throttled* when heat or a hardware
signal holds it down: HW slowdown (0x8), SW thermal (0x20), HW thermal (0x40), HW power
brake (0x80). The SW power cap (0x4) is reported apart as *power capped*: a card at full
load normally runs at its power limit, so counting it would call every busy GPU throttled.
Idle (0x1) is neither.

GPU size: a GPU's total memory, for every forecast and fit (the runtime's, the watchdog's, the
report's), is NVML's total capped at `[inject] gpu_memory_budget_gib` when that is set: the
injected budget makes a large card act as a smaller one for vLLM, so the time to out of memory
must be read against the same smaller card (`capped_total_mb`).

Clock drop: the mean, over busy samples (not idle, both clocks known), of how far the SM clock
sits below its maximum, in %: a sustained drop, what the watchdog alarms on and the report
states (`clock_drop_pct`).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

GPU_IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80

REASON_NAMES = {GPU_IDLE: "idle", SW_POWER_CAP: "sw_power_cap", HW_SLOWDOWN: "hw_slowdown",
                SW_THERMAL: "sw_thermal", HW_THERMAL: "hw_thermal", HW_POWER_BRAKE: "hw_power_brake"}
THERMAL_MASK = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL
THROTTLE_MASK = THERMAL_MASK | HW_POWER_BRAKE
POWER_CAP_MASK = SW_POWER_CAP


def capped_total_mb(total_mb: float, cap_mb: float) -> float:
    """A GPU's total memory by the GPU-size rule: NVML's total, capped at an injected budget
    (`cap_mb` > 0)."""
    return min(total_mb, cap_mb) if cap_mb > 0 else total_mb


def throttled(reasons: int | None) -> bool:
    """Held down by heat or a hardware signal (the one definition)."""
    return bool(reasons) and bool(reasons & THROTTLE_MASK)  # type: ignore[operator]


def thermal(reasons: int | None) -> bool:
    return bool(reasons) and bool(reasons & THERMAL_MASK)  # type: ignore[operator]


def power_capped(reasons: int | None) -> bool:
    return bool(reasons) and bool(reasons & POWER_CAP_MASK)  # type: ignore[operator]


def idle(reasons: int | None) -> bool:
    return bool(reasons) and bool(reasons & GPU_IDLE)  # type: ignore[operator]


def busy_clock_ratio(sm_mhz: float | None, max_mhz: float | None, reasons: int | None) -> float | None:
    """The SM clock over its maximum in a sample that counts toward clock drop (busy: not idle,
    both clocks known), else None."""
    return sm_mhz / max_mhz if sm_mhz and max_mhz and not idle(reasons) else None


def drop_pct(mean_ratio: float) -> float:
    """Clock drop in % from the mean busy clock ratio."""
    return 100.0 * (1.0 - mean_ratio)


def clock_drop_pct(samples: Iterable[tuple[float | None, float | None, int | None]]) -> float | None:
    """`(sm_clock_mhz, sm_clock_max_mhz, reasons)` samples -> mean busy drop below the max, in %
    (the one definition); None without a busy sample that has both clocks."""
    ratios = [r for s in samples if (r := busy_clock_ratio(*s)) is not None]
    return drop_pct(sum(ratios) / len(ratios)) if ratios else None


def reason_names(reasons: int | None) -> list[str]:
    return [n for b, n in REASON_NAMES.items() if reasons and reasons & b]


def visible_uuids(static: Sequence[Mapping[str, Any]], env: Mapping[str, str] | None = None) -> list[str]:
    """UUIDs of the GPUs a process with `env` sees, given NVML's devices (`uuid`, `pci_bus_id`)."""
    env = os.environ if env is None else env
    every = [str(s["uuid"]) for s in static]
    vis = env.get("CUDA_VISIBLE_DEVICES")
    if vis is None or vis.strip() == "":
        return every if vis is None else []
    items = [x.strip() for x in vis.split(",") if x.strip()]
    if all(x.startswith(("GPU-", "MIG-")) for x in items):
        return [u for u in every if any(u.startswith(x) for x in items)]
    if env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and all(x.isdigit() for x in items):
        ordered = sorted(static, key=lambda s: str(s["pci_bus_id"]))
        return [str(ordered[int(x)]["uuid"]) for x in items if int(x) < len(ordered)]
    return every


def select_gpus(static: Sequence[Mapping[str, Any]], selectors: Sequence[str],
                env: Mapping[str, str] | None = None) -> list[str]:
    """UUIDs for `[server] gpus` entries: an index is the n-th GPU as `nvidia-smi` numbers them
    (NVML order) among those this process sees (`visible_uuids`); a UUID, or a prefix of one,
    names its GPU. The runtime then gives each replica `CUDA_VISIBLE_DEVICES=<UUID,...>`, which
    names the same devices whatever `CUDA_DEVICE_ORDER` says. ValueError names a selector that
    matches no GPU, or more than one."""
    seen = set(visible_uuids(static, env))
    ordered = [str(s["uuid"]) for s in sorted(static, key=lambda s: int(s["index"])) if str(s["uuid"]) in seen]
    out: list[str] = []
    for sel in selectors:
        if sel.isdigit():
            if int(sel) >= len(ordered):
                raise ValueError(f"GPU {sel}: this process sees {len(ordered)} GPU(s) (0..{len(ordered) - 1})")
            out.append(ordered[int(sel)])
            continue
        hits = [u for u in ordered if u.startswith(sel)]
        if len(hits) != 1:
            raise ValueError(f"GPU {sel}: " + ("no such GPU here" if not hits else "matches more than one GPU"))
        out.append(hits[0])
    return out


def service_gpus(static: Sequence[Mapping[str, Any]], selectors: Sequence[str],
                 env: Mapping[str, str] | None = None) -> list[str]:
    """UUIDs of the GPUs a service with `[server] gpus` = `selectors` and environment `env`
    uses: its replicas' GPUs (`select_gpus`), or every GPU it sees when the list is empty.
    ValueError as `select_gpus` raises it."""
    return select_gpus(static, selectors, env) if selectors else visible_uuids(static, env)
