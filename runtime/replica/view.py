"""What `decide` looks at: an immutable view of one replica at one instant, and the events and
effects that pass between `decide` and its driver.

The view is built by the driver from what the monitors cached (process exits, readiness, the
startup gate, hang verdicts, memory readings, whether a stopped generation's processes and GPU
memory are gone) — no I/O happens while it is built or while `decide` runs. Effects are plain
data that the driver carries out through narrow interfaces (spawner, router, ledger).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.plugin import KV_HELD
from vllm_guard.core.ledger import EndClass

from ..child.death import Death
from .machine import Machine, Recycle
from .strategy import MemoryFit, StartHistory
from .triggers import Growth


class Slot(str, enum.Enum):
    CURRENT = "current"  # the generation new requests go to (or that is starting as the replica's own)
    SUCCESSOR = "successor"  # the next one, starting beside it (overlap, gated)


class GenPhase(str, enum.Enum):
    BOOTING = "booting"  # spawned, not serving yet
    SERVING = "serving"  # routed: takes requests
    DRAINING = "draining"  # no new requests; in-flight ones finish
    STOPPING = "stopping"  # signalled; waiting for its processes (and GPU memory) to go
    DONE = "done"  # gone and recorded


@dataclass(frozen=True)
class GenView:
    """One generation's facts."""

    number: int
    phase: GenPhase = GenPhase.BOOTING
    spawned_at: float = 0.0
    gated: bool = False
    beside: bool = False  # spawned as a successor, beside a serving generation
    standby: bool = False  # spawned as the replica's standby (parked until it is needed)
    config: str = ""  # the hash of the configuration it was launched with
    ready_at: float | None = None  # /health 200 and a real completion
    exit_code: int | None = None  # its API server exited
    engine_dead: int | None = None  # an engine process died while the API server lives
    hang: str | None = None  # the probe's verdict, why it is hung
    gate: str | None = None  # its gate report: parked | opened | skipped | timed_out; None: none yet
    gate_reason: str = ""
    gate_open: bool = False  # the runtime opened its gate: it goes on, parked or not yet there
    in_flight: int = 0
    requests: int = 0  # counted requests toward its limit (its inherited backlog excluded)
    served: int = 0  # every counted request it took
    inherited: int = 0
    limit: int | None = None
    idle_for: float = 0.0
    growth: Growth | None = None
    to_limit_s: float | None = None  # memory: seconds until it runs out at the current growth rate
    gpu_mb_s: float | None = None  # its GPU memory's growth rate (MB/s); None: too few readings yet
    fit: MemoryFit | None = None  # the readings a recycle's strategy is chosen from
    deadline: float | None = None  # of its drain or stop (monotonic)
    kill_sent: bool = False
    stop_mark: float | None = None  # when it was signalled
    gone: bool = False  # no process of it is left
    gpu_free: bool = True  # NVML shows none of its memory (True without NVML)
    alive: tuple[int, ...] = ()  # its pids still alive (while stopping)
    end_reason: tuple[str, EndClass] = ("", EndClass.SCHEDULED)  # recorded when it ends
    death: Death | None = None  # it exited on its own before it ever served: why (read from its log)
    kv: str = ""  # held: it maps the replica holder's KV cache (asked, or as its engine reported); own; "": unknown
    kv_mb: float = 0.0  # the held KV cache's size (MiB), once its engine reported it
    weights_mb: float = 0.0  # the held weights it maps (MiB): mapped, or loaded and given to the holder
    late: bool = False  # gated to park once ready on the held KV cache, not before CUDA
    paced: bool = False  # its engine start is paced for a generation serving beside it, and still told to
    pinned: bool = False  # it started on a few CPUs beside a serving generation (`core.startcpus`), and still runs there

    @property
    def held_back(self) -> bool:
        """Its start is still held back for a generation serving beside it (paced or pinned):
        `Unpace` lets it go at full speed once nothing serves beside it."""
        return self.paced or self.pinned

    @property
    def maps_held_kv(self) -> bool:
        """It maps (or will map) the holder's KV cache and is not gone: nothing else may compute on it."""
        return self.kv == KV_HELD and self.phase is not GenPhase.DONE and not self.gone

    @property
    def died(self) -> bool:
        return self.exit_code is not None or self.engine_dead is not None


@dataclass(frozen=True)
class Facts:
    """What the replica knows of the runtime around it."""

    cfg: GuardConfig
    index: int = 0
    # every replica's machine by index, as the runtime holds them now (this one's is skipped):
    # `decide` applies the rolling rule and the hold's to them
    peers: tuple[Machine, ...] = ()
    stopping: bool = False  # the runtime shuts down (a signal, the failure limit)
    hold: str | None = None
    failures_in_window: int = 0  # unplanned failures within [server] failure_window
    gate_unavailable: str | None = None  # learned: this vLLM cannot park at the gate
    starts: StartHistory = field(default_factory=StartHistory)
    gpu_room: bool | None = None  # NVML shows room for the next generation to start; None: unknown
    standby_failures: int = 0  # standbys in a row that died or could not park
    gpu_mb_s: float | None = None  # the replica's GPU memory growth rate (MB/s) as its generations last measured it
    nvml: bool = False  # GPU readings exist on this box
    ready_sent: bool = False  # systemd heard READY=1
    extend_sent_at: float = 0.0  # when EXTEND_TIMEOUT_USEC last went out
    config_hash: str = ""  # of `cfg`: a standby launched with another one is replaced (a reload)

    @property
    def replicas(self) -> int:
        return max(1, len(self.peers))


@dataclass(frozen=True)
class ReplicaView:
    machine: Machine
    facts: Facts
    current: GenView | None = None
    successor: GenView | None = None
    retiring: tuple[GenView, ...] = ()


# -- events ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tick:
    """A look: the facts may have changed."""


@dataclass(frozen=True)
class RecycleCmd:
    reason: str
    cls: EndClass = EndClass.SCHEDULED
    strategy: str | None = None  # overlap | gated | cold for this recycle only


@dataclass(frozen=True)
class RestartCmd:
    reason: str
    cls: EndClass = EndClass.UNPLANNED


@dataclass(frozen=True)
class HoldCmd:
    reason: str


@dataclass(frozen=True)
class ReleaseCmd:
    pass


@dataclass(frozen=True)
class StopCmd:
    second: bool = False  # a second SIGTERM/SIGINT: shorten the ladder
    hand_over: bool = False  # the runtime exits for the next one (`runtime/handover.py`): a serving generation stays up


@dataclass(frozen=True)
class SpawnFailed:
    """The driver could not even launch the interpreter for a generation."""

    error: str


Event = Tick | RecycleCmd | RestartCmd | HoldCmd | ReleaseCmd | StopCmd | SpawnFailed


# -- effects -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spawn:
    slot: Slot
    gated: bool = False
    strategy: str | None = None  # how it comes up: overlap | gated | cold | standby; None: the replica's first
    standby: bool = False  # parks at its gate until it is needed (no limit on how long)
    late: bool = False  # gated: park once ready on the held KV cache (`core.plugin.GATE_AT_VAR`)
    kv: str = KV_HELD  # held: it may map the holder's KV cache (with a holder); own: another generation computes on it


@dataclass(frozen=True)
class GoLive:
    """`current` (`generation`) is ready: route requests to it (its count limit soft when
    `past_limit`)."""

    generation: int
    past_limit: bool


@dataclass(frozen=True)
class Promote:
    """The successor becomes `current`; the old current (if any) retires (drains, stops) behind it."""


@dataclass(frozen=True)
class Abandon:
    """Kill the successor (it stops in the background)."""

    why: str


@dataclass(frozen=True)
class Drain:
    generation: int
    deadline: float
    reason: str
    cls: EndClass
    hand_over: bool = False  # its followed streams go on at the generation now live (an overlap's switch)


@dataclass(frozen=True)
class Stop:
    generation: int
    kill: bool
    deadline: float
    reason: str | None = None  # None: keep the end reason it has
    cls: EndClass | None = None


@dataclass(frozen=True)
class Detach:
    """Leave `generation` running for the next runtime: no longer this runtime's to stop."""

    generation: int


@dataclass(frozen=True)
class Finish:
    generation: int
    leftover: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unpace:
    """Nothing serves beside `generation` any more: its engine start goes on at full speed."""

    generation: int


@dataclass(frozen=True)
class OpenGate:
    generation: int
    kv: str = ""  # what its KV cache is to be if it allocates after the gate: held | own


@dataclass(frozen=True)
class PastLimit:
    """Let `current` take requests past its count limit (nothing queues for it)."""

    allowed: bool = True


@dataclass(frozen=True)
class Leaving:
    """Announce `current` as leaving (readiness turns 503 when nothing else serves)."""

    leaving: bool


@dataclass(frozen=True)
class WatchRoom:
    """Watch whether the replica's GPUs have room for its parked successor (`on`), or stop:
    read while it waits for its gate to open (OPENING_GATE)."""

    on: bool


@dataclass(frozen=True)
class EnforceLimits:
    """Whether a generation stops taking requests at its count limit (the proxy's, for every
    replica): not while held, since no recycle can follow to replace it."""

    on: bool


@dataclass(frozen=True)
class RejectRequests:
    """Requests fail fast with `reason` instead of queueing (held with no replica left running,
    or shutting down); None: they are taken again."""

    reason: str | None


@dataclass(frozen=True)
class Failure:
    generation: int
    kind: str  # a core.ledger.FailureKind value
    exit_code: int | None
    detail: str
    cls: EndClass = EndClass.UNPLANNED
    from_log: bool = False  # add vLLM's root-cause line from the generation's log
    death: Death | None = None  # it died before it ever served: the typed cause (`detail` is its line)


@dataclass(frozen=True)
class RecycleBegan:
    recycle: Recycle


@dataclass(frozen=True)
class RecycleNote:
    """The running recycle changed course (a fallback, a handover): its strategy and why."""

    strategy: str
    why: str


@dataclass(frozen=True)
class RecycleMark:
    """A recycle's milestone for the ledger: drained, stopped."""

    what: str  # drained | stopped


@dataclass(frozen=True)
class RecycleOver:
    """The running recycle ended with no next generation ready (a failure, a hold, a stop)."""


@dataclass(frozen=True)
class RecycleReady:
    generation: int
    duration_s: float
    downtime_s: float


@dataclass(frozen=True)
class Log:
    event: str
    level: str = "info"
    fields: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Extend:
    """Tell systemd the first start takes longer (EXTEND_TIMEOUT_USEC)."""


@dataclass(frozen=True)
class GiveUp:
    """Too many failures in the window: the runtime stops every replica and exits 3."""


@dataclass(frozen=True)
class StartCauseRepeated:
    """Two starts in a row died before serving of the same cause (`child.death.same_cause`):
    restarting cannot help, so the runtime stops every replica and exits 5 (EXIT_START_FAILURE)
    with the line (`Death.line`)."""

    generation: int
    death: Death


@dataclass(frozen=True)
class ExitAll:
    code: int


@dataclass(frozen=True)
class LearnGate:
    reason: str


@dataclass(frozen=True)
class LearnStandby:
    """A standby parked (`failed` False: the count of failed ones starts again) or was lost."""

    failed: bool


@dataclass(frozen=True)
class LearnStart:
    beside: bool
    seconds: float


@dataclass(frozen=True)
class Reply:
    accepted: bool
    detail: str


Effect = (Spawn | GoLive | Promote | Abandon | Drain | Stop | Detach | Finish | OpenGate | Unpace | PastLimit | Leaving
          | WatchRoom | EnforceLimits | RejectRequests | Failure | RecycleBegan | RecycleNote | RecycleMark | RecycleOver
          | RecycleReady | Log | Extend | GiveUp | StartCauseRepeated | ExitAll | LearnGate | LearnStandby | LearnStart
          | Reply)


@dataclass(frozen=True)
class Decision:
    machine: Machine
    effects: tuple[Effect, ...] = ()

    @property
    def reply(self) -> Reply | None:
        return next((e for e in self.effects if isinstance(e, Reply)), None)


def log(event: str, level: str = "info", **fields: object) -> Log:
    return Log(event, level, tuple(fields.items()))
