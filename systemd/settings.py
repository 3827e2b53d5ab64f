"""The `[install]` section of guard.toml: unit settings an operator may change, validated here.

Unknown keys and wrong types fail with a ConfigError naming the key and the value, before
anything is written. Durations use the runtime's syntax (`30s`, `15min` is not: use `15m`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_guard.runtime.config import ConfigError, parse_duration

_MEMORY = re.compile(r"^(\d+(\.\d+)?[KMGT]?|\d{1,3}(\.\d+)?%|infinity)$")
_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")
_GPU = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class InstallSettings:
    user: str = "vllm-guard"  # the runtime's user; its group of the same name owns the admin socket
    watchdog_user: str = "vllm-guard-watchdog"
    memory_high: str = "85%"
    memory_max: str = "90%"
    watchdog_sec: float = 60.0
    restart_sec: float = 30.0
    start_limit_interval: float = 1800.0
    start_limit_burst: int = 4
    timeout_start: float = 900.0
    revive_every: float = 1800.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the runtime
    gpus: list[str] = field(default_factory=list)  # GPU UUIDs -> CUDA_VISIBLE_DEVICES

    def environment(self) -> dict[str, str]:
        """The runtime's extra environment, GPU selection included."""
        env = dict(self.env)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    @property
    def group(self) -> str:
        return self.user


_DURATIONS = {"watchdog_sec", "restart_sec", "start_limit_interval", "timeout_start", "revive_every"}


def _check(key: str, value: Any) -> Any:
    name = f"[install] {key}"
    if key in _DURATIONS:
        seconds = parse_duration(value, name)
        if seconds < 1:
            raise ConfigError(f"{name} has value {value!r}: must be at least 1s")
        return seconds
    if key == "start_limit_burst":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} has value {value!r}: not an integer >= 1")
        return value
    if key in ("user", "watchdog_user"):
        if not isinstance(value, str) or not _NAME.match(value):
            raise ConfigError(f"{name} has value {value!r}: not a valid system user name")
        return value
    if key in ("memory_high", "memory_max"):
        if not isinstance(value, str) or not _MEMORY.match(value):
            raise ConfigError(f"{name} has value {value!r}: use e.g. 64G, 90% or infinity")
        return value
    if key == "gpus":
        if not isinstance(value, list) or not all(isinstance(g, str) and _GPU.match(g) for g in value):
            raise ConfigError(f"{name} has value {value!r}: not a list of GPU UUIDs (GPU-..., MIG-...)")
        return list(value)
    if key == "env":
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and _ENV_KEY.match(k) and isinstance(v, str) and "\n" not in v
                for k, v in value.items()):
            raise ConfigError(f"{name} has value {value!r}: not a table of NAME = \"string\"")
        return dict(value)
    raise AssertionError(key)  # pragma: no cover - keys come from the dataclass


def parse(table: dict[str, Any]) -> InstallSettings:
    """Validated settings from the raw `[install]` table (GuardConfig.install)."""
    known = {f.name for f in fields(InstallSettings)}
    out = InstallSettings()
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"[install] {key} is not a known key (known: {', '.join(sorted(known))})")
        setattr(out, key, _check(key, value))
    if out.user == out.watchdog_user:
        raise ConfigError(f"[install] watchdog_user has value {out.watchdog_user!r}: must differ from user")
    return out


def to_table(s: InstallSettings) -> dict[str, Any]:
    """The settings as a TOML-ready table (durations as `Ns`), written back into guard.toml."""
    out: dict[str, Any] = {}
    for f in fields(InstallSettings):
        value = getattr(s, f.name)
        out[f.name] = f"{value:g}s" if f.name in _DURATIONS else value
    return out


def parse_env_flag(text: str) -> tuple[str, str]:
    """`--env KEY=VALUE` from the command line."""
    key, sep, value = text.partition("=")
    if not sep or not _ENV_KEY.match(key) or "\n" in value:
        raise ConfigError(f"--env has value {text!r}: use NAME=VALUE")
    return key, value
