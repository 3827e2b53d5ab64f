"""The `[inject]` and `[patches]` settings: parsed and validated without vLLM or torch.

Both travel to the vLLM child as one env var each (`VLLM_GUARD_INJECT`, `VLLM_GUARD_PATCHES`,
comma-separated `key=value`), so a plain `vllm serve` can be driven the same way as the guard.
Invalid settings raise `ConfigError` naming the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from vllm_guard.runtime.config import ConfigError, parse_duration

PATCH_IDS = ("kv-block-audit", "idle-release", "allocator-settings", "fault-injection", "add-request-abort",
             "block-ids-drain")


@dataclass(frozen=True)
class InjectSpec:
    """Faults to inject; zero means off. Counts are engine-finished requests, probes excluded."""

    host_leak_mb_per_request: float = 0.0
    device_leak_mb_per_request: float = 0.0
    block_leak_every: int = 0
    gpu_memory_budget_gib: float = 0.0
    hang_after_requests: int = 0
    crash_after_requests: int = 0

    @property
    def active(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


@dataclass(frozen=True)
class PatchSettings:
    """What the plugin does in each vLLM process; `enabled=false` turns every patch off."""

    enabled: bool = True
    disable: tuple[str, ...] = ()
    idle_release_after: float = 5.0
    malloc_trim: bool = True
    expandable_segments: bool = True
    malloc_arena_max: int = 0
    audit_reclaim: bool = True  # false: the audit only counts orphans, it does not free them

    def wants(self, patch_id: str) -> bool:
        return self.enabled and patch_id not in self.disable


_INJECT_TYPES: dict[str, type] = {f.name: float if f.type == "float" else int for f in fields(InjectSpec)}
_PATCH_TYPES: dict[str, str] = {
    "enabled": "bool", "disable": "ids", "idle_release_after": "duration", "malloc_trim": "bool",
    "expandable_segments": "bool", "malloc_arena_max": "int", "audit_reclaim": "bool",
}


def _number(section: str, key: str, value: Any, kind: type) -> float | int:
    name = f"[{section}] {key}"
    if isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError as e:
            raise ConfigError(f"{name} has value {value!r}: not {'an integer' if kind is int else 'a number'}") from e
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"{name} has value {value!r}: not {'an integer' if kind is int else 'a number'}")
    if value < 0:
        raise ConfigError(f"{name} has value {value!r}: must not be negative")
    return kind(value)


def _bool(section: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.strip().lower() in ("true", "1", "yes", "on")
    raise ConfigError(f"[{section}] {key} has value {value!r}: not a bool (true or false)")


def _ids(key: str, value: Any) -> tuple[str, ...]:
    items = value.split("+") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"[patches] {key} has value {value!r}: not a list of patch ids")
    out = tuple(v.strip() for v in items if v.strip())
    for v in out:
        if v not in PATCH_IDS:
            raise ConfigError(f"[patches] {key} has value {v!r}: not a patch id (known: {', '.join(PATCH_IDS)})")
    return out


def inject_from_table(table: Mapping[str, Any]) -> InjectSpec:
    """Validate an `[inject]` table (or a parsed env string)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        kind = _INJECT_TYPES.get(key)
        if kind is None:
            raise ConfigError(f"[inject] {key} is not a known key (known: {', '.join(sorted(_INJECT_TYPES))})")
        out[key] = _number("inject", key, value, kind)
    return InjectSpec(**out)


def patches_from_table(table: Mapping[str, Any]) -> PatchSettings:
    """Validate a `[patches]` table (or a parsed env string)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        kind = _PATCH_TYPES.get(key)
        if kind is None:
            raise ConfigError(f"[patches] {key} is not a known key (known: {', '.join(sorted(_PATCH_TYPES))})")
        if kind == "bool":
            out[key] = _bool("patches", key, value)
        elif kind == "int":
            out[key] = _number("patches", key, value, int)
        elif kind == "duration":
            out[key] = parse_duration(value, f"[patches] {key}")
        else:
            out[key] = _ids(key, value)
    return PatchSettings(**out)


def parse_kv(text: str, section: str) -> dict[str, str]:
    """`a=1,b=2` -> {'a': '1', 'b': '2'}; lists inside a value use `+` (disable=a+b)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"[{section}] entry {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def format_kv(table: Mapping[str, Any]) -> str:
    """The inverse of `parse_kv` for validated tables (env transport)."""
    parts = []
    for key, value in table.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = "+".join(value)
        parts.append(f"{key}={value}")
    return ",".join(parts)


@dataclass
class ChildSettings:
    """What a vLLM process reads from its env at plugin load."""

    inject: InjectSpec = field(default_factory=InjectSpec)
    patches: PatchSettings = field(default_factory=PatchSettings)


def from_env(env: Mapping[str, str]) -> ChildSettings:
    return ChildSettings(
        inject=inject_from_table(parse_kv(env.get("VLLM_GUARD_INJECT", ""), "inject")),
        patches=patches_from_table(parse_kv(env.get("VLLM_GUARD_PATCHES", ""), "patches")),
    )
