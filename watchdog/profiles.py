"""GPU profiles: defaults by NVML name for `[watchdog]` keys the operator did not set.

The keys themselves, their types and ranges live in `vllm_guard.core.config.WatchdogConfig`
(one schema for every command); a profile only fills in what `cfg.explicit["watchdog"]` —
the keys given in the file or on the command line — leaves open.
"""

from __future__ import annotations

from typing import Any, Collection

import msgspec

from vllm_guard.core.config import WatchdogConfig

# name fragment (NVML) -> defaults for keys the operator did not set
PROFILES: dict[str, dict[str, Any]] = {
    "RTX 4090": {"gpu_profile": "rtx4090", "thermal_margin_c": 5.0, "clock_drop_pct": 10.0},
    "A100": {"gpu_profile": "a100", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
    "H100": {"gpu_profile": "h100", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
    "H200": {"gpu_profile": "h200", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
}


def apply_profile(cfg: WatchdogConfig, explicit: Collection[str], gpu_name: str) -> tuple[WatchdogConfig, str]:
    """`cfg` with the profile defaults for this GPU (keys the operator set win), and the profile's
    name. An explicit `gpu_profile` picks the profile whatever the GPU's name."""
    chosen = cfg.gpu_profile if "gpu_profile" in explicit else ""
    for fragment, values in PROFILES.items():
        if values["gpu_profile"] == chosen or (not chosen and fragment in gpu_name):
            defaults = {k: v for k, v in values.items() if k not in explicit}
            return msgspec.structs.replace(cfg, **defaults), str(values["gpu_profile"])
    return cfg, chosen or ("generic" if gpu_name else "")
