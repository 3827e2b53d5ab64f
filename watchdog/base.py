"""The one small interface every detector implements, the typed tick it reads, and the typed
results it returns.

Like gpud's components: `name`, `is_supported(sample)`, `check(sample) -> CheckResult`.
A detector that cannot tell says UNKNOWN, never HEALTHY. Findings carry the incident a
detector wants recorded (kind, key, cause, class) and the action it suggests; the policy
decides whether that action is actually taken.

A `Sample` is one tick of every source, each typed by the core model its producer speaks
(the runtime's StatusSnapshot, NVML's NvmlRecord, psutil's ProcReading/HostReading, and per
replica vLLM's EngineMetrics, its API server's CPU time and the probe's ProbeResult); a source
that failed this tick is None and its collector says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import RuntimeState, StatusSnapshot
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult

from .kernel import KernelEvent


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    INITIALIZING = "initializing"
    UNKNOWN = "unknown"


class Action(str, enum.Enum):
    NONE = "none"
    ALERT = "alert"
    RECYCLE = "recycle"  # graceful, class preventive
    RESTART = "restart"  # hard restart of the vLLM child
    HOLD = "hold"  # stop all (re)starting: the GPU needs a reset or the host a reboot


ACTION_ORDER = (Action.NONE, Action.ALERT, Action.RECYCLE, Action.RESTART, Action.HOLD)


@dataclass(frozen=True)
class Finding:
    """One thing worth an incident: `key` tells repeats of the same problem apart; `replica`
    the replica it is about (its actions go to that replica), None: the box or the runtime."""

    kind: str
    key: str
    cause: str
    cls: EndClass
    action: Action = Action.NONE
    data: dict[str, Any] = field(default_factory=dict)
    replica: int | None = None


@dataclass(frozen=True)
class CheckResult:
    name: str
    ts: str
    health: Health
    reason: str
    suggested_action: Action = Action.NONE
    findings: tuple[Finding, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "ts": self.ts, "health": self.health.value, "reason": self.reason,
                "suggested_action": self.suggested_action.value, "data": self.data,
                "findings": [{"kind": f.kind, "key": f.key, "cause": f.cause, "class": f.cls.value,
                              "action": f.action.value, "data": f.data} for f in self.findings]}


@dataclass(frozen=True)
class Collected:
    """How one collector fared this tick (exported as success and duration)."""

    ok: bool
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class CgroupReading:
    version: str | None  # v1 | v2 | None (not found)
    oom_kill: int | None
    file: str | None

    @classmethod
    def from_host(cls, d: dict[str, Any]) -> CgroupReading:
        """From core.host.oom_kills' dict (its three keys are always there)."""
        return cls(d["version"], d["oom_kill"], d["file"])


@dataclass(frozen=True)
class ReplicaReading:
    """One replica at one tick: what the runtime says of it and what the watchdog read of it.
    `at` is the monotonic time of the readings (the hang window's clock)."""

    index: int
    state: RuntimeState
    generation: int
    url: str | None  # its backend (None: not reachable in its state)
    at: float
    metrics: EngineMetrics | None = None  # None: /metrics did not answer, or no backend
    cpu_s: float | None = None  # CPU seconds its API server has used; None: unknown
    probe: ProbeResult | None = None  # a probe of this generation that finished since the last tick

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "state": self.state.value, "generation": self.generation, "url": self.url,
                "metrics": self.metrics.to_dict() if self.metrics is not None else None, "cpu_s": self.cpu_s,
                "probe": {"ok": self.probe.ok, "latency_s": round(self.probe.latency_s, 3),
                          "error": self.probe.error or None, "timed_out": self.probe.timed_out}
                if self.probe is not None else None}


@dataclass
class Sample:
    """One tick of every source (None: that source failed or does not apply; see collectors)."""

    at: str
    t: float  # epoch seconds (the trace's time in a replay)
    status: StatusSnapshot | None = None
    nvml: NvmlRecord | None = None
    procs: dict[int, ProcReading] | None = None
    host: HostReading | None = None
    replicas: list[ReplicaReading] = field(default_factory=list)  # every replica the status lists
    cgroup: CgroupReading | None = None
    kernel_events: list[KernelEvent] = field(default_factory=list)
    kernel_source: str = ""  # kmsg | journal | replay; "" when off or unavailable
    service_cgroup: str | None = None
    child_log: list[str] = field(default_factory=list)
    nvml_mismatch: bool = False
    collectors: dict[str, Collected] = field(default_factory=dict)

    def error(self, collector: str) -> str | None:
        c = self.collectors.get(collector)
        return c.error if c is not None else None

    def to_json(self) -> dict[str, Any]:
        """Every source as JSON (what `--once --json` prints)."""
        return {
            "at": self.at, "t": self.t,
            "status": self.status.to_json() if self.status is not None else None,
            "nvml": self.nvml.model_dump(mode="json") if self.nvml is not None else None,
            "procs": {str(pid): p.model_dump(mode="json") for pid, p in self.procs.items()}
            if self.procs is not None else None,
            "host": self.host.model_dump(mode="json") if self.host is not None else None,
            "replicas": [r.to_json() for r in self.replicas],
            "cgroup": vars(self.cgroup) if self.cgroup is not None else None,
            "kernel_events": [e.to_json() for e in self.kernel_events], "kernel_source": self.kernel_source,
            "service_cgroup": self.service_cgroup,
            "child_log_lines": len(self.child_log),
            "nvml_mismatch": self.nvml_mismatch,
            "collectors": {k: {"ok": c.ok, "seconds": c.seconds, "error": c.error}
                           for k, c in self.collectors.items()},
        }


class Detector(Protocol):
    name: str

    def is_supported(self, s: Sample) -> bool:
        """False when this tick has nothing this detector could judge (e.g. no NVML)."""
        ...

    def check(self, s: Sample) -> CheckResult:
        ...


def result(name: str, s: Sample, health: Health, reason: str, findings: list[Finding] | None = None,
           data: dict[str, Any] | None = None) -> CheckResult:
    """Build a CheckResult; the suggested action is the strongest among the findings."""
    fs = tuple(findings or ())
    action = max((f.action for f in fs), key=ACTION_ORDER.index, default=Action.NONE)
    return CheckResult(name, s.at, health, reason, action, fs, data or {})
