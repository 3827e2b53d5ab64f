"""One generation as the supervisor tracks it: its processes, its proxy target, what the
monitors last saw of it, and how it started (cold, beside its predecessor, or through a gate).
A new generation starts with nothing inherited from the last one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_guard.core.protocol import ChildProcess, MemoryStatus, PatchProcessReport, Role

from .backend import Backend
from .proxy import Target
from .triggers import Growth


@dataclass(eq=False)
class Generation:
    number: int
    backend: Backend
    target: Target
    row: int  # its ledger row
    replica: int = 0
    strategy: str | None = None  # how it came up: overlap | gated | cold; None: the replica's first
    gate: Path | None = None  # a gated generation's startup gate (core.plugin.gate_dir)
    spawned_mono: float = 0.0
    ready_mono: float | None = None
    hang: str | None = None  # set by the probe monitor: why this generation is hung
    ended: bool = False  # stopped and recorded in the ledger
    engine_pids: list[int] = field(default_factory=list)  # EngineCore and workers, known at ready
    # cached by the monitors (read off the event loop; status only assembles them)
    children: list[ChildProcess] = field(default_factory=list)
    dead_engine: int | None = None
    patches: dict[str, PatchProcessReport] = field(default_factory=dict)
    memory: MemoryStatus | None = None
    growth: Growth | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def listed_children(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role is not Role.HELPER]

    def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks = []
