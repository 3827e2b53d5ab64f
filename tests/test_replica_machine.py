"""The replica's state machine as a table: every (state, event) pair finds a transition or an
asserted refusal, every transition `decide` makes is one the table allows, and every edge of the
table is taken by a case here (`EDGE_CASES` for those no (state, event) pair takes: a start that
is ready, a recycle with a strategy, a standby, a successor that parks or exits...), which a test
checks by recording the transitions. Pure: views in, decisions out, no driver (that is
tests/test_replica_driver.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.ledger import EndClass
from vllm_guard.runtime.replica.decide import decide
from vllm_guard.runtime.replica.steps import ViewMismatch
from vllm_guard.runtime.replica.strategy import MemoryFit
from vllm_guard.runtime.replica.machine import (
    COARSE, FINAL, INITIAL, RECYCLABLE_STATES, RESTARTABLE_STATES, TRANSITIONS, IllegalTransition, Machine, Recycle,
    State, Wanted, aggregate, rolling,
)
from vllm_guard.runtime.replica.view import (
    Abandon, EnforceLimits, Facts, Failure, GenPhase, GenView, HoldCmd, RecycleCmd, RecycleOver, RejectRequests,
    ReleaseCmd, ReplicaView, RestartCmd, SpawnFailed, Stop, StopCmd, Tick, WatchRoom,
)

S = State
NOW = 1000.0
EVENTS = ["tick", "crash", "hang", "recycle", "restart", "hold", "release", "stop", "stop2", "spawn_failed"]


def facts(**kw: object) -> Facts:
    cfg = GuardConfig()
    base: dict[str, object] = {"cfg": cfg}
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


def gen(n: int, phase: GenPhase, **kw: object) -> GenView:
    base: dict[str, object] = {"number": n, "phase": phase, "spawned_at": NOW - 10, "deadline": NOW + 100}
    if phase is not GenPhase.BOOTING:
        base["ready_at"] = NOW - 60  # serving a minute, with no memory reading: `auto` decides without one
    base.update(kw)
    return GenView(**base)  # type: ignore[arg-type]


REC = Recycle(reason="max_requests", cls=EndClass.SCHEDULED, strategy="cold", why="test", started_at=NOW - 5,
              generation=1)


def view_of(state: State) -> ReplicaView:
    """A quiet replica in `state`: nothing has happened, no deadline has passed."""
    m = Machine(state=state, since=NOW - 1, deadline=NOW + 100, entered=True)
    f = facts()
    cur: GenView | None = gen(1, GenPhase.SERVING)
    nxt: GenView | None = None
    if state in (S.STARTING, S.PAST_GATE):
        cur = gen(1, GenPhase.BOOTING, gated=state is S.PAST_GATE)
    elif state is S.WAITING_TURN:
        m = replace(m, wanted=Wanted("max_requests", EndClass.SCHEDULED), deferred="replica 1 is recycling")
        f = facts(peers=(m, Machine(state=S.SERVING, entered=True, recycle=REC)))
    elif state is S.STANDBY:
        nxt = gen(2, GenPhase.BOOTING, gated=True, beside=True, standby=True)
    elif state is S.OVERLAP_STARTING:
        m, nxt = replace(m, recycle=replace(REC, strategy="overlap")), gen(2, GenPhase.BOOTING, beside=True)
    elif state is S.GATED_PARKING:
        m, nxt = replace(m, recycle=replace(REC, strategy="gated")), gen(2, GenPhase.BOOTING, gated=True, beside=True)
    elif state is S.UNREADY:
        m = replace(m, recycle=REC)
    elif state is S.DRAINING:
        m, cur = replace(m, recycle=REC), gen(1, GenPhase.DRAINING, in_flight=1)
    elif state is S.HANDING_OVER:
        cur = gen(1, GenPhase.SERVING, in_flight=1)
    elif state in (S.STOPPING, S.FAILING):
        m, cur = replace(m, recycle=REC if state is S.STOPPING else None), gen(1, GenPhase.STOPPING, alive=(7,))
    elif state is S.OPENING_GATE:
        m, cur = replace(m, recycle=replace(REC, strategy="gated")), None
        nxt = gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True)
        f = facts(nvml=True, gpu_room=False)
    elif state in (S.BACKOFF, S.HELD, S.EXITING):
        cur = None
        if state is S.HELD:
            f = facts(hold="maintenance")
    return ReplicaView(machine=m, facts=f, current=cur, successor=nxt)


def event_of(name: str, v: ReplicaView) -> tuple[ReplicaView, object]:
    cur = v.current
    if name == "crash":  # the API server exits (exit 0 included) / a successor at its gate exits
        if cur is not None:
            return replace(v, current=replace(cur, exit_code=0)), Tick()
        if v.successor is not None:
            return replace(v, successor=replace(v.successor, exit_code=1)), Tick()
        return v, Tick()
    if name == "hang":
        return (replace(v, current=replace(cur, hang="no token moved")) if cur is not None else v), Tick()
    if name == "hold":
        return replace(v, facts=replace(v.facts, hold="maintenance")), HoldCmd("maintenance")
    if name == "release":
        return replace(v, facts=replace(v.facts, hold=None)), ReleaseCmd()
    if name in ("stop", "stop2"):
        return replace(v, facts=replace(v.facts, stopping=True)), StopCmd(second=name == "stop2")
    return v, {"tick": Tick(), "recycle": RecycleCmd("operator"), "restart": RestartCmd("stuck"),
               "spawn_failed": SpawnFailed("no such file")}[name]


SAME = "same"
# what each state does on each event: the next state, or a refusal (with a word of its reason)
EXPECT: dict[State, dict[str, object]] = {
    S.STARTING: {"tick": SAME, "crash": S.FAILING, "hang": SAME, "recycle": "still starting",
                 "restart": S.FAILING, "hold": SAME, "release": SAME, "stop": S.STOPPING, "stop2": S.STOPPING,
                 "spawn_failed": S.EXITING},
    S.SERVING: {"tick": SAME, "crash": S.FAILING, "hang": S.FAILING, "recycle": S.UNREADY, "restart": S.FAILING,
                "hold": SAME, "release": SAME, "stop": S.DRAINING, "stop2": S.DRAINING, "spawn_failed": SAME},
    S.STANDBY: {"tick": SAME, "crash": S.FAILING, "hang": S.FAILING, "recycle": S.GATED_PARKING,
                "restart": S.FAILING, "hold": S.SERVING, "release": SAME, "stop": S.DRAINING, "stop2": S.DRAINING,
                "spawn_failed": SAME},
    S.WAITING_TURN: {"tick": SAME, "crash": S.FAILING, "hang": S.FAILING, "recycle": "already in progress",
                     "restart": S.FAILING, "hold": S.SERVING, "release": SAME, "stop": S.DRAINING,
                     "stop2": S.DRAINING, "spawn_failed": SAME},
    S.OVERLAP_STARTING: {"tick": SAME, "crash": S.FAILING, "hang": S.FAILING, "recycle": "already in progress",
                         "restart": S.FAILING, "hold": S.SERVING, "release": SAME, "stop": S.DRAINING,
                         "stop2": S.DRAINING, "spawn_failed": SAME},
    S.UNREADY: {"tick": SAME, "crash": S.FAILING, "hang": S.FAILING, "recycle": "already in progress",
                "restart": S.FAILING, "hold": S.SERVING, "release": SAME, "stop": S.DRAINING, "stop2": S.DRAINING,
                "spawn_failed": SAME},
    S.DRAINING: {"tick": SAME, "crash": S.FAILING, "hang": SAME, "recycle": "already in progress",
                 "restart": S.FAILING, "hold": SAME, "release": SAME, "stop": SAME, "stop2": S.STOPPING,
                 "spawn_failed": SAME},
    S.STOPPING: {"tick": SAME, "crash": SAME, "hang": SAME, "recycle": "already in progress",
                 "restart": "already in progress", "hold": SAME, "release": SAME, "stop": SAME,
                 "stop2": S.STOPPING, "spawn_failed": S.EXITING},
    S.OPENING_GATE: {"tick": SAME, "crash": S.STARTING, "hang": SAME, "recycle": "already in progress",
                     "restart": "already in progress", "hold": SAME, "release": SAME, "stop": S.EXITING,
                     "stop2": S.EXITING, "spawn_failed": S.EXITING},
    S.FAILING: {"tick": SAME, "crash": SAME, "hang": SAME, "recycle": "being stopped", "restart": "being stopped",
                "hold": SAME, "release": SAME, "stop": SAME, "stop2": SAME, "spawn_failed": S.EXITING},
    S.BACKOFF: {"tick": SAME, "crash": SAME, "hang": SAME, "recycle": "backing off", "restart": "backing off",
                "hold": S.HELD, "release": SAME, "stop": S.EXITING, "stop2": S.EXITING, "spawn_failed": S.EXITING},
    S.HELD: {"tick": SAME, "crash": SAME, "hang": SAME, "recycle": "held", "restart": "held", "hold": SAME,
             "release": S.STARTING, "stop": S.EXITING, "stop2": S.EXITING, "spawn_failed": S.EXITING},
    S.EXITING: {"tick": SAME, "crash": SAME, "hang": SAME, "recycle": "shutting down", "restart": "shutting down",
                "hold": SAME, "release": SAME, "stop": SAME, "stop2": SAME, "spawn_failed": SAME},
}
EXPECT[S.HANDING_OVER] = {"tick": SAME, "crash": S.FAILING, "hang": SAME, "recycle": "already in progress",
                          "restart": S.FAILING, "hold": SAME, "release": SAME, "stop": S.STOPPING,
                          "stop2": S.STOPPING, "spawn_failed": S.EXITING}
EXPECT[S.PAST_GATE] = {**EXPECT[S.STARTING], "spawn_failed": SAME}  # nothing is spawned there
EXPECT[S.GATED_PARKING] = dict(EXPECT[S.OVERLAP_STARTING])


def test_the_table_covers_every_state_and_event() -> None:
    assert set(EXPECT) == set(State)
    assert all(set(row) == set(EVENTS) for row in EXPECT.values())


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
@pytest.mark.parametrize("name", EVENTS)
def test_every_state_and_event_is_a_transition_or_an_asserted_refusal(state: State, name: str) -> None:
    v, event = event_of(name, view_of(state))
    d = decide(v, event, NOW)  # type: ignore[arg-type]
    want = EXPECT[state][name]
    if not isinstance(want, State) and want != SAME:
        assert d.reply is not None and not d.reply.accepted and want in d.reply.detail, d
        assert d.machine == v.machine, "a refused command changed the machine"
        return
    new = state if want == SAME else want
    assert d.machine.state is new, (d.machine.state, d.effects)
    if new is not state:
        assert new in TRANSITIONS[state]
    if name in ("recycle", "restart", "hold", "release"):
        assert d.reply is not None and d.reply.accepted, d.reply


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.value)
def test_decide_takes_a_restart_or_recycle_in_exactly_the_named_states(state: State) -> None:
    """The command rule has one home (machine.RESTARTABLE_STATES, RECYCLABLE_STATES, from
    core.protocol's sets): `decide` accepts exactly there."""
    for name, states in (("restart", RESTARTABLE_STATES), ("recycle", RECYCLABLE_STATES)):
        v, event = event_of(name, view_of(state))
        d = decide(v, event, NOW)  # type: ignore[arg-type]
        assert d.reply is not None and d.reply.accepted == (state in states), (name, d.reply)


# -- the edges no (state, event) pair above takes -------------------------------------------------
GIB = 1024.0
FITS = MemoryFit(host_available_mb=20 * GIB, host_footprint_mb=3 * GIB, parked_mb=1.5 * GIB)  # two fit
BUSY = Machine(state=S.SERVING, entered=True, recycle=REC)  # another replica, recycling
Case = tuple[ReplicaView, object]


def with_(state: State, event: object = None, machine: dict[str, object] | None = None,
          current: dict[str, object] | None = None, successor: GenView | None = None, busy_peer: bool = False,
          **fact: object) -> Case:
    """`view_of(state)` changed: fields of its machine, its current generation, a successor, facts."""
    v = view_of(state)
    if machine:
        v = replace(v, machine=replace(v.machine, **machine))  # type: ignore[arg-type]
    if current:
        v = replace(v, current=replace(v.current, **current))  # type: ignore[arg-type]
    if successor is not None:
        v = replace(v, successor=successor)
    if busy_peer:
        fact["peers"] = (v.machine, BUSY)
    if fact:
        v = replace(v, facts=replace(v.facts, **fact))  # type: ignore[arg-type]
    return v, Tick() if event is None else event


GONE = {"alive": (), "gone": True}  # a stopped generation whose processes and memory are gone
PARKED = gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True)
UNGATED = gen(2, GenPhase.BOOTING, beside=True)
EXITED = gen(2, GenPhase.BOOTING, beside=True, exit_code=1)

EDGE_CASES: dict[str, tuple[State, State, Case]] = {
    "a cold start is ready": (S.STARTING, S.SERVING, with_(S.STARTING, current={"ready_at": NOW})),
    "a start past its gate is ready": (S.PAST_GATE, S.SERVING, with_(S.PAST_GATE, current={"ready_at": NOW})),
    "a serving generation keeps a standby": (S.SERVING, S.STANDBY, with_(S.SERVING, current={"fit": FITS})),
    "an overlap recycle": (S.SERVING, S.OVERLAP_STARTING, with_(S.SERVING, RecycleCmd("op", strategy="overlap"))),
    "a gated recycle": (S.SERVING, S.GATED_PARKING, with_(S.SERVING, RecycleCmd("op", strategy="gated"))),
    "a recycle while another replica recycles": (
        S.SERVING, S.WAITING_TURN, with_(S.SERVING, RecycleCmd("op"), busy_peer=True)),
    "a recycle overlaps beside the standby": (
        S.STANDBY, S.OVERLAP_STARTING, with_(S.STANDBY, RecycleCmd("op", strategy="overlap"))),
    "a recycle uses the parked standby": (S.STANDBY, S.UNREADY, with_(S.STANDBY, RecycleCmd("op"), successor=PARKED)),
    "a recycle with a standby waits its turn": (
        S.STANDBY, S.WAITING_TURN, with_(S.STANDBY, RecycleCmd("op"), busy_peer=True)),
    "its turn came: overlap": (S.WAITING_TURN, S.OVERLAP_STARTING, with_(
        S.WAITING_TURN, machine={"wanted": Wanted("max_requests", EndClass.SCHEDULED, "overlap")}, peers=())),
    "its turn came: gated": (S.WAITING_TURN, S.GATED_PARKING, with_(
        S.WAITING_TURN, machine={"wanted": Wanted("max_requests", EndClass.SCHEDULED, "gated")}, peers=())),
    "its turn came: cold": (S.WAITING_TURN, S.UNREADY, with_(
        S.WAITING_TURN, machine={"wanted": Wanted("max_requests", EndClass.SCHEDULED, "cold")}, peers=())),
    "the overlap successor exits: cold": (S.OVERLAP_STARTING, S.UNREADY, with_(S.OVERLAP_STARTING, successor=EXITED)),
    "the gated successor parks": (S.GATED_PARKING, S.UNREADY, with_(
        S.GATED_PARKING, successor=replace(PARKED, spawned_at=NOW - 10))),
    "stopped: the next starts cold": (S.STOPPING, S.STARTING, with_(S.STOPPING, current=GONE)),
    "stopped while held": (S.STOPPING, S.HELD, with_(S.STOPPING, current=GONE, hold="maintenance")),
    "stopped: the parked successor's gate opens next": (
        S.STOPPING, S.OPENING_GATE, with_(S.STOPPING, current=GONE, successor=PARKED)),
    "held at the gate": (S.OPENING_GATE, S.HELD, with_(S.OPENING_GATE, hold="maintenance")),
    "room at the gate: it opens": (S.OPENING_GATE, S.PAST_GATE, with_(S.OPENING_GATE, gpu_room=True)),
    "killed: back off": (S.FAILING, S.BACKOFF, with_(S.FAILING, current=GONE)),
    "killed while held": (S.FAILING, S.HELD, with_(S.FAILING, current=GONE, hold="maintenance")),
    "killed: the parked standby's gate opens": (
        S.FAILING, S.OPENING_GATE, with_(S.FAILING, current=GONE, successor=PARKED)),
    "killed: the starting successor takes over": (
        S.FAILING, S.STARTING, with_(S.FAILING, current=GONE, successor=UNGATED)),
    "backed off: start again": (S.BACKOFF, S.STARTING, with_(S.BACKOFF, machine={"deadline": NOW - 1})),
    **{f"a hand-over while {s.value}": (s, S.HANDING_OVER, with_(s, StopCmd(hand_over=True), stopping=True))
       for s in (S.SERVING, S.STANDBY, S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY)},
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_each_edge_case_takes_its_edge(name: str) -> None:
    frm, to, (v, event) = EDGE_CASES[name]
    d = decide(v, event, NOW)  # type: ignore[arg-type]
    assert v.machine.state is frm and d.machine.state is to, (d.machine.state, d.effects)
    if d.reply is not None:
        assert d.reply.accepted, d.reply


def every_case() -> list[Case]:
    """Every view and event of this file's transition cases: the (state, event) grid, the edge
    cases, the first looks."""
    out = [event_of(name, view_of(state)) for state in State for name in EVENTS]
    out += [case for _, _, case in EDGE_CASES.values()]
    fresh = ReplicaView(machine=Machine(), facts=facts())
    out += [(fresh, Tick()), (replace(fresh, facts=facts(hold="x")), Tick()),
            (replace(fresh, facts=facts(stopping=True)), Tick())]
    return out


def test_every_edge_of_the_table_is_taken_by_a_case_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's edges (and its initial states) are exactly the transitions `decide` makes
    over this file's cases: none is left to the simulated world's scenarios alone."""
    taken: set[tuple[State | None, State]] = set()
    real = Machine.to

    def to(self: Machine, new: State, now: float, timeout: float | None = None, **changes: object) -> Machine:
        taken.add((self.state if self.entered else None, new))
        return real(self, new, now, timeout, **changes)

    monkeypatch.setattr(Machine, "to", to)
    for v, event in every_case():
        decide(v, event, NOW)  # type: ignore[arg-type]
    edges = {(a, b) for a, bs in TRANSITIONS.items() for b in bs} | {(None, s) for s in INITIAL}
    missing = sorted(f"{a.value if a else '(first look)'} -> {b.value}" for a, b in edges - taken)
    assert not missing, f"{len(missing)} of {len(edges)} edges taken by no case: {missing}"
    assert taken <= edges


def test_a_crash_is_recorded_and_killed_in_every_state_with_a_serving_generation() -> None:
    for state in (S.SERVING, S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING, S.UNREADY, S.DRAINING):
        v, e = event_of("crash", view_of(state))
        d = decide(v, e, NOW)  # type: ignore[arg-type]
        fails = [x for x in d.effects if isinstance(x, Failure)]
        stops = [x for x in d.effects if isinstance(x, Stop)]
        assert [f.kind for f in fails] == ["crash"] and stops[0].kill, (state, d.effects)
        assert not [x for x in d.effects if isinstance(x, Abandon)], "a starting successor is kept to take over"


def test_the_first_look_starts_or_holds() -> None:
    fresh = ReplicaView(machine=Machine(), facts=facts())
    assert decide(fresh, Tick(), NOW).machine.state is S.STARTING
    assert decide(replace(fresh, facts=facts(hold="x")), Tick(), NOW).machine.state is S.HELD
    assert decide(replace(fresh, facts=facts(stopping=True)), Tick(), NOW).machine.state is S.EXITING


def test_a_view_the_state_rules_out_raises_a_mismatch_not_an_assertion() -> None:
    """Preconditions survive `python -O`: a replica waiting its turn with no recycle wanted, one
    that serves with no current generation, raise ViewMismatch."""
    waiting = view_of(S.WAITING_TURN)
    with pytest.raises(ViewMismatch, match="no recycle wanted"):
        decide(replace(waiting, machine=replace(waiting.machine, wanted=None)), Tick(), NOW)
    unready = view_of(S.UNREADY)
    with pytest.raises(ViewMismatch, match="no current generation"):
        decide(replace(unready, current=None, machine=replace(unready.machine, deadline=NOW - 1)), Tick(), NOW)


def test_transitions_outside_the_table_raise() -> None:
    m = Machine(state=S.SERVING, entered=True)
    with pytest.raises(IllegalTransition, match="serving -> starting"):
        m.to(S.STARTING, NOW)
    with pytest.raises(IllegalTransition):
        Machine().to(S.SERVING, NOW)
    assert INITIAL <= set(State) and FINAL == {S.EXITING} and TRANSITIONS[S.EXITING] == frozenset()


def test_every_state_has_a_coarse_state_and_the_aggregate_prefers_serving() -> None:
    assert set(COARSE) == set(State)
    assert aggregate([S.STOPPING, S.UNREADY]).value == "serving"
    assert aggregate([S.BACKOFF, S.OPENING_GATE]).value == "stopping"


def test_the_rolling_rule() -> None:
    serving, busy = Machine(state=S.SERVING, entered=True), Machine(state=S.SERVING, entered=True, recycle=REC)
    assert rolling(0, [serving, serving]) is None
    assert rolling(0, [serving, busy]) == "replica 1 is recycling"
    assert rolling(0, [serving, Machine(state=S.BACKOFF, entered=True)]) == "replica 1 is backoff"
    assert rolling(1, [serving, Machine(state=S.STARTING)]) is None  # itself does not count


# -- what decide says, so that nobody derives it again ---------------------------------------------
def kinds(d: object, *types: type) -> list[object]:
    return [e for e in d.effects if isinstance(e, types)]  # type: ignore[attr-defined]


def test_the_hold_and_the_stop_set_the_proxys_admission() -> None:
    """Held: no generation stops at its count limit; requests fail fast once no replica runs (the
    last one held says it); a release takes them again; a stop refuses them."""
    fresh = ReplicaView(machine=Machine(), facts=facts(hold="maintenance"))
    d = decide(fresh, Tick(), NOW)
    assert kinds(d, EnforceLimits, RejectRequests) == [EnforceLimits(False), RejectRequests("held: maintenance")]
    v, e = event_of("hold", view_of(S.SERVING))
    d = decide(v, e, NOW)  # type: ignore[arg-type]
    assert kinds(d, EnforceLimits, RejectRequests) == [EnforceLimits(False)], "it still serves"
    v, e = event_of("hold", view_of(S.BACKOFF))
    other = Machine(state=S.SERVING, entered=True)
    alone = decide(v, e, NOW)  # type: ignore[arg-type]
    beside = decide(replace(v, facts=replace(v.facts, peers=(v.machine, other))), e, NOW)  # type: ignore[arg-type]
    assert RejectRequests("held: maintenance") in alone.effects and not kinds(beside, RejectRequests)
    v, e = event_of("release", view_of(S.HELD))
    released = decide(v, e, NOW)  # type: ignore[arg-type]
    assert kinds(released, EnforceLimits, RejectRequests) == [EnforceLimits(True), RejectRequests(None)]
    for state in (S.SERVING, S.STARTING, S.BACKOFF):
        v, e = event_of("stop", view_of(state))
        stopped = decide(v, e, NOW)  # type: ignore[arg-type]
        assert kinds(stopped, RejectRequests) == [RejectRequests("vllm-guard is shutting down")]


def test_a_parked_successor_waiting_for_room_is_watched_from_entry_to_exit() -> None:
    v = view_of(S.STOPPING)
    v = replace(v, current=replace(v.current, alive=(), gone=True),  # type: ignore[arg-type]
                successor=gen(2, GenPhase.BOOTING, gated=True, gate="parked", beside=True))
    d = decide(v, Tick(), NOW)
    assert d.machine.state is S.OPENING_GATE and d.effects[0] == WatchRoom(True)
    opened = decide(replace(view_of(S.OPENING_GATE), facts=facts(nvml=True, gpu_room=True)), Tick(), NOW)
    assert opened.machine.state is S.PAST_GATE and opened.effects[0] == WatchRoom(False)
    assert not kinds(decide(view_of(S.OPENING_GATE), Tick(), NOW), WatchRoom), "no room yet: it goes on watching"


def test_a_recycle_that_ends_with_nothing_ready_is_over() -> None:
    for name, state in (("crash", S.OVERLAP_STARTING), ("hold", S.GATED_PARKING), ("stop", S.UNREADY)):
        v, e = event_of(name, view_of(state))
        d = decide(v, e, NOW)  # type: ignore[arg-type]
        assert d.machine.recycle is None and kinds(d, RecycleOver) == [RecycleOver()], (name, state)
    v, e = event_of("tick", view_of(S.SERVING))
    assert not kinds(decide(v, e, NOW), RecycleOver)  # type: ignore[arg-type]


# -- the hand-over to the next runtime (runtime/handover.py) ---------------------------------------
@pytest.mark.parametrize("state", [S.SERVING, S.STANDBY, S.WAITING_TURN, S.OVERLAP_STARTING, S.GATED_PARKING,
                                   S.UNREADY], ids=lambda s: s.value)
def test_a_hand_over_keeps_the_serving_generation_and_refuses_no_request(state: State) -> None:
    v = view_of(state)
    v = replace(v, facts=replace(v.facts, stopping=True))
    d = decide(v, StopCmd(hand_over=True), NOW)
    assert d.machine.state is S.HANDING_OVER and d.machine.recycle is None
    assert d.machine.deadline == NOW + v.facts.cfg.server.drain_timeout
    kinds = [type(e).__name__ for e in d.effects]
    assert "RejectRequests" not in kinds and "Stop" not in kinds and "Drain" not in kinds, kinds
    assert ("Abandon" in kinds) == (v.successor is not None), kinds  # a successor or standby goes


@pytest.mark.parametrize("state", [S.STARTING, S.PAST_GATE, S.DRAINING, S.BACKOFF, S.HELD], ids=lambda s: s.value)
def test_a_hand_over_of_a_replica_that_does_not_serve_is_a_plain_stop(state: State) -> None:
    v = view_of(state)
    v = replace(v, facts=replace(v.facts, stopping=True))
    plain, handed = decide(v, StopCmd(), NOW), decide(v, StopCmd(hand_over=True), NOW)
    assert handed.machine.state is plain.machine.state is not S.HANDING_OVER
    assert [type(e) for e in handed.effects] == [type(e) for e in plain.effects]


def test_handing_over_detaches_the_generation_once_its_requests_are_done() -> None:
    v = view_of(S.HANDING_OVER)
    busy = decide(v, Tick(), NOW)
    assert busy.machine.state is S.HANDING_OVER and not busy.effects
    idle = replace(v, current=replace(v.current, in_flight=0))  # type: ignore[arg-type]
    # a connection accepted as the listener closed still gets its request in: not detached at once
    early = decide(replace(idle, machine=replace(idle.machine, since=NOW - 0.2)), Tick(), NOW)
    assert early.machine.state is S.HANDING_OVER and not early.effects
    done = decide(idle, Tick(), NOW)
    assert done.machine.state is S.EXITING
    assert [type(e).__name__ for e in done.effects] == ["Detach"]


def test_handing_over_past_the_drain_timeout_detaches_with_requests_still_running() -> None:
    v = view_of(S.HANDING_OVER)
    late = decide(v, Tick(), (v.machine.deadline or NOW) + 1)
    assert late.machine.state is S.EXITING
    assert [type(e).__name__ for e in late.effects] == ["Log", "Detach"]
    assert late.effects[0].event == "drain_timeout"  # type: ignore[union-attr]


def test_a_generation_that_dies_while_handing_over_is_a_failure_not_handed_over() -> None:
    v = view_of(S.HANDING_OVER)
    d = decide(replace(v, current=replace(v.current, exit_code=-9)), Tick(), NOW)  # type: ignore[arg-type]
    assert d.machine.state is S.FAILING
    assert "Detach" not in [type(e).__name__ for e in d.effects]
