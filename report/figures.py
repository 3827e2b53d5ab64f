"""The report's figures as typed records: one tree, built once (`build`), rendered as text, JSON
and HTML, so the three never disagree. The JSON is this tree (`to_json`; keys in
docs/REPORTS.md), with `service` in `core.reliability`'s own form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_guard.core.reliability import ServiceFigures
from vllm_guard.core.stats import Slope

SCHEMA = "vllm-guard-report/2"


@dataclass(frozen=True)
class Quantiles:
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


# -- leaks --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationSlope:
    generation: int
    per_100_requests: Slope | None


@dataclass(frozen=True)
class ProcessLeak:
    """One process role's memory of one kind (in one replica, or all): the leak rule's verdict."""

    role: str
    metric: str  # rss_mb, uss_mb, swap_mb, gpu_mb
    kind: str  # host or gpu
    replica: int | None  # None: every replica's processes of this role together
    leak: bool  # the leak rule holds (core.leak)
    verdict: str  # the one line the report says of it
    per_100_requests: Slope | None
    halves_per_100_requests: tuple[Slope | None, Slope | None]
    per_hour: Slope | None
    points: int
    requests: float
    generations: int
    last_mb: float | None
    headroom_mb: float | None
    time_to_oom_h: float | None  # only for a leak shown
    per_generation: list[GenerationSlope] = field(default_factory=list)


@dataclass(frozen=True)
class LeakFigures:
    present: bool
    note: str
    source: str | None = None  # runtime, watchdog or soak
    confidence: float = 0.95
    warmup_requests: int = 0
    warmup_from: str = ""
    noise_floor_mb_per_100: float = 0.0
    points: int = 0
    host_available_mb_end: float | None = None
    gpu_headroom_mb_end: float | None = None
    gpu_headroom_from: str = ""
    processes: list[ProcessLeak] = field(default_factory=list)

    def leaks(self) -> list[ProcessLeak]:
        return [p for p in self.processes if p.leak]


# -- traffic: latency, throughput, tokens --------------------------------------------------------
@dataclass(frozen=True)
class HourTraffic:
    hour: int  # hours since the first minute
    start: str  # UTC
    requests: int
    completed: int
    failed: int
    ttft_s: Quantiles
    e2e_s: Quantiles
    itl_s: Quantiles
    throughput_rps: float | None
    output_tokens_per_s: float | None


@dataclass(frozen=True)
class TrafficFigures:
    """Latency, throughput and tokens of what was served, from per-minute blocks: the runtime's
    (every request at the proxy), else the soak's (its own requests)."""

    present: bool
    note: str
    source: str | None = None  # "runtime" or "soak"
    replica: int | None = None
    minutes: int = 0
    requests: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    disconnected: int = 0
    error_rate: float | None = None
    ttft_s: Quantiles = Quantiles()
    e2e_s: Quantiles = Quantiles()
    itl_s: Quantiles = Quantiles()
    span_s: float = 0.0
    throughput_rps: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_known: int = 0  # completed requests whose tokens are known
    output_tokens_per_s: float | None = None
    per_hour: list[HourTraffic] = field(default_factory=list)


@dataclass(frozen=True)
class TailCount:
    """Requests whose wait for a first token overlapped one kind of moment (report/tail.py), in
    the tail and among all; `part` names a start's part for `standby` and `beside`."""

    kind: str
    part: str
    tail: int
    all: int


@dataclass(frozen=True)
class SlowRequest:
    at: str  # arrival, ISO UTC
    replica: int
    generation: int
    ttft_s: float
    kind: str
    what: str


@dataclass(frozen=True)
class TailFigures:
    """Where the slowest first tokens waited (report/tail.py)."""

    present: bool
    note: str
    quantile: float = 0.99
    requests: int = 0
    slowest: int = 0
    threshold_s: float | None = None
    kinds: list[TailCount] = field(default_factory=list)
    parts: list[TailCount] = field(default_factory=list)
    slowest_requests: list[SlowRequest] = field(default_factory=list)


@dataclass(frozen=True)
class SoakHour:
    hour: int
    requests: int
    errors: int
    ttft_s: Quantiles
    e2e_s: Quantiles
    itl_mean_s: Quantiles


@dataclass(frozen=True)
class SoakFigures:
    """The soak's own requests (the client's view, from the scheduled send too), when one ran."""

    present: bool
    note: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    ok: int = 0
    failed: int = 0
    error_rate: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    ttft_s: Quantiles = Quantiles()
    ttft_sched_s: Quantiles = Quantiles()
    itl_mean_s: Quantiles = Quantiles()
    e2e_s: Quantiles = Quantiles()
    e2e_sched_s: Quantiles = Quantiles()
    per_hour: list[SoakHour] = field(default_factory=list)
    span_s: float = 0.0
    throughput_rps: float | None = None
    output_tokens_per_s: float | None = None


# -- SLA -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlaTier:
    name: str
    bound_s: float | None


@dataclass(frozen=True)
class SlaHour:
    hour: int
    start: str
    requests: int
    failed: int
    p99_s: float | None  # None: more than 1 % failed (a failed request meets no bound)
    tier: str | None


@dataclass(frozen=True)
class SlaFigures:
    present: bool
    note: str
    source: str | None
    latency: str
    quantile: float
    tiers: list[SlaTier]
    per_hour: list[SlaHour] = field(default_factory=list)
    hours: int = 0
    hours_met: dict[str, int] = field(default_factory=dict)
    run_tier: str | None = None
    run_p99_s: float | None = None


# -- thermals ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuThermal:
    uuid: str
    name: str
    samples: int
    throttled_share: float | None
    power_capped_share: float | None
    throttled_share_by_reason: dict[str, float | None]
    max_temp_c: float | None
    temp_slowdown_c: float | None
    sm_clock_max_mhz: float | None
    sm_clock_p50_mhz: float | None
    sm_clock_min_mhz: float | None
    clock_drop_pct: float | None  # core.gpu.clock_drop_pct
    throughput_throttled_rps: float | None
    throughput_unthrottled_rps: float | None


@dataclass(frozen=True)
class ThermalFigures:
    present: bool
    note: str
    gpus: list[GpuThermal] = field(default_factory=list)


# -- cost ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PriceRef:
    file: str
    box: str
    currency: str
    source: str


@dataclass(frozen=True)
class PerMillion:
    cost: float
    output_tokens_per_s: float
    hourly: float
    hourly_parts: dict[str, float | None]
    power_w: float
    power_from: str


@dataclass(frozen=True)
class Tco:
    years: float
    total: float | None
    parts: dict[str, float | None]
    power_w: float | None
    power_from: str
    outages_per_month: float | None
    outages_from: str


@dataclass(frozen=True)
class CostFigures:
    energy_kwh: float | None = None
    mean_power_w: float | None = None
    gpus_metered: int = 0
    output_tokens: int | None = None
    tokens_from: str = ""
    tokens_per_kwh: float | None = None
    prices: PriceRef | None = None
    per_million_tokens: PerMillion | None = None
    tco: Tco | None = None
    notes: list[str] = field(default_factory=list)


# -- attribution ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureCost:
    feature: str
    unit: str
    mb_per_unit: float
    low: float
    high: float
    significant: bool
    total_units: float
    explained_mb: float
    moves: int


@dataclass(frozen=True)
class ProcessAttribution:
    role: str
    metric: str
    intervals: int
    growth_mb: float | None
    cause: str | None
    note: str
    withheld: str | None
    left_out: list[str]
    features: list[FeatureCost]
    line: str | None = None  # the headline, when a cause is named for growth worth naming


@dataclass(frozen=True)
class AttributionFigures:
    present: bool
    note: str
    confidence: float
    lines: list[str] = field(default_factory=list)
    counters_missing: list[str] = field(default_factory=list)
    processes: list[ProcessAttribution] = field(default_factory=list)


# -- the rest ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IncidentRow:
    kind: str
    cause: str | None
    cls: str
    detected_at: str
    action: str | None
    restored_at: str | None


@dataclass(frozen=True)
class IncidentFigures:
    present: bool
    note: str
    list: list[IncidentRow] = field(default_factory=list)


@dataclass(frozen=True)
class TableHealth:
    """Rows of a table that were read, and those that did not match their schema."""

    present: bool
    count: int
    invalid: int
    first_error: str | None
    note: str = ""


@dataclass(frozen=True)
class ReplicaFigures:
    """One replica: its reliability, traffic, SLA tier and leaks."""

    replica: int
    service: ServiceFigures
    traffic: TrafficFigures
    sla_run_tier: str | None
    leaks: list[ProcessLeak]


@dataclass(frozen=True)
class Summary:
    lines: list[str]
    mtbf_h: float | None
    mtbf_low_h: float | None
    mtbf_high_h: float | None
    mtbf_lower_one_sided_h: float | None
    failures_unplanned: int | None
    availability: float | None
    downtime_planned_s: float | None
    downtime_unplanned_s: float | None
    leaks: list[ProcessLeak]
    sla_run_tier: str | None
    cost_per_million_tokens: float | None


@dataclass(frozen=True)
class Report:
    schema: str
    generated_at: str
    ledger: str
    label: str
    profile: dict[str, Any]
    service: ServiceFigures
    replicas: list[ReplicaFigures]
    incidents: IncidentFigures
    leak: LeakFigures
    attribution: AttributionFigures
    watchdog_samples: TableHealth
    soak_status: TableHealth
    runtime_minutes: TableHealth
    thermal: ThermalFigures
    traffic: TrafficFigures
    tail: TailFigures
    soak: SoakFigures
    sla: SlaFigures
    cost: CostFigures
    patches: dict[str, Any] | None
    empty: bool
    summary: Summary


def clean(o: Any) -> Any:
    """JSON-safe: NaN/inf -> null, numpy scalars -> Python, tuples -> lists."""
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def to_json(r: Report) -> dict[str, Any]:
    """The JSON figures: the tree as dicts, `service` (also per replica) in the core's form,
    incident classes under `class`."""
    d = dataclasses.asdict(r)
    d["service"] = r.service.to_dict()
    for i, rep in enumerate(r.replicas):
        d["replicas"][i]["service"] = rep.service.to_dict()
    for i in d["incidents"]["list"]:
        i["class"] = i.pop("cls")
    return dict(clean(d))
