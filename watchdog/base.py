"""The one small interface every detector implements, and the typed results it returns.

Like gpud's components: `name`, `is_supported(sample)`, `check(sample) -> CheckResult`.
A detector that cannot tell says UNKNOWN, never HEALTHY. Findings carry the incident a
detector wants recorded (kind, key, cause, class) and the action it suggests; the policy
decides whether that action is actually taken.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


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


@dataclass(frozen=True)
class Finding:
    """One thing worth an incident: `key` tells repeats of the same problem apart."""

    kind: str
    key: str
    cause: str
    cls: str  # preventive | unplanned | scheduled (ledger classes)
    action: Action = Action.NONE
    data: dict[str, Any] = field(default_factory=dict)


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
                "findings": [{"kind": f.kind, "key": f.key, "cause": f.cause, "class": f.cls,
                              "action": f.action.value, "data": f.data} for f in self.findings]}


Sample = dict[str, Any]
"""One tick of every source: at, t, status, nvml, procs, host, metrics, kernel, cgroup, probe,
errors (see docs/WATCHDOG.md for the keys)."""


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
    order = [Action.NONE, Action.ALERT, Action.RECYCLE, Action.RESTART, Action.HOLD]
    fs = tuple(findings or ())
    action = max((f.action for f in fs), key=order.index, default=Action.NONE)
    return CheckResult(name, s["at"], health, reason, action, fs, data or {})
