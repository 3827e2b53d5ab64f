"""Where a generation's start goes: its phases, each with the time it was reached.

A recycle's gap is the part of a start after the old generation stopped; to shorten it one must
see where it goes. The runtime knows its own milestones (spawned, parked at the gate, gate opened,
`/health` answered, the ready probe passed, the first request routed); vLLM's are read from the
lines it logs (weights loaded, compile, KV cache allocated, CUDA graphs captured, engine up),
noted the moment they appear in the generation's log (`log_loop` tails it while it starts) —
vLLM's own timestamps have whole seconds only. Pure: lines and times in, phases out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_guard.core.phases import ORDER, UNDER_WAY

# vLLM's log lines for its own phases (0.25 and 0.32), first match wins per phase
VLLM_PHASES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_load_started", re.compile(r"Starting to load model")),
    ("weights_loaded", re.compile(r"Loading weights took|Model loading took")),
    ("compiled", re.compile(r"torch\.compile takes|Compiling a graph for .* takes|Directly load the compiled graph")),
    ("kv_allocated", re.compile(r"Available KV cache memory|GPU KV cache size|Maximum concurrency for")),
    ("graphs_captured", re.compile(r"Graph capturing finished")),
    ("engine_up", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("api_up", re.compile(r"Application startup complete")),
)


@dataclass
class Anatomy:
    """One generation's start: phase -> monotonic time first reached."""

    spawned: float
    at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.at.setdefault("spawned", self.spawned)

    def mark(self, phase: str, t: float) -> None:
        """The runtime reached one of its milestones (the first time counts)."""
        self.at.setdefault(phase, t)

    def feed(self, text: str, t: float) -> None:
        """New lines of the generation's log, seen at `t`."""
        for line in text.splitlines():
            for phase, pattern in VLLM_PHASES:
                if phase not in self.at and pattern.search(line):
                    self.at[phase] = t

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds after spawn), in the order a start goes through them."""
        return [(p, round(self.at[p] - self.spawned, 3)) for p in ORDER if p in self.at]

    def under_way(self) -> str:
        """What the start was doing: the step after the furthest phase it reached."""
        last = next((p for p in reversed(ORDER) if p in self.at), "spawned")
        return UNDER_WAY[last]

    def after(self, phase: str) -> list[tuple[str, float]]:
        """The phases after `phase` (e.g. the gate), in seconds after it."""
        base = self.at.get(phase)
        if base is None:
            return []
        return [(p, round(self.at[p] - base, 3)) for p in ORDER if p in self.at and self.at[p] >= base and p != phase]
