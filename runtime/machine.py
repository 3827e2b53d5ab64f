"""The supervisor's states and the transitions between them, as data.

The table is the design: a transition that is not in it is a bug in the supervisor, raised at
once (`IllegalTransition`) rather than discovered as a stuck runtime. Time is passed in, so the
machine is tested without a clock or a vLLM.

    STARTING ──ready──▶ SERVING ──trigger/stop──▶ DRAINING ──drained──▶ STOPPING ──gone──▶ …
        │                  │ crash/hang                                    │
        └──── fail ────────┴───────────────────────▶ STOPPING (SIGKILL) ───┼──▶ STARTING
                                                                           ├──▶ BACKOFF ──▶ STARTING
                                                                           ├──▶ HELD ──release──▶ STARTING
                                                                           └──▶ EXITING
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm_guard.core.protocol import RuntimeState as State

S = State
# Where each state may go next. The first state of a runtime is STARTING or HELD (INITIAL).
TRANSITIONS: dict[State, frozenset[State]] = {
    S.STARTING: frozenset({S.SERVING, S.STOPPING, S.EXITING}),
    S.SERVING: frozenset({S.DRAINING, S.STOPPING}),
    S.DRAINING: frozenset({S.STOPPING}),
    # a second stop signal re-enters STOPPING with SIGKILL
    S.STOPPING: frozenset({S.STOPPING, S.STARTING, S.BACKOFF, S.HELD, S.EXITING}),
    S.BACKOFF: frozenset({S.STARTING, S.HELD, S.EXITING}),
    S.HELD: frozenset({S.STARTING, S.EXITING}),
    S.EXITING: frozenset(),
}
INITIAL: frozenset[State] = frozenset({S.STARTING, S.HELD, S.EXITING})
# States in which a vLLM generation exists (its processes may be alive).
WITH_BACKEND: frozenset[State] = frozenset({S.STARTING, S.SERVING, S.DRAINING, S.STOPPING})


class After(enum.Enum):
    """What follows a replica's stopped generation (STOPPING ends in one of these)."""

    START = "start"
    PROMOTE = "promote"  # gated recycle: open the parked successor's gate once the GPU memory is free
    BACKOFF = "backoff"
    HOLD = "hold"
    EXIT = "exit"


class IllegalTransition(RuntimeError):
    """The supervisor tried a transition the table does not allow (a bug, not an input)."""


@dataclass
class Machine:
    """The current state, since when, and its deadline (monotonic seconds)."""

    state: State = S.STARTING
    since: float = 0.0
    deadline: float | None = None
    entered: bool = field(default=False, repr=False)  # False until the first `enter`

    def can(self, new: State) -> bool:
        allowed = TRANSITIONS[self.state] if self.entered else INITIAL
        return new in allowed

    def enter(self, new: State, now: float, timeout: float | None = None) -> State:
        """Move to `new` (with a deadline `timeout` s from now); returns the old state."""
        if not self.can(new):
            raise IllegalTransition(f"{self.state.value} -> {new.value} is not a transition of the supervisor")
        old = self.state
        self.state, self.since, self.entered = new, now, True
        self.deadline = None if timeout is None else now + timeout
        return old

    def overdue(self, now: float, grace: float = 0.0) -> bool:
        """The state has outlived its deadline (plus `grace`)."""
        return self.deadline is not None and now > self.deadline + grace

    def age(self, now: float) -> float:
        return max(0.0, now - self.since)
