"""The seed matrix presets, scaled to the model's context, and the `[soak]` config section."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_guard.runtime.config import ConfigError, parse_duration

# name -> (prompt tokens, output tokens, concurrency): the seed's four scenarios.
PRESETS: dict[str, tuple[int, int, int]] = {
    "S1": (512, 256, 1),
    "S2": (8192, 1024, 4),
    "S3": (65536, 512, 1),
    "S4": (2048, 512, 32),
}
MARGIN_TOKENS = 8  # room for special tokens the server may add


@dataclass(frozen=True)
class Shape:
    name: str
    prompt_tokens: int
    output_tokens: int
    concurrency: int | None
    note: str = ""


def scenario(name: str, max_model_len: int | None, prompt_tokens: int | None = None,
             output_tokens: int | None = None, concurrency: int | None = None) -> Shape:
    """A preset (or `custom`), explicit values winning, scaled down to fit `max_model_len`."""
    if name == "custom":
        if prompt_tokens is None or output_tokens is None:
            raise ConfigError("scenario custom needs --prompt-tokens and --output-tokens")
        base = (prompt_tokens, output_tokens, concurrency)
    elif name in PRESETS:
        p, o, c = PRESETS[name]
        base = (prompt_tokens or p, output_tokens or o, concurrency or c)
    else:
        raise ConfigError(f"scenario has value {name!r}: one of {', '.join(PRESETS)}, custom")
    p, o, c = base
    if p < 1 or o < 1:
        raise ConfigError(f"prompt/output tokens have values {p}/{o}: must be >= 1")
    note = ""
    if max_model_len and p + o > max_model_len - MARGIN_TOKENS:
        k = (max_model_len - MARGIN_TOKENS) / (p + o)
        p2, o2 = max(1, math.floor(p * k)), max(1, math.floor(o * k))
        note = (f"{name} {p}/{o} tokens scaled by {k:.4f} to {p2}/{o2} "
                f"to fit max_model_len {max_model_len}")
        p, o = p2, o2
    return Shape(name, p, o, c, note)


# [soak] keys in guard.toml -> (type, CLI dest). Durations are parsed with parse_duration.
SOAK_KEYS: dict[str, type] = {
    "url": str, "scenario": str, "duration": str, "rate": float, "burstiness": float,
    "concurrency": int, "db": str, "seed": int, "mode": str, "timeout": str,
    "prompt_tokens": int, "output_tokens": int, "model": str, "state_dir": str,
    "sample_interval": str,
}
_DURATIONS = {"duration", "timeout", "sample_interval"}


def validate_section(section: dict[str, Any]) -> dict[str, Any]:
    """Check guard.toml's [soak] table: unknown key or wrong type -> ConfigError naming both."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key not in SOAK_KEYS:
            raise ConfigError(f"[soak] {key} has value {value!r}: unknown key (known: {', '.join(SOAK_KEYS)})")
        typ = SOAK_KEYS[key]
        if key in _DURATIONS:
            parse_duration(value, f"[soak] {key}")
            out[key] = str(value) if not isinstance(value, (int, float)) else f"{value}s"
            continue
        ok = isinstance(value, typ) and not isinstance(value, bool)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"[soak] {key} has value {value!r}: expected {typ.__name__}")
        out[key] = value
    return out
