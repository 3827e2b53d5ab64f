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

SCHEMA = "vllm-guard-status/5"
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


# Which states of a replica take an admin command: the runtime's command handling refuses it
# elsewhere (HTTP 409), and the watchdog does not send it elsewhere. A restart kills a generation
# that exists (starting, serving or draining; a stopping one is already going); a recycle
# replaces a serving one.
RESTARTABLE: frozenset[RuntimeState] = frozenset({RuntimeState.STARTING, RuntimeState.SERVING,
                                                  RuntimeState.DRAINING})
RECYCLABLE: frozenset[RuntimeState] = frozenset({RuntimeState.SERVING})


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


class RejectReason(str, enum.Enum):
    """Why a request was `rejected`: refused, the service did not fail it."""

    NOT_SERVED = "not_served"  # not part of the public API (404, 405); such requests are never counted
    BODY_TOO_LARGE = "body_too_large"  # 413: over [server] max_body_mb
    BODY_STALLED = "body_stalled"  # 408: the body stopped coming for [server] idle_timeout
    BODY_BUFFER_FULL = "body_buffer_full"  # 503: bodies held at once over [server] body_buffer_mb
    BAD_REQUEST = "bad_request"  # 400 from the guard: not a JSON object, a field of the wrong type
    N_TOO_LARGE = "n_too_large"  # 400: n (or best_of) over [server] max_n
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"  # 400: a sequence may run past [server] max_tokens
    REQUEST_TOKENS_TOO_LARGE = "request_tokens_too_large"  # 400: sequences x max_tokens over max_request_tokens
    CLIENT_REQUESTS = "client_requests"  # 429: the client has [server] max_client_requests in flight
    CLIENT_TOKENS = "client_tokens"  # 429: the client's requests in flight ask for max_client_tokens
    VLLM_REFUSED = "vllm_refused"  # a 4xx answer from vLLM (a prompt longer than the context, a bad field)
    UNAVAILABLE = "unavailable"  # 503: held, or shutting down (the operator's decision)


class FailReason(str, enum.Enum):
    """Why a request `failed`: the service could not serve it."""

    BACKEND_ERROR = "backend_error"  # 502: the backend failed before answering, after the retry
    BACKEND_BROKE = "backend_broke"  # the answer broke off (an error event, cut short) or was a 5xx
    UNRESUMABLE = "unresumable"  # its backend died mid-stream and the stream could not go on elsewhere
    QUEUE_TIMEOUT = "queue_timeout"  # 503: no backend became ready within [server] queue_max_wait
    QUEUE_FULL = "queue_full"  # 503: [server] queue_size requests were already waiting


class RequestCounters(_Model):
    """Counted requests are the engine requests (completions, chat, embeddings...) the proxy
    received. Each ends in exactly one of completed, rejected, failed, client_disconnects, so
    their sum is `total` less those still in progress (in_flight, queued, or reading a body)."""

    total: int = 0
    completed: int = 0  # answered in full by vLLM (2xx)
    failed: int = 0  # the service failed them (failed_by says how); never a client's doing
    rejected: int = 0  # refused: a client error or a bound (rejected_by says which), held, shutting down
    retried: int = 0  # attempts that failed before any byte reached the client and were tried again
    client_disconnects: int = 0  # the client left before the end
    rejected_by: dict[RejectReason, int] = Field(default_factory=dict)
    failed_by: dict[FailReason, int] = Field(default_factory=dict)
    resumed: int = 0  # streams that went on at another generation after their backend died (once each)
    resumes: int = 0  # continuations sent (a stream resumed twice counts two), hand-overs included
    handed_over: int = 0  # streams an overlap's switch moved on to the new generation (no failure; once each)
    unresumable: int = 0  # streams cut by a dead backend that could not go on (part of failed)
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
    # body too large or too slow, refused at admission), open client connections, connections
    # refused or closed at the cap, client connections lost in the middle of a request (a client
    # that half-closed or reset its connection while the guard read its body or wrote the answer)
    not_forwarded: int = 0
    connections: int = 0
    connections_refused: int = 0
    connections_lost: int = 0


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


class WarmImports(_Model):
    """The modules one vLLM process imported after its plugin loaded, up to its engine up (EngineCore)
    or its app started (API server): what the next gated generation imports before it parks."""

    schema_: Literal["vllm-guard-warm-imports/1"] = Field("vllm-guard-warm-imports/1", alias="schema")
    role: Literal["api_server", "engine_core"]
    vllm_version: str
    recorded_at: str
    generation: str | None = None
    modules: list[str] = Field(default_factory=list)  # in the order they were first imported


class WarmReport(_Model):
    """What a gated generation's process did before its gate with a `WarmImports` list."""

    role: Literal["api_server", "engine_core"]
    listed: int = 0  # modules in the list it found (0: no list yet, e.g. the first recycle)
    imported: int = 0  # newly imported here
    failed: list[str] = Field(default_factory=list)  # modules whose import raised (imported after the gate)
    seconds: float = 0.0
    gc_frozen: int = 0  # objects moved out of the collector's sight (gc.freeze) before the gate
    note: str = ""  # why nothing was imported (no list, another vLLM version, an error)


class Source(str, enum.Enum):
    """Where a generation's weights came from."""

    HELD = "held"  # mapped from the holder
    DISK = "disk"  # read from the checkpoint (and then given to the holder, if there is one)


class WeightsReport(_Model):
    """What a generation's engine says about its weights (part of its `PatchProcessReport`)."""

    source: Source
    reason: str = ""  # why from disk (the holder's miss, or why there is no holder)
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0  # building the model and getting its weights (map or load)
    given: bool = False  # DISK: the holder took a copy for the next generation
    give_error: str = ""


class KvReport(_Model):
    """What a generation's engine says about its KV cache (part of its `PatchProcessReport`):
    mapped from the replica's holder (`held`), or allocated as vLLM does (`own`, with why)."""

    source: Literal["held", "own"]
    reason: str = ""
    bytes: int = 0
    buffers: int = 0
    seconds: float = 0.0


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
    warm: WarmReport | None = None  # a gated generation's warm start in this process (`[server] warm_start`)
    weights: WeightsReport | None = None  # where its model's weights came from (`[server] hold_weights`)
    kv: KvReport | None = None  # where its KV cache came from (held with the weights, or its own)


class LedgerHealth(_Model):
    ok: bool = True
    pending_writes: int = 0
    failed_writes: int = 0
    last_error: str | None = None


class StandbyStatus(_Model):
    """A replica's standby: its next generation, parked at the startup gate until needed."""

    generation: int
    phase: Literal["starting", "parked", "opened"]  # booting to its gate, waiting there, going on
    rss_mb: float | None = None  # host memory of its processes
    gpu_mb: float | None = None  # GPU memory it holds (None: no NVML)
    ready: bool = False  # late-gated: it parks ready on the held KV cache (its graphs captured), not before CUDA


class StartPhase(_Model):
    """One milestone of a generation's start (`runtime/child/anatomy.py`), seconds after its spawn:
    spawned, parked, gate_opened, model_load_started, weights_loaded, compiled, kv_allocated,
    graphs_captured, engine_up, api_up, health_ok, ready, first_request."""

    phase: str
    s: float


class HolderStatus(_Model):
    """A replica's weight holder (`core.holder`): the copy generations map instead of the checkpoint."""

    pid: int | None = None
    alive: bool = True
    state: Literal["empty", "filling", "held", "stale", "unknown"] = "unknown"
    tensors: int = 0
    bytes: int = 0
    handed: int = 0  # generations that mapped this copy
    stale: str = ""  # why the copy is never handed out again (the holder restarts once nothing maps it)
    kv_bytes: int = 0  # the KV cache it holds for the generations that share it (0: none)
    kv_mappers: list[int] = Field(default_factory=list)  # live engine pids that map that KV cache
    drops: int = 0  # copies dropped (each a restart of the holder)
    last_drop: str = ""
    pending_drop: str = ""  # a drop waiting for the generations that map the copy to go
    error: str = ""  # the holder did not answer, or exited


class ReplicaStatus(_Model):
    """One vLLM server behind the proxy (a runtime with one replica has one of these)."""

    index: int
    state: RuntimeState
    # the replica's own state (runtime/replica/machine.py): serving, waiting_turn, overlap_starting,
    # gated_parking, unready, draining, stopping, opening_gate, past_gate, failing, backoff, held...
    phase: str = ""
    generation: int  # the generation new requests go to (0: none yet)
    gpus: list[str] = Field(default_factory=list)  # CUDA_VISIBLE_DEVICES of its generations (UUIDs)
    gpu_name: str | None = None
    backend_url: str | None = None
    pid: int | None = None  # the API server at backend_url (its CPU time tells starved from stopped)
    in_flight: int = 0
    served: int = 0  # counted requests its current generation took
    limit: int | None = None
    next_generation: int | None = None  # a generation starting beside it (overlap) or parked (gated)
    next_phase: Literal["starting", "parked", "past_gate"] | None = None
    retiring: list[int] = Field(default_factory=list)  # old generations still draining or stopping
    recycle_strategy: str | None = None  # of its recycle in progress, else of its last one
    standby: StandbyStatus | None = None
    start_phases: list[StartPhase] = Field(default_factory=list)  # where its current generation's start went
    config: str | None = None  # the configuration hash its current generation was launched with
    weights_source: Source | None = None  # where its current generation's weights came from (held / disk)
    weights_note: str = ""  # why from disk, when it was
    kv_source: Literal["held", "own"] | None = None  # its current generation's KV cache: the holder's, or its own
    kv_note: str = ""  # why its own, when it asked for the held one
    holder: HolderStatus | None = None  # its weight holder (`[server] hold_weights`)


class ReloadStatus(_Model):
    """The last `vllm-guard reload` or SIGHUP: what it did, in one line."""

    at: str
    reason: str  # operator, sighup, ...
    outcome: Literal["applied", "unchanged", "refused"]
    detail: str  # the keys it changed, or why it was refused (the key named)


class ConfigStatus(_Model):
    """The configuration the runtime runs: a short hash of what it reads of guard.toml (file and
    command-line flags composed), where it came from, and what the last applied reload changed."""

    hash: str
    source: str | None = None  # the guard.toml it was read from (None: flags and defaults only)
    applied_at: str | None = None  # when the last reload applied it (None: as started)
    changed: list[str] = Field(default_factory=list)  # "[section] key" that reload changed
    last_reload: ReloadStatus | None = None


class PrestageReport(_Model):
    """What a parked EngineCore read into host memory before its gate (`[server] prestage_weights`)."""

    model_dir: str
    files: list[str] = Field(default_factory=list)  # file names staged (empty when it failed)
    bytes: int = 0
    seconds: float = 0.0
    pinned: bool = False  # page-locked (CUDA) host memory, else plain
    cuda_context: bool = False  # this process has a CUDA context now (made by the pinning)
    error: str = ""  # why nothing is staged (the engine parks and loads from disk as before)


class AttnProbeRun(_Model):
    """One run of vLLM's CPU attention kernel on tiny tensors in a throwaway process."""

    isa: str  # the ISA it ran (or would have run) the kernel with
    init_amx: bool = False  # AMX tile permission was asked of the kernel first (torch's `_init_amx`)
    outcome: Literal["returned", "signal", "exit", "timeout", "refused"]  # refused: no tile permission
    signal: str | None = None  # SIGILL, SIGSEGV, ... when a signal killed it
    exit_code: int | None = None
    detail: str = ""  # the top frame or the last line it printed
    seconds: float = 0.0


class AttnIsaVerdict(_Model):
    """Which attention ISA every vLLM-CPU process of a generation uses (`core.attn_isa`): the
    probe's verdict, cached in the state dir per vLLM version and CPU, carried to each process in
    VLLM_GUARD_ATTN_ISA, acted on by the `attn-isa` patch."""

    schema_: Literal["vllm-guard-attn-isa/1"] = Field("vllm-guard-attn-isa/1", alias="schema")
    key: str  # vLLM version, the CPU's flags and whether AMX is pretended: what the verdict holds for
    vllm_version: str
    picked: str | None = None  # what vLLM picks for bfloat16; None: not asked (no amx_tile, no probe)
    # keep: vLLM's choice runs; request-amx: it runs once tile permission is asked (every process
    # asks); avoid-amx: the next ISA vLLM supports (vec/vec16) wherever vLLM picks amx
    action: Literal["keep", "request-amx", "avoid-amx"]
    reason: str
    runs: tuple[AttnProbeRun, ...] = ()
    at: str = ""


class AttnIsaCache(_Model):
    """`attn-isa.json` in the state dir: the verdicts found so far, by `AttnIsaVerdict.key` (a
    vLLM upgrade or a pretended AMX is another key; each keeps its own)."""

    schema_: Literal["vllm-guard-attn-isa-cache/1"] = Field("vllm-guard-attn-isa-cache/1", alias="schema")
    verdicts: dict[str, AttnIsaVerdict] = Field(default_factory=dict)


class GateReport(_Model):
    """What a gated generation's EngineCore says at its startup gate (`core.plugin.read_gate`)."""

    state: Literal["parked", "opened", "skipped", "timed_out"]
    pid: int
    at: str
    reason: str = ""
    vllm_version: str = "unknown"
    where: str = ""  # the vLLM function that loaded the plugin (EngineCore.__init__ expected)
    stage: str = ""  # where in its start it parked: before CUDA, or ready on the held KV cache (late gate)
    waited_s: float | None = None
    prestage: PrestageReport | None = None  # only when the runtime asked for prestaged weights
    warm: WarmReport | None = None  # only when the runtime asked for a warm start


class StatusSnapshot(_Model):
    schema_: Literal["vllm-guard-status/5"] = Field("vllm-guard-status/5", alias="schema")
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
    config: ConfigStatus | None = None

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
    RELOAD = "reload"  # re-read guard.toml as the runtime composed it; applied through a recycle
    UPGRADE = "upgrade"  # hand the serving generations and the socket to the next runtime, then exit


# which ledger classes each command may be recorded as (default first)
COMMAND_CLASSES: dict[Command, tuple[EndClass, ...]] = {
    Command.RECYCLE: (EndClass.SCHEDULED, EndClass.PREVENTIVE),
    Command.RESTART: (EndClass.UNPLANNED, EndClass.SCHEDULED, EndClass.PREVENTIVE),
    Command.HOLD: (),
    Command.RELEASE: (),
    Command.RELOAD: (EndClass.SCHEDULED,),
    Command.UPGRADE: (),
}


class RecycleStrategy(str, enum.Enum):
    OVERLAP = "overlap"
    GATED = "gated"
    COLD = "cold"


class CommandRequest(_Model):
    command: Command
    reason: str = "operator"
    cls: EndClass | None = None
    replica: int | None = Field(default=None, ge=0)  # recycle/restart one replica; None: all (rolling, one at a time)
    strategy: RecycleStrategy | None = None  # recycle: this strategy for this recycle only (tests, operators)

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str) -> str:
        return check_reason(v)

    def ledger_class(self) -> EndClass | None:
        """The ledger class this command is recorded as; ProtocolError for a combination that
        does not apply (a class the command does not take, a strategy for other than recycle)."""
        if self.strategy is not None and self.command is not Command.RECYCLE:
            raise ProtocolError(f"strategy has value {self.strategy.value!r}: only recycle takes a strategy")
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
    # refused because of the configuration (a bad file, a key only a restart applies): the CLI exits 2
    config_error: bool = False


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
