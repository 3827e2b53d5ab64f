"""The admin protocol: typed, versioned messages between the runtime and its clients.

The runtime answers `GET /status` with a `StatusSnapshot` and `POST /command` with a
`CommandReply`; the CLI, the watchdog and the load generator decode them with the same
models, so a renamed or retyped field fails loudly at the reader (ProtocolError) instead of
silently weakening a detector. Models are frozen pydantic models that forbid unknown fields;
`SCHEMA` changes when a field changes meaning (a reader of another schema says so).

The status is bounded: the last `RECENT` failures and recycles plus totals; the ledger has
the rest.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ProtocolError
from .ledger import EndClass
from .sanitize import check_reason

SCHEMA = "vllm-guard-status/2"
RECENT = 10


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuntimeState(str, enum.Enum):
    STARTING = "starting"  # a generation is loading; ready = /health 200 and a 1-token completion
    SERVING = "serving"
    DRAINING = "draining"  # no new dispatch; in-flight requests finish (drain timeout)
    STOPPING = "stopping"  # SIGTERM -> deadline -> SIGKILL -> reap -> memory released
    BACKOFF = "backoff"  # after a failure, before the next start
    HELD = "held"  # an operator or the watchdog said: do not start anything
    EXITING = "exiting"


class Role(str, enum.Enum):
    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    HELPER = "helper"  # e.g. multiprocessing's resource tracker: stopped with the rest


class ChildProcess(_Model):
    pid: int
    role: Role


class ProcessMemory(_Model):
    pid: int
    role: Role
    rss_mb: float
    uss_mb: float | None = None
    swap_mb: float | None = None
    gpu_mb: float | None = None


class MemoryReading(_Model):
    at: str
    requests: int  # requests this generation had taken when read
    rss_mb: float
    uss_mb: float | None
    gpu_mb: float | None
    per_process: list[ProcessMemory]


class MemoryGrowth(_Model):
    rss_mb: float
    uss_mb: float | None
    gpu_mb: float | None


class MemoryStatus(_Model):
    warmup_requests: int
    baseline: MemoryReading | None = None
    current: MemoryReading | None = None
    growth: MemoryGrowth | None = None


class RequestCounters(_Model):
    """Counted requests are those that reached the engine (a completion or chat request that
    got a response from vLLM); 404s, health checks and probes are not counted."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0  # subset of failed: 503 from the queue
    retried: int = 0
    client_disconnects: int = 0
    in_flight: int = 0
    queued: int = 0
    generation: int = 0  # counted requests of the current generation
    generation_limit: int | None = None  # max_requests (+ jitter) of the current generation
    # of `generation`: requests that waited through the recycle or start (its inherited
    # backlog); they do not count toward generation_limit
    generation_inherited: int = 0
    # what the leak attribution regresses memory on; None: this runtime does not count them
    prompt_tokens: int | None = None  # of completed requests, from vLLM's usage record
    output_tokens: int | None = None
    streamed: int | None = None  # counted requests that asked for a stream
    # the public port's bounds: answered by the guard without reaching vLLM (not in the public API,
    # body too large, too slow), open client connections, connections refused or closed at the cap
    not_forwarded: int = 0
    connections: int = 0
    connections_refused: int = 0


class FailureSummary(_Model):
    kind: str
    at: str
    exit_code: int | None
    detail: str
    restored_at: str | None
    generation: int


class RecycleSummary(_Model):
    reason: str
    cls: EndClass
    started: str
    generation: int
    in_flight: int
    queued: int
    duration_s: float | None = None  # start of the recycle -> next generation ready
    downtime_s: float | None = None  # time no generation served
    strategy: str | None = None  # overlap | gated | cold (the one that ran; see strategy_reason)
    strategy_reason: str | None = None  # the memory readings behind the choice, or the override
    replica: int = 0
    next_generation: int | None = None  # the generation that replaces it, once started


class ProbeSummary(_Model):
    at: str
    ok: bool
    latency_s: float
    error: str | None = None
    engine_progress: bool | None = None  # tokens moved during the probe window


class LatencySummary(_Model):
    samples: int = 0
    p50_s: float | None = None
    p99_s: float | None = None


class PatchState(_Model):
    state: Literal["applied", "skipped", "failed"]
    reason: str


class PatchEvents(_Model):
    orphan_events: int = 0
    orphan_blocks_reclaimed: int = 0
    idle_releases: int = 0
    idle_released_bytes: int = 0


class PatchProcessReport(_Model):
    """What the plugin reports from one vLLM process (`patches/gen-N/<pid>.json`)."""

    process: Role
    pid: int
    vllm_version: str = "unknown"
    generation: str | None = None
    patches: dict[str, PatchState] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)  # free-form per-patch summary, shown as is
    inject: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    alive: bool = True
    events: PatchEvents | None = None


class LedgerHealth(_Model):
    ok: bool = True
    pending_writes: int = 0
    failed_writes: int = 0
    last_error: str | None = None


class ReplicaStatus(_Model):
    """One vLLM server behind the proxy (a runtime with one replica has one of these)."""

    index: int
    state: RuntimeState
    generation: int  # the generation new requests go to (0: none yet)
    gpus: list[str] = Field(default_factory=list)  # CUDA_VISIBLE_DEVICES of its generations (UUIDs)
    gpu_name: str | None = None
    backend_url: str | None = None
    in_flight: int = 0
    served: int = 0  # counted requests its current generation took
    limit: int | None = None
    next_generation: int | None = None  # a generation starting beside it (overlap) or parked (gated)
    next_phase: Literal["starting", "parked", "past_gate"] | None = None
    retiring: list[int] = Field(default_factory=list)  # old generations still draining or stopping
    recycle_strategy: str | None = None  # of its recycle in progress, else of its last one


class GateReport(_Model):
    """What a gated generation's EngineCore says at its startup gate (`core.plugin.read_gate`)."""

    state: Literal["parked", "opened", "skipped", "timed_out"]
    pid: int
    at: str
    reason: str = ""
    vllm_version: str = "unknown"
    where: str = ""  # the vLLM function that loaded the plugin (EngineCore.__init__ expected)
    waited_s: float | None = None


class StatusSnapshot(_Model):
    schema_: Literal["vllm-guard-status/2"] = Field("vllm-guard-status/2", alias="schema")
    state: RuntimeState
    state_for_s: float
    generation: int
    pid: int
    port: int
    model: str
    served_model: str | None = None
    vllm_version: str = ""
    gpu_name: str | None = None
    hold: str | None = None
    backend_url: str | None = None
    requests: RequestCounters = Field(default_factory=RequestCounters)
    failures: int = 0
    recent_failures: list[FailureSummary] = Field(default_factory=list)
    recycles: int = 0
    recent_recycles: list[RecycleSummary] = Field(default_factory=list)
    recycle_in_progress: RecycleSummary | None = None
    children: list[ChildProcess] = Field(default_factory=list)
    memory: MemoryStatus | None = None
    ttft: LatencySummary = Field(default_factory=LatencySummary)
    last_probe: ProbeSummary | None = None
    patches: dict[str, PatchProcessReport] = Field(default_factory=dict)
    ledger: LedgerHealth = Field(default_factory=LedgerHealth)
    recycle_strategy: str = "auto"  # [server] recycle_strategy: auto | overlap | gated | cold
    replicas: list[ReplicaStatus] = Field(default_factory=list)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_json(cls, data: Any) -> StatusSnapshot:
        return decode(cls, data)


class Command(str, enum.Enum):
    RECYCLE = "recycle"  # graceful: drain, stop, start the next generation
    RESTART = "restart"  # hard: kill the generation now (its in-flight requests fail)
    HOLD = "hold"  # stop all (re)starting until released
    RELEASE = "release"


# which ledger classes each command may be recorded as (default first)
COMMAND_CLASSES: dict[Command, tuple[EndClass, ...]] = {
    Command.RECYCLE: (EndClass.SCHEDULED, EndClass.PREVENTIVE),
    Command.RESTART: (EndClass.UNPLANNED, EndClass.SCHEDULED, EndClass.PREVENTIVE),
    Command.HOLD: (),
    Command.RELEASE: (),
}


class CommandRequest(_Model):
    command: Command
    reason: str = "operator"
    cls: EndClass | None = None
    replica: int | None = Field(default=None, ge=0)  # recycle/restart one replica; None: all (rolling, one at a time)

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str) -> str:
        return check_reason(v)

    def ledger_class(self) -> EndClass | None:
        allowed = COMMAND_CLASSES[self.command]
        if not allowed:
            return None
        if self.cls is None:
            return allowed[0]
        if self.cls not in allowed:
            raise ProtocolError(f"class has value {self.cls.value!r}: {self.command.value} accepts "
                                f"{', '.join(c.value for c in allowed)}")
        return self.cls


class CommandReply(_Model):
    command: Command
    accepted: bool
    detail: str  # why not, when refused; what happens next, when accepted
    state: RuntimeState
    generation: int


class ErrorReply(_Model):
    error: str


def decode(model: type[Any], data: Any) -> Any:
    """`model` from JSON data, or ProtocolError with the first problem in one line."""
    if isinstance(data, dict) and "schema" in data and model is StatusSnapshot and data["schema"] != SCHEMA:
        raise ProtocolError(f"status schema {data['schema']!r}, this reader speaks {SCHEMA!r} "
                            "(runtime and client are different versions)")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or model.__name__
        raise ProtocolError(f"{model.__name__}: {where}: {first.get('msg')}") from e
