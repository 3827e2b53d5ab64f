"""The seed matrix presets, scaled to the model's context (the `[soak]` config section is
`vllm_guard.core.config.SoakConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_guard.core.errors import ConfigError

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
        pp, po, pc = PRESETS[name]
        base = (prompt_tokens or pp, output_tokens or po, concurrency or pc)
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
