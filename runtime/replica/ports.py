"""The narrow interfaces a replica's driver carries effects out through.

The driver never sees the supervisor: it launches generations through a `Spawner`, routes
through a `Door` (the proxy), records through `Books` (the ledger and the bounded records),
starts watchers through `Watchers` and tells the runtime what only the runtime acts on through
`Hub`; a launch and the monitors write their rows through `Ledger`. Tests give fakes of these;
the runtime gives the real ones: the launcher and monitor kit (replica itself), the proxy (the
door), the books and ledger writer (`records`, which imports the replica, never the other way)
and the supervisor (the hub).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import HolderStatus

from ..frontdoor.target import Target
from .generation import Generation
from .machine import Recycle

if TYPE_CHECKING:
    from vllm_guard.core.protocol import MemoryReading


class Spawner(Protocol):
    async def spawn(self, replica: int, strategy: str | None, gated: bool, beside: bool,
                    standby: bool = False, late: bool = False, kv: str = "held") -> Generation:
        """Launch a generation of `replica` (OSError: the interpreter cannot even be run); `late`
        and `kv` as `view.Spawn` says (applied only where the replica has a holder on a GPU)."""

    async def went_live(self, gen: Generation) -> None:
        """It serves now: what its processes said about their start (where its weights came from)."""

    def holder_status(self, replica: int) -> HolderStatus | None:
        """The replica's weight holder, if it has one."""

    async def unpace(self, gen: Generation) -> None:
        """Tell `gen`'s paced start that nothing serves beside it any more (`core.plugin.unpace`)."""

    async def unpin(self, gen: Generation, why: str) -> None:
        """`gen` may use every CPU of the runtime from now on (it started on a few: `core.startcpus`)."""


class Door(Protocol):
    enforce_limit: bool  # a generation stops taking requests at its count limit (not while held)

    @property
    def queued(self) -> int: ...

    async def set_reject(self, reason: str | None) -> None:
        """Fail requests fast with `reason` (None: take them again)."""

    async def add_target(self, target: Target, replica: int = 0) -> None: ...

    async def stop_dispatch(self, target: Target, dead: bool = False, hand_over: bool = False) -> None: ...

    async def allow_past_limit(self, target: Target, allowed: bool = True) -> None: ...

    def set_leaving(self, target: Target, leaving: bool) -> None: ...

    def queue_mark(self) -> int:
        """The queue's high-water mark since the last call (it starts again from now)."""


class Ledger(Protocol):
    """The rows a generation's launch and its monitors write (`records.writer.RuntimeLedger`:
    queued, never blocking)."""

    def generation_started(self, generation: int, pid: int, pid_started: float | None, model: str,
                           replica: int = 0, strategy: str | None = None, config_hash: str | None = None,
                           config_changed: Sequence[str] = ()) -> int:
        """Its row's id."""

    def generation_progress(self, row: int, requests_served: int) -> None: ...

    def process_memory(self, generation: int, replica: int, reading: MemoryReading,
                       host_available_mb: float | None = None, gpu_free_mb: float | None = None) -> None: ...


class Books(Protocol):
    def generation_ready(self, gen: Generation) -> None: ...

    def generation_ended(self, gen: Generation, leftover: tuple[int, ...]) -> None: ...

    def failure(self, gen: Generation, kind: str, exit_code: int | None, detail: str, cls: EndClass) -> None: ...

    def restored(self, replica: int) -> None:
        """A generation of `replica` serves: its failures so far are restored."""

    def recycle_began(self, replica: int, rec: Recycle, in_flight: int, queued: int) -> None: ...

    def recycle_note(self, replica: int, strategy: str, why: str, next_generation: int | None) -> None: ...

    def recycle_mark(self, replica: int, what: str) -> None: ...

    def recycle_over(self, replica: int) -> None:
        """The replica's recycle ended with no next generation ready."""

    def recycle_ready(self, replica: int, generation: int, duration_s: float, downtime_s: float,
                      queued: int) -> None: ...


class Watchers(Protocol):
    def booting(self, gen: Generation) -> None:
        """Readiness (and the gate of a gated one) while it starts."""

    def serving(self, gen: Generation) -> None:
        """The probe and memory sampling while it serves."""

    def stopping(self, gen: Generation) -> None:
        """Its processes and GPU memory, until they are gone."""

    def room(self, replica: int, note: Callable[[bool], None]) -> Callable[[], None]:
        """Whether its GPUs have room for the next start; returns how to stop watching."""


class Hub(Protocol):
    """What only the runtime acts on."""

    def give_up(self) -> None: ...

    def start_failure(self, line: str) -> None:
        """Two starts in a row died before serving of the same cause (`line`): stop every
        replica and exit EXIT_START_FAILURE."""

    def exit_all(self, code: int) -> None: ...

    def reap_later(self, pids: list[int]) -> None: ...

    def learn_gate(self, reason: str) -> None: ...

    def learn_start(self, replica: int, beside: bool, seconds: float) -> None: ...

    def learn_standby(self, replica: int, failed: bool) -> None: ...

    def ready(self) -> None: ...

    def extend(self) -> None: ...

    def state_changed(self) -> None: ...

    def handed_over(self, gen: Generation) -> None:
        """`gen` is left running for the next runtime (`runtime/handover.py` records it)."""
