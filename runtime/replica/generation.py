"""One generation as the runtime holds it: its processes, its proxy target, what the monitors
last saw of it, and where it is on its way out.

Only two kinds of writers, each through its own methods: the monitors note what they observed
(`note_*`), and the driver records what `decide` chose (`begin_drain`, `begin_stop`, ...). Nothing
else assigns to a generation. `view()` is the immutable `GenView` that `decide` looks at.
A new generation starts with nothing inherited from the last one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import (
    ChildProcess, GateReport, KvReport, MemoryStatus, PatchProcessReport, Role, Source, WeightsReport,
)

from ..child import death as deaths
from ..child.anatomy import Anatomy
from ..child.backend import Backend
from ..frontdoor.target import Target
from .strategy import MemoryFit
from .triggers import Growth
from .view import GenPhase, GenView


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
    beside: bool = False  # spawned as a successor, beside a serving generation
    standby: bool = False  # the replica's standby: parked at its gate until it is needed
    config: str = ""  # the hash of the configuration it was launched with (`runtime/reload.py`)
    adopted: bool = False  # handed over by a previous runtime (`child/handover.py`), not started here
    # what the monitors found (read off the event loop; status only assembles them)
    ready_mono: float | None = None
    hang: str | None = None
    dead_engine: int | None = None
    gate_report: GateReport | None = None
    gate_open: bool = False  # the runtime created its gate's `open` file
    children: list[ChildProcess] = field(default_factory=list)
    engine_pids: list[int] = field(default_factory=list)  # EngineCore and workers, known at ready
    patches: dict[str, PatchProcessReport] = field(default_factory=dict)
    memory: MemoryStatus | None = None
    growth: Growth | None = None
    to_limit_s: float | None = None
    gpu_mb_s: float | None = None  # its GPU memory's growth rate (MB/s), once the forecast has its readings
    fit: MemoryFit | None = None
    held_mb: tuple[float, float | None] | None = None  # a standby's host RSS and GPU memory (MiB)
    death: deaths.Death | None = None  # why it exited on its own before it ever served (its log)
    weights: WeightsReport | None = None  # where its weights came from (its engine's report, at ready)
    kv: str = ""  # held | own: the KV cache asked for at spawn (or at its gate), then as its engine reported
    kv_mb: float = 0.0
    kv_report: KvReport | None = None  # its engine's word on its KV cache
    late: bool = False  # gated to park once ready on the held KV cache
    paced: bool = False  # asked to pace its engine work (`patches/pace.py`): something served beside its start
    unpaced: bool = False  # told to stop pacing: nothing serves beside it any more
    # its way out, as decided
    phase: GenPhase = GenPhase.BOOTING
    deadline: float | None = None
    kill_sent: bool = False
    stop_mark: float | None = None
    gone: bool = False
    gpu_free: bool = True
    alive: tuple[int, ...] = ()
    end_reason: tuple[str, EndClass] = ("", EndClass.SCHEDULED)
    anatomy: Anatomy | None = None  # where its start went (set at spawn)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)  # its monitors while booting or serving
    stop_task: asyncio.Task[Any] | None = None

    @property
    def ended(self) -> bool:
        return self.phase is GenPhase.DONE

    @property
    def listed_children(self) -> list[ChildProcess]:
        return [c for c in self.children if c.role is not Role.HELPER]

    def view(self, queued: int, now: float) -> GenView:
        t, b, g = self.target, self.backend, self.gate_report
        idle = 0.0 if t.in_flight or queued else now - t.last_activity
        return GenView(
            number=self.number, phase=self.phase, spawned_at=self.spawned_mono, gated=self.gate is not None,
            beside=self.beside, standby=self.standby, ready_at=self.ready_mono, exit_code=b.returncode, engine_dead=self.dead_engine,
            hang=self.hang, gate=g.state if g is not None else None, gate_reason=g.reason if g is not None else "",
            gate_open=self.gate_open,
            in_flight=t.in_flight, requests=t.toward_limit, served=t.dispatched, inherited=t.inherited,
            limit=t.limit, idle_for=idle, growth=self.growth, to_limit_s=self.to_limit_s, gpu_mb_s=self.gpu_mb_s,
            fit=self.fit,
            deadline=self.deadline, kill_sent=self.kill_sent, stop_mark=self.stop_mark, gone=self.gone,
            gpu_free=self.gpu_free, alive=self.alive, end_reason=self.end_reason, death=self.death,
            config=self.config, kv=self.kv, kv_mb=self.kv_mb, late=self.late,
            paced=self.paced and not self.unpaced, pinned=bool(b.cpus),
            weights_mb=self.weights.bytes / 2**20 if self.weights is not None and
            (self.weights.source is Source.HELD or self.weights.given) else 0.0)

    # -- the monitors' notes -------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.anatomy is None:
            self.anatomy = Anatomy(self.spawned_mono)

    def mark(self, phase: str, at: float) -> None:
        """A milestone of its start (`child.anatomy`)."""
        assert self.anatomy is not None
        self.anatomy.mark(phase, at)

    def start_phases(self) -> list[tuple[str, float]]:
        """Its start's phases, seconds after spawn (the first request routed included, once it was)."""
        assert self.anatomy is not None
        first = self.target.first_dispatch
        if first is not None:
            self.anatomy.mark("first_request", first)
        return self.anatomy.phases()

    def died_unread(self) -> bool:
        """Its API server exited on its own (no stop was sent) before it ever served, and why
        has not been read from its log yet."""
        return self.death is None and self.phase is GenPhase.BOOTING and self.backend.returncode is not None

    def note_death(self, log_text: str, at: float) -> None:
        """Why it died, from its log: the phases the tail had not read yet, then the cause."""
        assert self.anatomy is not None
        self.anatomy.feed(log_text, at)
        self.death = deaths.read(log_text, self.backend.returncode, self.anatomy.under_way())

    def note_ready(self, at: float) -> None:
        self.ready_mono = at
        self.mark("ready", at)

    def note_hang(self, why: str) -> None:
        self.hang = why

    def note_gate(self, report: GateReport | None, at: float | None = None) -> None:
        self.gate_report = report
        if report is not None and report.state == "parked" and at is not None:
            self.mark("parked", at)

    def note_tree(self, found: list[ChildProcess], dead: int | None, patches: dict[str, PatchProcessReport]) -> None:
        self.children, self.patches = found, patches
        self.note_kv(patches)
        if dead is not None and self.dead_engine is None:
            self.dead_engine = dead

    def note_kv(self, reports: Mapping[str, PatchProcessReport]) -> KvReport | None:
        """Where its KV cache came from, if its engine's report (among `reports`) says it yet
        (held: what it maps of the holder's)."""
        report = next((r.kv for r in reports.values() if r.kv is not None), None)
        if report is not None:
            self.kv, self.kv_mb, self.kv_report = report.source, report.bytes / 2**20, report
        return report

    def note_weights(self, report: WeightsReport | None) -> None:
        """Where its weights came from, as its engine reported (at ready)."""
        self.weights = report

    def note_engines(self, found: list[ChildProcess]) -> None:
        self.children = found
        self.engine_pids = [c.pid for c in found if c.role in (Role.ENGINE_CORE, Role.WORKER)]

    def note_memory(self, status: MemoryStatus, growth: Growth | None, fit: MemoryFit | None,
                    to_limit_s: float | None, gpu_mb_s: float | None = None) -> None:
        self.memory, self.growth, self.fit, self.to_limit_s = status, growth, fit, to_limit_s
        self.gpu_mb_s = gpu_mb_s

    def note_held(self, rss_mb: float, gpu_mb: float | None) -> None:
        self.held_mb = (rss_mb, gpu_mb)

    def note_stop(self, alive: list[int], gpu_free: bool) -> None:
        self.alive, self.gone, self.gpu_free = tuple(alive), not alive, gpu_free

    # -- the driver's records of what was decided --------------------------------------------------
    def went_live(self) -> None:
        self.phase = GenPhase.SERVING

    def begin_drain(self, deadline: float, reason: tuple[str, EndClass]) -> None:
        self.phase, self.deadline, self.end_reason = GenPhase.DRAINING, deadline, reason

    def begin_stop(self, kill: bool, deadline: float, now: float, reason: tuple[str, EndClass] | None) -> None:
        self.phase, self.deadline = GenPhase.STOPPING, deadline
        self.kill_sent = self.kill_sent or kill
        if self.stop_mark is None:
            self.stop_mark = now
        if reason is not None:
            self.end_reason = reason

    def finished(self) -> None:
        self.phase = GenPhase.DONE
        self.children = []
        self.cancel_tasks()
        if self.stop_task is not None:
            self.stop_task.cancel()
            self.stop_task = None

    def watch_stop(self, task: asyncio.Task[Any]) -> None:
        if self.stop_task is None:
            self.stop_task = task
        else:
            task.cancel()

    def add_task(self, task: asyncio.Task[Any]) -> None:
        self.tasks.append(task)

    def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks = []
