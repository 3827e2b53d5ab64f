"""One `guard.toml` schema for every command: each section a dataclass, one coercion.

Every command that reads the file validates *all* of its sections, so `install`, `serve`,
`watchdog` and `soak` accept and reject exactly the same files. Each invalid setting raises
`ConfigError` with one line naming the key and the value; commands turn it into exit code 2
before anything starts. Numbers must be finite and every duration in a sane range.

A field's constraints sit in its metadata (`min`, `max`, `gt`, `choices`, `pattern`,
`check`), so the rule is next to the default it constrains.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union, get_args, get_origin, get_type_hints

from . import vllm_api
from . import leak
from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = "/etc/vllm-guard/guard.toml"
MAX_DURATION_S = 366 * 86400.0  # a year: longer is a typo, not a setting

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class Duration(float):
    """Marker type: a field annotated `Duration` takes `90s`, `30m`, `24h`, `1d`, `250ms` or seconds."""


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from `90s`, `30m`, `24h`, `1d`, `250ms` or a bare number; finite, 0..1 year."""
    bad = f"{key} has value {value!r}: not a duration (use e.g. 90s, 30m, 24h, 1d)"
    if isinstance(value, bool):
        raise ConfigError(bad)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(bad)
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not math.isfinite(seconds):
        raise ConfigError(f"{key} has value {value!r}: must be finite")
    if seconds < 0:
        raise ConfigError(f"{key} has value {value!r}: must not be negative")
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"{key} has value {value!r}: longer than a year")
    return seconds


def format_duration(seconds: float) -> str:
    """The inverse for writing TOML back: `90s`, `1209600s`, `0.25s` (never an exponent, which
    `parse_duration` would refuse: `f"{1209600.0:g}"` is `1.2096e+06`)."""
    text = format(decimal.Decimal(repr(float(seconds))), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text}s"


def _f(default: Any, **meta: Any) -> Any:
    """A field with constraints in its metadata (lists and dicts get a factory)."""
    if isinstance(default, (list, dict)):
        copy: Callable[[], Any] = functools.partial(type(default), default)
        return field(default_factory=copy, metadata=meta)
    return field(default=default, metadata=meta)


# -- checks used in metadata ------------------------------------------------------------------
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")
_MEMORY = re.compile(r"^(\d+(\.\d+)?[KMGT]?|\d{1,3}(\.\d+)?%|infinity)$")
_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(v: Any) -> str | None:
    if isinstance(v, str) and _CONTROL.search(v):
        return "control characters (newline, tab, ...) are not allowed"
    if isinstance(v, list) and any(isinstance(x, str) and _CONTROL.search(x) for x in v):
        return "control characters (newline, tab, ...) are not allowed"
    return None


def _env_table(v: dict[str, str]) -> str | None:
    for k, x in v.items():
        if not _ENV_KEY.match(k):
            return f"{k!r} is not a variable name"
        if _CONTROL.search(x):
            return f"{k} has control characters"
    return None


def _gpu_selectors(v: list[str]) -> str | None:
    bad = [g for g in v if not (g.isdigit() or _GPU_UUID.match(g))]
    return f"{bad[0]!r} is not a GPU index (0, 1, ...) or UUID (GPU-..., MIG-...)" if bad else None


RECYCLE_STRATEGIES = ("auto", "overlap", "gated", "cold")


def _kernel_source(v: str) -> str | None:
    if v in ("auto", "kmsg", "journal", "off") or v.startswith(("/", ".")):
        return None
    return "auto, kmsg, journal, off or a file path"


# -- sections ---------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    """[server]: where the guard listens, where it keeps state, how it starts and stops vLLM."""

    model: str = _f("", check=_no_control)  # empty: the embedded tiny model
    host: str = _f("127.0.0.1", check=_no_control)
    port: int = _f(8000, min=1, max=65535)
    state_dir: str = _f(".state", check=_no_control)
    # empty: vLLM listens on a Unix socket in the state dir that only the runtime's user and group
    # reach; an address (127.0.0.1): a TCP port there, which every local user can reach
    backend_host: str = _f("", check=_no_control)
    python: str = _f("", check=_no_control)  # interpreter for the vLLM child; empty: this one
    # vLLM's processes run this many nice levels below the runtime, so the proxy every request
    # passes through, the status answers and the supervisor's watchdog pings keep their CPU when
    # the box is saturated (a busy-polling vLLM-CPU engine, tokenization bursts); 0: the same level.
    # On a box with cores to spare it changes nothing.
    backend_nice: int = _f(5, min=0, max=19)
    vllm_args: list[str] = _f([], check=_no_control)
    startup_timeout: Duration = _f(Duration(600.0), gt=0)
    drain_timeout: Duration = _f(Duration(120.0), gt=0)
    stop_timeout: Duration = _f(Duration(30.0), gt=0)
    memory_release_timeout: Duration = _f(Duration(60.0), gt=0)
    queue_size: int = _f(1024, min=1)
    queue_max_wait: Duration = _f(Duration(900.0), gt=0)
    # times one request may move to another generation after its backend died under it: sent
    # again whole (nothing had reached the client) or continued mid-stream; each move waits at
    # most queue_max_wait for a backend (docs/RUNTIME.md "Requests that outlive their backend")
    migration_limit: int = _f(3, min=0, max=100)
    retry_after: int = _f(10, min=1, max=3600)
    # readiness (/vllm-guard/ready) turns 503 this long before a cold or gated recycle stops the
    # serving generation, so a load balancer has moved traffic before the gap (HAProxy's
    # `inter 2s fall 3` is 6 s); 0: unready only when the gap begins
    unready_lead: Duration = _f(Duration(10.0), min=0, max=3600)
    admin_group: str = _f("", check=_no_control)
    admin_mode: int = _f(0o660, min=0, check=lambda v: None if v & ~0o770 == 0 and v & 0o600 == 0o600 else
                         f"0o{v:o} is not a mode for the admin socket: owner rw, group at most rwx, "
                         "nothing for others (0600..0770)")
    max_failures: int = _f(5, min=1)
    failure_window: Duration = _f(Duration(600.0), gt=0)
    backoff_initial: Duration = _f(Duration(1.0), gt=0)
    backoff_max: Duration = _f(Duration(60.0), gt=0)
    request_timeout: Duration = _f(Duration(3600.0), gt=0)
    access_log: bool = True  # one `request` event per proxied request (id, generation, status, TTFT)
    # the runtime's own Prometheus metrics (runtime/servers/metrics.py) on metrics_addr:metrics_port; 0: off
    metrics_addr: str = _f("127.0.0.1", check=_no_control)
    metrics_port: int = _f(9465, min=0, max=65535)
    # The public port's bounds: a request body larger than max_body_mb is refused (413, before it is
    # read when Content-Length says so); bodies buffered at once (queued and in flight) stay under
    # body_buffer_mb (503 beyond); a new connection must send its request headers within
    # header_timeout; a kept-alive connection idle (or a body that stalls) for idle_timeout is closed;
    # at most max_connections client connections (0: derived from the descriptor limit, so some are
    # always left for the admin socket, the ledger and the vLLM child), 503 beyond.
    max_body_mb: float = _f(32.0, gt=0, max=4096)
    body_buffer_mb: float = _f(512.0, gt=0, max=65536)
    header_timeout: Duration = _f(Duration(10.0), gt=0, max=3600)
    idle_timeout: Duration = _f(Duration(75.0), gt=0, max=86400)
    max_connections: int = _f(0, min=0, max=1_000_000)
    # -- admission: what one request and one client may ask for (docs/RELIABILITY.md "Bounded
    # requests"); refused with one JSON error, counted as rejected with its reason --
    # n (and best_of) at most max_n (400), also vLLM's own cap (VLLM_MAX_N_SEQUENCES in every child)
    max_n: int = _f(16, min=1, max=16384)
    # a sequence's max_tokens (given, or vLLM's default: the context) at most this (400); 0: off
    max_tokens: int = _f(0, min=0)
    # sequences x max_tokens of one request at most this (400); 0: off
    max_request_tokens: int = _f(32768, min=0)
    # per client (its API key when vLLM demands keys, else its address): requests in flight (queued
    # included) and the tokens they ask for, at most these (429 with Retry-After beyond); 0: off
    max_client_requests: int = _f(256, min=0)
    max_client_tokens: int = _f(524288, min=0)
    # -- recycling without a stall, replicas (docs/RUNTIME.md "Recycle strategies") --
    # auto: overlap when two generations fit in memory, else gated pre-start (GPU), else cold
    recycle_strategy: str = _f("auto", choices=RECYCLE_STRATEGIES)
    overlap_margin_mb: float = _f(1024.0, min=0)  # headroom kept beyond a second generation's footprint
    gate_timeout: Duration = _f(Duration(300.0), gt=0)  # a gated next generation must reach its gate by then
    # auto: once a generation serves, its next one starts and parks at the startup gate while host RAM
    # allows (a crash then restarts from the gate; a recycle uses it); off: none
    standby: str = _f("auto", choices=("auto", "off"))
    # on: a generation that parks at its startup gate (gated, the standby) first reads the model's
    # safetensors into host memory (pinned on a GPU) and creates its CUDA context; vLLM then loads
    # the weights from that copy after the gate. Costs the weights' size in RAM per parked generation
    prestage_weights: str = _f("off", choices=("off", "on"))
    # on: a generation that parks at its startup gate first imports the modules the last generation
    # imported after its gate (recorded in the state dir) and freezes its heap for the collector;
    # it does not send vLLM's usage report again. Costs nothing after the gate; off: vLLM as it is
    warm_start: str = _f("on", choices=("off", "on"))
    replicas: int = _f(1, min=1, max=64)  # vLLM servers behind the one proxy (one per GPU or TP group)
    gpus: list[str] = _f([], check=_gpu_selectors)  # GPU indexes or UUIDs, one replica per GPU / TP group


@dataclass
class RecycleConfig:
    """[recycle]: when a generation is replaced; 0 turns a trigger off."""

    max_requests: int = _f(0, min=0)
    max_requests_jitter: int = _f(0, min=0)
    max_uptime: Duration = Duration(0.0)
    max_gpu_memory_growth_mb: float = _f(0.0, min=0)
    max_host_rss_growth_mb: float = _f(0.0, min=0)
    memory_warmup_requests: int = _f(leak.WARMUP_REQUESTS, min=0)  # the one warm-up (core.leak)
    memory_interval: Duration = _f(Duration(5.0), min=0.2)
    idle_after: Duration = _f(Duration(30.0), gt=0)
    idle_fraction: float = _f(0.0, min=0.0, lt=1.0)  # 0 disables opportunistic early recycling
    # while its successor starts beside it, a generation past max_requests may take this share of its
    # limit more; then it drains anyway and the successor takes over when it is ready
    max_requests_overrun: float = _f(0.5, min=0.0, max=100.0)


@dataclass
class ProbeConfig:
    """[probe]: the runtime's 1-token completion that tells a hung engine from a busy one."""

    interval: Duration = _f(Duration(15.0), min=0.5)
    timeout: Duration = _f(Duration(20.0), gt=0)
    # consecutive timed-out probes without engine progress that make a hang
    failures: int = _f(2, min=1, max=100)
    # engine progress (tokens) is looked for over this window before a failed probe counts
    progress_window: Duration = _f(Duration(30.0), gt=0)
    prompt: str = _f("ping", check=_no_control)


@dataclass
class WatchdogConfig:
    """[watchdog]: the separate watchdog's detectors, policy, sources and outputs."""

    interval: Duration = _f(Duration(1.0), min=0.01)
    dry_run: bool = False
    # memory drift
    warmup_requests: int = _f(leak.WARMUP_REQUESTS, min=0)  # the rule and its defaults: core.leak
    drift_min_requests: int = _f(leak.MIN_REQUESTS, min=1)
    drift_min_points: int = _f(leak.MIN_POINTS, min=3)
    noise_floor_mb_per_100: float = _f(leak.NOISE_FLOOR_MB_PER_100, min=0)
    drift_every: Duration = _f(Duration(10.0), gt=0)
    forecast_horizon: Duration = _f(Duration(3600.0), gt=0)
    host_budget_mb: float = _f(0.0, min=0)  # 0: the host's MemAvailable is the headroom
    gpu_budget_mb: float = _f(0.0, min=0)  # 0: the GPU's free memory is the headroom
    # thermal
    thermal_window: Duration = _f(Duration(600.0), gt=0)
    thermal_share: float = _f(0.5, gt=0, max=1.0)
    thermal_margin_c: float = _f(5.0, min=0, max=100)
    clock_drop_pct: float = _f(10.0, min=0, max=100)
    # hang (the runtime's rule, core/hang.py, on the watchdog's own probe of every replica)
    probe_interval: Duration = _f(Duration(15.0), min=0.5)
    probe_timeout: Duration = _f(Duration(20.0), gt=0)
    hang_failures: int = _f(2, min=1, max=100)
    progress_window: Duration = _f(Duration(30.0), gt=0)
    # policy
    cooldown: Duration = Duration(300.0)
    max_actions: int = _f(3, min=0)
    action_window: Duration = _f(Duration(3600.0), gt=0)
    alert_command: str = _f("", check=_no_control)
    alert_webhook: str = _f("", check=_no_control)
    # sources
    nvml_timeout: Duration = _f(Duration(2.0), gt=0, max=60)
    nvml_trace: str = _f("", check=_no_control)  # replay this JSONL trace instead of the live GPU
    kernel: str = _f("auto", check=_kernel_source)  # auto | kmsg | journal | off | a file to replay
    cgroup_root: str = _f("/sys/fs/cgroup", check=_no_control)
    service_cgroup: str = _f("", check=_no_control)  # default: the runtime's own cgroup
    metrics_timeout: Duration = _f(Duration(3.0), gt=0)
    # outputs
    prometheus_addr: str = _f("127.0.0.1", check=_no_control)
    prometheus_port: int = _f(9464, min=0, max=65535)  # 0: no exporter
    sample_every: Duration = _f(Duration(1.0), gt=0)  # ledger resolution of the newest hour
    gpu_profile: str = _f("", check=_no_control)  # override the profile chosen by NVML name


@dataclass
class SoakConfig:
    """[soak]: defaults for `vllm-guard soak`; None: not set here (the command's default)."""

    url: str | None = _f(None, check=_no_control)
    scenario: str | None = _f(None, choices=("S1", "S2", "S3", "S4", "custom"))
    duration: Duration | None = _f(None, gt=0)
    rate: float | None = _f(None, gt=0)
    burstiness: float | None = _f(None, gt=0)
    concurrency: int | None = _f(None, min=1)
    db: str | None = _f(None, check=_no_control)
    seed: int | None = _f(None, min=0)
    mode: str | None = _f(None, choices=("steady", "burst"))
    timeout: Duration | None = _f(None, gt=0)
    prompt_tokens: int | None = _f(None, min=1)
    output_tokens: int | None = _f(None, min=1)
    model: str | None = _f(None, check=_no_control)
    state_dir: str | None = _f(None, check=_no_control)
    sample_interval: Duration | None = _f(None, gt=0)


@dataclass
class LedgerConfig:
    """[ledger]: what the runtime keeps of the traffic it served (per-minute histograms are kept
    for the ledger's life; per-request rows only this long)."""

    request_retention: Duration = _f(Duration(86400.0), min=0)  # 0: no per-request rows


PATCH_IDS = ("kv-block-audit", "idle-release", "allocator-settings", "fault-injection", "add-request-abort",
             "block-ids-drain", "startup-gate", "prestaged-weights", "triton-ptxas", "attn-isa")


@dataclass(frozen=True)
class InjectConfig:
    """[inject]: faults to inject into vLLM (opt-in); zero means off. Counts are engine-finished
    requests, probes excluded."""

    host_leak_mb_per_request: float = _f(0.0, min=0)
    device_leak_mb_per_request: float = _f(0.0, min=0)
    block_leak_every: int = _f(0, min=0)
    gpu_memory_budget_gib: float = _f(0.0, min=0)
    hang_after_requests: int = _f(0, min=0)
    crash_after_requests: int = _f(0, min=0)
    # vLLM believes the CPU has AMX tiles: on a CPU without them its AMX attention kernel dies of
    # SIGILL, as on the CPUs the attn-isa patch is for (the probe and every vLLM process pretend)
    pretend_amx: bool = False

    @property
    def active(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}


@dataclass(frozen=True)
class PatchesConfig:
    """[patches]: what the plugin does in each vLLM process; `enabled = false` turns all off."""

    enabled: bool = True
    disable: tuple[str, ...] = _f((), choices=PATCH_IDS)
    idle_release_after: Duration = _f(Duration(5.0), gt=0)
    malloc_trim: bool = True
    expandable_segments: bool = True
    malloc_arena_max: int = _f(0, min=0, max=64)
    audit_reclaim: bool = True  # false: the audit only counts orphans, it does not free them

    def wants(self, patch_id: str) -> bool:
        return self.enabled and patch_id not in self.disable


@dataclass
class InstallConfig:
    """[install]: unit settings `vllm-guard install` renders into the systemd units."""

    user: str = _f("vllm-guard", pattern=_USER, what="not a valid system user name")  # its group of the same name owns the admin socket
    watchdog_user: str = _f("vllm-guard-watchdog", pattern=_USER, what="not a valid system user name")
    memory_high: str = _f("85%", pattern=_MEMORY, what="use e.g. 64G, 90% or infinity")
    memory_max: str = _f("90%", pattern=_MEMORY, what="use e.g. 64G, 90% or infinity")
    watchdog_sec: Duration = _f(Duration(60.0), min=1)
    restart_sec: Duration = _f(Duration(30.0), min=1)
    start_limit_interval: Duration = _f(Duration(1800.0), min=1)
    start_limit_burst: int = _f(4, min=1)
    timeout_start: Duration = _f(Duration(900.0), min=1)
    revive_every: Duration = _f(Duration(1800.0), min=1)
    env: dict[str, str] = _f({}, check=_env_table)  # extra environment for the runtime
    # (GPUs: `[server] gpus`; an older file's `[install] gpus` is read as that, see REPLACED)

    def environment(self) -> dict[str, str]:
        """The runtime's extra environment (the unit's EnvironmentFile)."""
        return dict(self.env)

    @property
    def group(self) -> str:
        return self.user


@dataclass
class GuardConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    recycle: RecycleConfig = field(default_factory=RecycleConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    patches: PatchesConfig = field(default_factory=PatchesConfig)
    install: InstallConfig = field(default_factory=InstallConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    # section -> keys given in the file or on the command line (profiles fill in the rest)
    explicit: dict[str, set[str]] = field(default_factory=dict, compare=False, repr=False)
    # keys of an older file read under the key that replaced them (one line each, REPLACED)
    deprecations: list[str] = field(default_factory=list, compare=False, repr=False)
    source: str | None = field(default=None, compare=False)  # the file it came from

    @property
    def state_path(self) -> Path:
        return Path(self.server.state_dir)


SECTIONS: dict[str, type] = {name: typ for name, typ in get_type_hints(GuardConfig).items()
                             if name not in ("explicit", "source", "deprecations")}


# -- the one coercion -------------------------------------------------------------------------
def _unwrap_optional(typ: Any) -> tuple[Any, bool]:
    if get_origin(typ) in (Union, types.UnionType):
        args = [a for a in get_args(typ) if a is not type(None)]
        if len(args) == 1 and len(get_args(typ)) == 2:
            return args[0], True
    return typ, False


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _coerce_type(name: str, value: Any, typ: Any, text: bool) -> Any:
    """Value of `typ` from TOML (or, with `text`, from an env string); ConfigError otherwise."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{name} has value {value!r}: {what}")

    if typ is Duration:
        return Duration(parse_duration(value, name))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
            return value.strip().lower() in _TRUE
        raise bad("not a bool (true or false)")
    if typ is int:
        if text and isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError as e:
                raise bad("not an integer") from e
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("not an integer")
        return value
    if typ is float:
        if text and isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError as e:
                raise bad("not a number") from e
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("not a number")
        if not math.isfinite(value):
            raise bad("must be finite")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise bad("not a string")
        return value
    origin, args = get_origin(typ), get_args(typ)
    if origin in (list, tuple):
        items = value.split("+") if text and isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise bad("not a list of strings")
        items = [v.strip() for v in items if v.strip()] if text else list(items)
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise bad('not a table of NAME = "string"')
        return dict(value)
    raise ConfigError(f"{name}: unsupported type {typ!r}")  # a schema bug, not a user error


def _constrain(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{name} has value {value!r}: {what}")

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "min" in meta and value < meta["min"]:
            raise bad(f"must be >= {meta['min']:g}")
        if "gt" in meta and not value > meta["gt"]:
            raise bad(f"must be > {meta['gt']:g}")
        if "max" in meta and value > meta["max"]:
            raise bad(f"must be <= {meta['max']:g}")
        if "lt" in meta and not value < meta["lt"]:
            raise bad(f"must be < {meta['lt']:g}")
        if "min" not in meta and "gt" not in meta and value < 0:
            raise bad("must not be negative")
    if "choices" in meta:
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            if v not in meta["choices"]:
                raise ConfigError(f"{name} has value {v!r}: one of {', '.join(meta['choices'])}")
    if "pattern" in meta and not meta["pattern"].match(value):
        raise bad(meta.get("what", f"does not match {meta['pattern'].pattern}"))
    check: Callable[[Any], str | None] | None = meta.get("check")
    if check is not None:
        why = check(value)
        if why:
            raise bad(why)


def coerce(section: str, key: str, value: Any, text: bool = False) -> Any:
    """The typed, range-checked value of `[section] key`; ConfigError naming both otherwise."""
    cls = SECTIONS.get(section)
    if cls is None:
        raise ConfigError(f"[{section}] is not a known section (known: {', '.join(SECTIONS)})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        raise ConfigError(f"[{section}] {key} is not a known key (known: {', '.join(sorted(fields))})")
    typ, optional = _unwrap_optional(get_type_hints(cls)[key])
    name = f"[{section}] {key}"
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} must be set")
    out = _coerce_type(name, value, typ, text)
    _constrain(name, out, fields[key].metadata)
    return out


def section_from_table(section: str, table: typing.Mapping[str, Any], text: bool = False) -> Any:
    """A validated section dataclass from a raw table (TOML, or env strings with `text`)."""
    cls = SECTIONS[section]
    return cls(**{k: coerce(section, k, v, text) for k, v in table.items()})


def set_value(cfg: GuardConfig, section: str, key: str, value: Any) -> None:
    """Set one key, validated; used by the file loader and by CLI flags alike."""
    value = coerce(section, key, value)
    obj = getattr(cfg, section)
    if getattr(type(obj), "__dataclass_params__").frozen:
        setattr(cfg, section, dataclasses.replace(obj, **{key: value}))
    else:
        setattr(obj, key, value)
    cfg.explicit.setdefault(section, set()).add(key)


# (section, key) of an older guard.toml -> (section, key) that replaced it, and what it means now
REPLACED: dict[tuple[str, str], tuple[str, str, str]] = {
    ("install", "gpus"): ("server", "gpus", "GPU indexes or UUIDs, one replica per GPU or --tensor-parallel-size "
                                            "group; the runtime sets each replica's CUDA_VISIBLE_DEVICES"),
}
_WARNED: set[str] = set()


def from_data(data: typing.Mapping[str, Any], source: str | None = None) -> GuardConfig:
    """A GuardConfig from parsed TOML; every section is checked, then `validate`."""
    cfg = GuardConfig(source=source)
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"[{section}] is not a known section (known: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} has value {table!r}: expected a [{section}] table")
        for key, value in table.items():
            if (section, key) in REPLACED:
                _read_replaced(cfg, data, section, key, value)
            else:
                set_value(cfg, section, key, value)
    return validate(cfg)


def _read_replaced(cfg: GuardConfig, data: typing.Mapping[str, Any], section: str, key: str, value: Any) -> None:
    """An older file's key, read as the key that replaced it, with one deprecation line on
    stderr (once per process); refused when the file sets the new key too."""
    new_section, new_key, meaning = REPLACED[(section, key)]
    old, new = f"[{section}] {key}", f"[{new_section}] {new_key}"
    table = data.get(new_section)
    if isinstance(table, dict) and new_key in table:
        raise ConfigError(f"{old} has value {value!r}: replaced by {new}, which is set too; remove {old}")
    try:
        set_value(cfg, new_section, new_key, value)
    except ConfigError as e:
        raise ConfigError(str(e).replace(new, old, 1)) from e
    note = f"{old} is deprecated: read as {new} ({meaning}); move it there"
    cfg.deprecations.append(note)
    line = f"vllm-guard: warning: {cfg.source + ': ' if cfg.source else ''}{note}"
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr)


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(p)!r} does not exist") from e
    except IsADirectoryError as e:
        raise ConfigError(f"config file {str(p)!r} is a directory") from e
    except PermissionError as e:
        raise ConfigError(f"config file {str(p)!r} is not readable by this user") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e


def load(path: str | Path | None) -> GuardConfig:
    """Read and validate all of `guard.toml`; None gives the defaults."""
    if path is None:
        return GuardConfig()
    return from_data(read_toml(path), str(path))


def validate(cfg: GuardConfig) -> GuardConfig:
    """Cross-key rules of every section; call again after CLI flags are applied."""
    s, r = cfg.server, cfg.recycle
    if r.max_requests_jitter and not r.max_requests:
        raise ConfigError(
            f"[recycle] max_requests_jitter has value {r.max_requests_jitter!r}: needs max_requests > 0")
    if s.backoff_max < s.backoff_initial:
        raise ConfigError(f"[server] backoff_max has value {s.backoff_max!r}: must be >= backoff_initial "
                          f"({s.backoff_initial!r})")
    if s.gpus and "replicas" in cfg.explicit.get("server", set()) and s.replicas > len(s.gpus):
        raise ConfigError(f"[server] replicas has value {s.replicas!r}: more than the {len(s.gpus)} GPUs in "
                          f"[server] gpus {s.gpus!r}")
    if s.max_client_tokens and s.max_request_tokens > s.max_client_tokens:
        raise ConfigError(f"[server] max_client_tokens has value {s.max_client_tokens!r}: less than "
                          f"max_request_tokens ({s.max_request_tokens!r}), so a request allowed alone "
                          "would be refused (429) forever")
    context = vllm_api.context_length(s.vllm_args)
    if not s.max_tokens and s.max_request_tokens and context is not None and context > s.max_request_tokens:
        raise ConfigError(f"[server] max_request_tokens has value {s.max_request_tokens!r}: less than the "
                          f"context (--max-model-len {context}), so a request that does not set max_tokens "
                          "would be refused; raise it to the context at least (0: off)")
    if len(set(s.gpus)) != len(s.gpus):
        raise ConfigError(f"[server] gpus has value {s.gpus!r}: a GPU is listed twice")
    if cfg.install.user == cfg.install.watchdog_user:
        raise ConfigError(f"[install] watchdog_user has value {cfg.install.watchdog_user!r}: must differ from user")
    return cfg


def section_table(obj: Any) -> dict[str, Any]:
    """A section as a TOML-ready table (durations as `Ns`, tuples as lists, None left out)."""
    hints = get_type_hints(type(obj))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:
            continue
        typ, _ = _unwrap_optional(hints[f.name])
        out[f.name] = format_duration(v) if typ is Duration else list(v) if isinstance(v, tuple) else v
    return out


def as_dict(cfg: GuardConfig) -> dict[str, Any]:
    """Plain dict (logs)."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


# -- the env transport of [inject] and [patches] to every vLLM process --------------------------
def parse_kv(text: str, section: str) -> dict[str, str]:
    """`a=1,b=2` -> {'a': '1', 'b': '2'}; lists inside a value use `+` (disable=a+b)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"[{section}] entry {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def format_kv(table: typing.Mapping[str, Any]) -> str:
    """The inverse of `parse_kv` for validated tables."""
    parts = []
    for key, value in table.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = "+".join(value)
        parts.append(f"{key}={value}")
    return ",".join(parts)


__all__ = [
    "DEFAULT_CONFIG", "RECYCLE_STRATEGIES", "ConfigError", "Duration", "GuardConfig", "InjectConfig", "InstallConfig",
    "LedgerConfig", "PATCH_IDS", "PatchesConfig", "ProbeConfig", "RecycleConfig", "SECTIONS", "ServerConfig",
    "SoakConfig", "WatchdogConfig", "as_dict", "coerce", "format_duration", "format_kv", "from_data",
    "load", "parse_duration", "parse_kv", "read_toml", "section_from_table", "section_table",
    "set_value", "tomllib", "validate",
]
