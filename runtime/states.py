"""Supervisor states, exit codes and recycle/failure records (small and import-free)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class State(str, enum.Enum):
    STARTING = "starting"  # a generation is loading; ready = /health 200 and a 1-token completion
    SERVING = "serving"
    DRAINING = "draining"  # no new dispatch; in-flight requests finish (drain timeout)
    STOPPING = "stopping"  # SIGTERM -> deadline -> SIGKILL -> reap -> memory released
    BACKOFF = "backoff"  # after a failure, before the next start
    HELD = "held"  # an operator or the watchdog said: do not start anything
    EXITING = "exiting"


# Named exit codes (gunicorn style): a halt decision, not a restart loop.
EXIT_OK = 0
EXIT_USAGE = 2  # bad CLI or config; nothing was started
EXIT_FAILURE_LIMIT = 3  # too many failures in the window: let systemd's StartLimit decide
EXIT_BOOT_ERROR = 4  # the backend cannot even be launched (no vLLM, no model)


@dataclass
class FailureRecord:
    kind: str  # crash | hang | start_failed | start_timeout | restart
    at: str
    exit_code: int | None
    detail: str = ""
    restored_at: str | None = None
    generation: int = 0
    ledger_id: int = 0

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("ledger_id")
        return d


@dataclass
class RecycleRecord:
    reason: str
    cls: str
    started: str
    in_flight: int
    queued: int
    generation: int
    duration_s: float | None = None
    downtime_s: float | None = None
    started_mono: float = 0.0
    ledger_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "class": self.cls,
            "started": self.started,
            "duration_s": self.duration_s,
            "downtime_s": self.downtime_s,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "generation": self.generation,
            **self.extra,
        }
