"""One `guard.toml` schema for every command; CLI flags override; validated at start.

Every invalid setting raises `ConfigError` with one line naming the key and the value,
which the CLI turns into exit code 2 before anything is started.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type, or impossible with the others."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from `90s`, `30m`, `24h`, `1d`, `250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} has value {value!r}: not a duration (use e.g. 90s, 30m, 24h, 1d)")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{key} has value {value!r}: must not be negative")
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise ConfigError(f"{key} has value {value!r}: not a duration (use e.g. 90s, 30m, 24h, 1d)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


class Duration(float):
    """Marker type: a field annotated `Duration` accepts duration strings."""


@dataclass
class ServerConfig:
    model: str = ""  # empty: the embedded tiny model
    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: str = ".state"
    backend_host: str = "127.0.0.1"
    python: str = ""  # interpreter for the vLLM child; empty: this one
    vllm_args: list[str] = field(default_factory=list)
    startup_timeout: Duration = Duration(600.0)
    drain_timeout: Duration = Duration(120.0)
    stop_timeout: Duration = Duration(30.0)
    memory_release_timeout: Duration = Duration(60.0)
    queue_size: int = 1024
    queue_max_wait: Duration = Duration(900.0)
    retry_after: int = 10
    admin_group: str = ""
    admin_mode: int = 0o660
    max_failures: int = 5
    failure_window: Duration = Duration(600.0)
    backoff_initial: Duration = Duration(1.0)
    backoff_max: Duration = Duration(60.0)
    request_timeout: Duration = Duration(3600.0)
    access_log: bool = True  # one `request` event per proxied request (id, generation, status, TTFT)


@dataclass
class RecycleConfig:
    max_requests: int = 0
    max_requests_jitter: int = 0
    max_uptime: Duration = Duration(0.0)
    max_gpu_memory_growth_mb: float = 0.0
    max_host_rss_growth_mb: float = 0.0
    memory_warmup_requests: int = 20
    memory_interval: Duration = Duration(5.0)
    idle_after: Duration = Duration(30.0)
    idle_fraction: float = 0.0  # 0 disables opportunistic early recycling


@dataclass
class ProbeConfig:
    interval: Duration = Duration(15.0)
    timeout: Duration = Duration(20.0)
    # consecutive timed-out probes without engine progress that make a hang: 2, because a box
    # starved of CPU can stall the engine for one probe window without anything being wrong
    failures: int = 2
    prompt: str = "ping"


@dataclass
class GuardConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    recycle: RecycleConfig = field(default_factory=RecycleConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    # Sections owned by other commands; kept as plain tables for them to validate.
    watchdog: dict[str, Any] = field(default_factory=dict)
    soak: dict[str, Any] = field(default_factory=dict)
    inject: dict[str, Any] = field(default_factory=dict)
    install: dict[str, Any] = field(default_factory=dict)
    patches: dict[str, Any] = field(default_factory=dict)

    @property
    def state_path(self) -> Path:
        return Path(self.server.state_dir)


_TYPED_SECTIONS = {"server": ServerConfig, "recycle": RecycleConfig, "probe": ProbeConfig}
_OPEN_SECTIONS = ("watchdog", "soak", "inject", "install", "patches")


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    name = f"[{section}] {key}"
    if typ is Duration:
        return Duration(parse_duration(value, name))
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} has value {value!r}: not a bool (true or false)")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} has value {value!r}: not an integer")
        if value < 0:
            raise ConfigError(f"{name} has value {value!r}: must not be negative")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} has value {value!r}: not a number")
        if value < 0:
            raise ConfigError(f"{name} has value {value!r}: must not be negative")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} has value {value!r}: not a string")
        return value
    if typ == list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} has value {value!r}: not a list of strings")
        return list(value)
    raise ConfigError(f"{name}: unsupported type {typ!r}")  # schema bug, not user error


def set_value(cfg: GuardConfig, section: str, key: str, value: Any) -> None:
    """Set one typed key, validating it; used by both the file loader and CLI overrides."""
    cls = _TYPED_SECTIONS[section]
    hints = get_type_hints(cls)
    if key not in hints:
        known = ", ".join(sorted(hints))
        raise ConfigError(f"[{section}] {key} is not a known key (known: {known})")
    setattr(getattr(cfg, section), key, _coerce(section, key, value, hints[key]))


def load(path: str | Path | None) -> GuardConfig:
    """Read and validate `guard.toml`; a missing `path` (None) gives the defaults."""
    cfg = GuardConfig()
    if path is None:
        return cfg
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(p)!r} does not exist") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} has value {table!r}: expected a [{section}] table")
        if section in _TYPED_SECTIONS:
            for key, value in table.items():
                set_value(cfg, section, key, value)
        elif section in _OPEN_SECTIONS:
            setattr(cfg, section, dict(table))
        else:
            known = ", ".join(sorted([*_TYPED_SECTIONS, *_OPEN_SECTIONS]))
            raise ConfigError(f"[{section}] is not a known section (known: {known})")
    return cfg


def validate(cfg: GuardConfig) -> GuardConfig:
    """Reject impossible combinations; call after CLI overrides are applied."""
    s, r, p = cfg.server, cfg.recycle, cfg.probe
    if not 1 <= s.port <= 65535:
        raise ConfigError(f"[server] port has value {s.port!r}: must be 1..65535")
    if r.max_requests_jitter and not r.max_requests:
        raise ConfigError(
            f"[recycle] max_requests_jitter has value {r.max_requests_jitter!r}: needs max_requests > 0"
        )
    if not 0.0 <= r.idle_fraction < 1.0:
        raise ConfigError(f"[recycle] idle_fraction has value {r.idle_fraction!r}: must be in [0, 1)")
    if p.timeout <= 0 or p.interval <= 0:
        raise ConfigError(f"[probe] timeout/interval have values {p.timeout!r}/{p.interval!r}: must be > 0")
    if p.failures < 1:
        raise ConfigError(f"[probe] failures has value {p.failures!r}: must be >= 1")
    if s.queue_size < 1:
        raise ConfigError(f"[server] queue_size has value {s.queue_size!r}: must be >= 1")
    if s.max_failures < 1:
        raise ConfigError(f"[server] max_failures has value {s.max_failures!r}: must be >= 1")
    if s.backoff_max < s.backoff_initial:
        raise ConfigError(
            f"[server] backoff_max has value {s.backoff_max!r}: must be >= backoff_initial ({s.backoff_initial!r})"
        )
    return cfg


def as_dict(cfg: GuardConfig) -> dict[str, Any]:
    """Plain dict (for status and logs)."""
    return dataclasses.asdict(cfg)


__all__ = [
    "ConfigError",
    "Duration",
    "GuardConfig",
    "ProbeConfig",
    "RecycleConfig",
    "ServerConfig",
    "as_dict",
    "load",
    "parse_duration",
    "set_value",
    "validate",
]
