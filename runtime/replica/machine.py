"""A replica's states and the transitions between them, as data.

One replica keeps one vLLM server of the service serving, recycle after recycle. Its whole life,
every recycle strategy and every failure path, is one state from this table; what it holds at
each moment is in its slots (`current`, the generation new requests go to; `successor`, the next
one starting beside it; `retiring`, old generations still draining or stopping in the background).
Which state comes next is decided by one pure function (`decide.decide`); a transition that is
not in the table raises `IllegalTransition` at once instead of becoming a stuck replica.

    cold:     SERVING ─▶ UNREADY ─▶ DRAINING ─▶ STOPPING ─▶ STARTING ─▶ SERVING
    overlap:  SERVING ─▶ OVERLAP_STARTING ─▶ SERVING            (the old one retires behind it)
    gated:    SERVING ─▶ GATED_PARKING ─▶ UNREADY ─▶ DRAINING ─▶ STOPPING ─▶ OPENING_GATE
                                                            ─▶ PAST_GATE ─▶ SERVING
    standby:  SERVING ─▶ STANDBY (the next generation parked beside it, kept for later); a
              recycle then goes UNREADY ─▶ DRAINING ─▶ … ─▶ OPENING_GATE at once, a crash FAILING
              ─▶ OPENING_GATE; a standby that dies or cannot park: STANDBY ─▶ SERVING
    late successor: OVERLAP_STARTING / GATED_PARKING ─▶ UNREADY ─▶ … (the successor keeps starting
              and takes over once the old one is gone: STARTING, or OPENING_GATE if gated)
    rolling:  SERVING ─▶ WAITING_TURN ─▶ (a recycle, when no other replica is busy or down)
    failure:  any state with a generation ─▶ FAILING (SIGKILL) ─▶ BACKOFF ─▶ STARTING
              (a successor already starting takes over instead: STARTING / OPENING_GATE)
    held:     … ─▶ HELD ─▶ STARTING (release);   shutdown: … ─▶ DRAINING/STOPPING ─▶ EXITING
    hand-over: SERVING ─▶ HANDING_OVER (its requests finish, it keeps running) ─▶ EXITING, the
              generation left for the next runtime (`runtime/handover.py`)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import RECYCLABLE, RESTARTABLE, RuntimeState

from ..child.death import Death


class State(str, enum.Enum):
    STARTING = "starting"  # `current` boots cold (the first, after a backoff, a release, a cold recycle)
    PAST_GATE = "past_gate"  # `current` boots on after its startup gate opened (gated recycle, standby)
    SERVING = "serving"
    STANDBY = "standby"  # serving; its next generation starts beside it and parks at its gate, kept for later
    WAITING_TURN = "waiting_turn"  # serving; a recycle is wanted but another replica is busy or down
    OVERLAP_STARTING = "overlap_starting"  # serving; the successor boots beside it
    GATED_PARKING = "gated_parking"  # serving; the successor boots up to its startup gate
    UNREADY = "unready"  # serving, announced as leaving, for `unready_lead` before it drains
    DRAINING = "draining"  # `current` takes no new requests; its in-flight ones finish
    HANDING_OVER = "handing_over"  # the runtime exits for the next one: `current` finishes its requests and stays up
    STOPPING = "stopping"  # `current` signalled; waiting for its processes and memory to go
    OPENING_GATE = "opening_gate"  # the old generation is gone; the gate opens once its memory is free
    FAILING = "failing"  # `current` failed and is being killed (SIGKILL)
    BACKOFF = "backoff"  # after a failure, before the next start
    HELD = "held"  # nothing starts until release
    EXITING = "exiting"  # final


S = State
# Where each state may go next.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.STARTING: frozenset({S.SERVING, S.FAILING, S.STOPPING, S.EXITING}),
    S.PAST_GATE: frozenset({S.SERVING, S.FAILING, S.STOPPING}),
    S.SERVING: frozenset({S.STANDBY, S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY, S.DRAINING,
                          S.FAILING, S.HANDING_OVER}),
    S.STANDBY: frozenset({S.SERVING, S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY, S.DRAINING,
                          S.FAILING, S.HANDING_OVER}),
    S.WAITING_TURN: frozenset({S.SERVING, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY, S.DRAINING, S.FAILING,
                               S.HANDING_OVER}),
    S.OVERLAP_STARTING: frozenset({S.SERVING, S.UNREADY, S.DRAINING, S.FAILING, S.HANDING_OVER}),
    S.GATED_PARKING: frozenset({S.SERVING, S.UNREADY, S.DRAINING, S.FAILING, S.HANDING_OVER}),
    S.UNREADY: frozenset({S.SERVING, S.DRAINING, S.FAILING, S.HANDING_OVER}),
    S.DRAINING: frozenset({S.STOPPING, S.FAILING}),
    # a second stop signal turns a hand-over into a plain stop
    S.HANDING_OVER: frozenset({S.EXITING, S.STOPPING, S.FAILING}),
    # a second stop signal re-enters STOPPING with SIGKILL
    S.STOPPING: frozenset({S.STOPPING, S.STARTING, S.OPENING_GATE, S.HELD, S.EXITING}),
    S.OPENING_GATE: frozenset({S.PAST_GATE, S.STARTING, S.HELD, S.EXITING}),
    S.FAILING: frozenset({S.BACKOFF, S.STARTING, S.OPENING_GATE, S.HELD, S.EXITING}),
    S.BACKOFF: frozenset({S.STARTING, S.HELD, S.EXITING}),
    S.HELD: frozenset({S.STARTING, S.EXITING}),
    S.EXITING: frozenset(),
}
INITIAL: frozenset[State] = frozenset({S.STARTING, S.HELD, S.EXITING})
FINAL: frozenset[State] = frozenset({S.EXITING})

# The coarse state every reader of the status knows (the watchdog, the metrics, systemd's STATUS).
COARSE: dict[State, RuntimeState] = {
    S.STARTING: RuntimeState.STARTING, S.PAST_GATE: RuntimeState.STARTING,
    S.SERVING: RuntimeState.SERVING, S.STANDBY: RuntimeState.SERVING, S.WAITING_TURN: RuntimeState.SERVING,
    S.OVERLAP_STARTING: RuntimeState.SERVING, S.GATED_PARKING: RuntimeState.SERVING,
    S.UNREADY: RuntimeState.SERVING,
    S.DRAINING: RuntimeState.DRAINING, S.HANDING_OVER: RuntimeState.DRAINING,
    S.STOPPING: RuntimeState.STOPPING, S.OPENING_GATE: RuntimeState.STOPPING, S.FAILING: RuntimeState.STOPPING,
    S.BACKOFF: RuntimeState.BACKOFF, S.HELD: RuntimeState.HELD, S.EXITING: RuntimeState.EXITING,
}

# Sets of states, named once beside them (supervisord's STOPPED_STATES): every check imports them.
BOOTING_STATES = frozenset({S.STARTING, S.PAST_GATE})  # `current` boots; it has served nothing yet
SERVING_STATES = frozenset(s for s in State if COARSE[s] is RuntimeState.SERVING)  # `current` serves
# serving, with a recycle under way beside it or waiting for its turn
RECYCLING_STATES = frozenset({S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY})
# The command rule (`core.protocol`, which the watchdog reads too) over the replica's own states:
# a restart where the coarse state takes one; a recycle where it takes one and none is under way.
RESTARTABLE_STATES = frozenset(s for s in State if COARSE[s] in RESTARTABLE)
RECYCLABLE_STATES = frozenset(s for s in State if COARSE[s] in RECYCLABLE) - RECYCLING_STATES
IDLE_STATES = frozenset({S.HELD, S.EXITING})  # nothing runs and nothing will start
# `current` is the recycle's successor, booting on past its opened gate (status: next_phase past_gate)
TAKING_OVER_STATES = frozenset({S.PAST_GATE})


class IllegalTransition(RuntimeError):
    """A transition the table does not allow (a bug in `decide`, not an input)."""


@dataclass(frozen=True)
class Recycle:
    """A planned recycle under way: why, how, and by when its successor must be ready."""

    reason: str
    cls: EndClass
    strategy: str  # overlap | gated | cold (the one running now, after any fallback)
    why: str  # the readings behind the choice, or the override, or the fallback
    started_at: float  # monotonic
    generation: int  # the generation it replaces
    successor_deadline: float | None = None  # after this the old one drains anyway (the trigger's urgency)
    closed_at: float | None = None  # when the replica stopped taking new requests (cold, gated)


@dataclass(frozen=True)
class Wanted:
    """A recycle asked for that waits for its turn (another replica is busy or down)."""

    reason: str
    cls: EndClass
    strategy: str | None = None  # forced by the command, None: [server] recycle_strategy


@dataclass(frozen=True)
class Machine:
    """Everything `decide` keeps about one replica between two looks; immutable."""

    state: State = S.STARTING
    since: float = 0.0
    deadline: float | None = None  # of this state (monotonic)
    entered: bool = False  # False until the first transition
    recycle: Recycle | None = None
    wanted: Wanted | None = None
    consecutive: int = 0  # failures since the last generation served (the backoff's exponent)
    last_death: Death | None = None  # how its last own start died before serving (None: it served since)
    end_reason: tuple[str, EndClass] = ("", EndClass.SCHEDULED)  # recorded when `current` ends
    deferred: str | None = None  # why the wanted recycle waits (logged when it changes)
    seq: int = 0  # transitions so far (a re-entry of the same state counts)

    def can(self, new: State) -> bool:
        return new in (TRANSITIONS[self.state] if self.entered else INITIAL)

    def to(self, new: State, now: float, timeout: float | None = None, **changes: object) -> Machine:
        """The machine in `new` (with a deadline `timeout` s from now); IllegalTransition else."""
        if not self.can(new):
            raise IllegalTransition(f"{self.state.value} -> {new.value} is not a transition of a replica")
        from dataclasses import replace

        return replace(self, state=new, since=now, entered=True, seq=self.seq + 1,
                       deadline=None if timeout is None else now + timeout, **changes)  # type: ignore[arg-type]

    def overdue(self, now: float, grace: float = 0.0) -> bool:
        """The state has outlived its deadline (plus `grace`)."""
        return self.deadline is not None and now > self.deadline + grace

    def age(self, now: float) -> float:
        return max(0.0, now - self.since)


def coarse(state: State) -> RuntimeState:
    return COARSE[state]


def final(state: State) -> bool:
    return state in FINAL


def aggregate(states: Iterable[State]) -> RuntimeState:
    """The runtime's one state: serving while any replica serves; otherwise the furthest along."""
    have = {COARSE[s] for s in states}
    order = (RuntimeState.SERVING, RuntimeState.STARTING, RuntimeState.DRAINING, RuntimeState.STOPPING,
             RuntimeState.BACKOFF, RuntimeState.HELD, RuntimeState.EXITING)
    return next((s for s in order if s in have), RuntimeState.STARTING)


def idle(peers: Sequence[Machine], skip: int | None = None) -> bool:
    """Every replica (besides `skip`) is held or gone: requests should fail fast instead of
    queueing."""
    return all(m.state in IDLE_STATES for i, m in enumerate(peers) if i != skip)


def rolling(index: int, peers: Sequence[Machine]) -> str | None:
    """The rolling rule: None when replica `index` may begin a planned recycle now (no other
    replica is recycling, every other one serves), else why it waits."""
    for i, m in enumerate(peers):
        if i == index:
            continue
        if m.recycle is not None:
            return f"replica {i} is recycling"
        if m.state not in SERVING_STATES:
            return f"replica {i} is {COARSE[m.state].value}"
    return None


def serving_count(peers: Sequence[Machine], skip: int | None = None) -> int:
    """How many replicas serve (besides `skip`)."""
    return sum(1 for i, m in enumerate(peers) if i != skip and m.state in SERVING_STATES)
