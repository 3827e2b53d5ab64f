"""What a replica does on a command: recycle, restart, hold, release, stop (and a stop that hands
over to the next runtime). Part of `decide` (pure; `decide.decide` dispatches here), kept apart so
the tick's state walk and the commands each read on their own.
"""

from __future__ import annotations

from vllm_guard.core.ledger import EndClass, FailureKind

from .machine import BOOTING_STATES, RECYCLABLE_STATES, RECYCLING_STATES, RESTARTABLE_STATES, SERVING_STATES, State
from .steps import KILL_WAIT_S, Out, begin_or_wait, begin_recycle, drain_current, fail, start_cold, stop_span, wait_why
from .view import (
    Abandon, EnforceLimits, Leaving, RecycleCmd, RejectRequests, ReplicaView, Reply, RestartCmd, Stop, StopCmd,
)

S = State


def _why_not(v: ReplicaView) -> str:
    f, m, cur = v.facts, v.machine, v.current
    where = f"replica {f.index}: " if f.replicas > 1 else ""
    if f.stopping:
        return where + "the runtime is shutting down"
    n = cur.number if cur is not None else "-"
    return where + {
        S.STARTING: f"generation {n} is still starting",
        S.PAST_GATE: f"generation {n} is still starting",
        S.BACKOFF: "no generation is running (backing off after a failure)",
        S.FAILING: f"generation {n} failed and is being stopped",
        S.HELD: f"held ({f.hold}): nothing runs until release",
        S.EXITING: "the runtime is shutting down",
    }.get(m.state, "a recycle or stop is already in progress")


def recycle_cmd(v: ReplicaView, cmd: RecycleCmd, now: float, out: Out) -> None:
    f, cur = v.facts, v.current
    where = f"replica {f.index}: " if f.replicas > 1 else ""
    if f.hold is not None:
        out.add(Reply(False, f"held ({f.hold}): planned recycles wait for release"))
    elif f.stopping or v.machine.state not in RECYCLABLE_STATES or cur is None:
        out.add(Reply(False, _why_not(v)))
    elif (why := wait_why(v, now, cmd.strategy)) is not None:
        begin_or_wait(v, now, out, cmd.reason, cmd.cls, cmd.strategy)
        out.add(Reply(True, f"{where}waits ({why})"))
    else:
        begin_recycle(v, now, out, cmd.reason, cmd.cls, cmd.strategy)
        st, nxt_n = out.m.state, "next"
        if st is S.OVERLAP_STARTING or st is S.GATED_PARKING:
            how = "up to its startup gate " if st is S.GATED_PARKING else ""
            out.add(Reply(True, f"{where}starting the {nxt_n} generation {how}beside generation {cur.number} "
                                f"({out.m.recycle.strategy if out.m.recycle else ''})"))
        else:
            out.add(Reply(True, f"{where}draining generation {cur.number}"))


def restart_cmd(v: ReplicaView, cmd: RestartCmd, now: float, out: Out) -> None:
    cur = v.current
    if v.facts.stopping or cur is None or v.machine.state not in RESTARTABLE_STATES:
        out.add(Reply(False, _why_not(v)))
        return
    fail(v, now, out, cur, FailureKind.RESTART.value, cur.exit_code, cmd.reason, cmd.cls)
    out.add(Reply(True, f"killing generation {cur.number}; requests not yet answered go to the next"))


def hold_cmd(v: ReplicaView, now: float, out: Out) -> None:
    """Held: nothing new starts. A successor starting beside the serving generation is stopped
    (the serving one keeps serving), a recycle waiting for its turn is dropped, a replica backing
    off stays down; a stop under way ends in HELD (`_after_stop`). No generation stops at its
    count limit while held: no recycle can follow."""
    st = v.machine.state
    out.add(EnforceLimits(False))
    if st in RECYCLING_STATES or st is S.STANDBY:
        if v.successor is not None:
            out.add(Abandon(f"held ({v.facts.hold})"))
        if st is S.UNREADY:
            out.add(Leaving(False))
        out.to(S.SERVING, now, recycle=None, wanted=None, deferred=None)
    elif st is S.BACKOFF:
        out.to(S.HELD, now)
    out.add(Reply(True, "held"))


def release_cmd(v: ReplicaView, now: float, out: Out) -> None:
    out.add(EnforceLimits(True))
    if not v.facts.stopping:
        out.add(RejectRequests(None))
    if v.machine.state is S.HELD and not v.facts.stopping:
        start_cold(v, now, out, None)
        out.add(Reply(True, "starting"))
    else:
        out.add(Reply(True, "released"))


def stop_cmd(v: ReplicaView, cmd: StopCmd, now: float, out: Out) -> None:
    """SIGTERM/SIGINT: requests are refused from now on; drain and stop; a second signal
    shortens the ladder."""
    st, cur, s = v.machine.state, v.current, v.facts.cfg.server
    if cmd.hand_over and not cmd.second and st in SERVING_STATES and cur is not None:
        # a hand-over: no request is refused (new connections wait for the next runtime), the
        # serving generation finishes its requests and stays up; a successor or standby goes
        if v.successor is not None:
            out.add(Abandon("the runtime hands over to the next one"))
        if st is S.UNREADY:
            out.add(Leaving(False))
        out.set(wanted=None, deferred=None, recycle=None, end_reason=("handed_over", EndClass.SCHEDULED))
        out.to(S.HANDING_OVER, now, s.drain_timeout)
        return
    out.add(RejectRequests("vllm-guard is shutting down"))
    if v.successor is not None and st is not S.FAILING:
        out.add(Abandon("the runtime is shutting down"))
    out.set(wanted=None, deferred=None)
    if st in (S.BACKOFF, S.HELD, S.OPENING_GATE):
        out.to(S.EXITING, now, recycle=None)
    elif st in SERVING_STATES and cur is not None:
        if st is S.UNREADY:
            out.add(Leaving(False))
        out.set(end_reason=("shutdown", EndClass.SCHEDULED), recycle=None)
        drain_current(v, now, out)
    elif st in BOOTING_STATES and cur is not None:
        # nothing was served: no request to drain; SIGKILL (a loading vLLM ignores SIGTERM until it is up)
        out.add(Stop(cur.number, kill=True, deadline=now + KILL_WAIT_S, reason="shutdown", cls=EndClass.SCHEDULED))
        out.to(S.STOPPING, now, stop_span(v, kill=True), recycle=None)
    elif st is S.HANDING_OVER and cur is not None:  # a second signal: a plain stop after all
        out.add(Stop(cur.number, kill=False, deadline=now + s.stop_timeout, reason="shutdown", cls=EndClass.SCHEDULED))
        out.to(S.STOPPING, now, stop_span(v, kill=False))
    elif cmd.second and st is S.DRAINING and cur is not None:
        out.add(Stop(cur.number, kill=False, deadline=now + s.stop_timeout))
        out.to(S.STOPPING, now, stop_span(v, kill=False))
    elif cmd.second and st is S.STOPPING and cur is not None:
        out.add(Stop(cur.number, kill=True, deadline=now + KILL_WAIT_S))
        out.to(S.STOPPING, now, stop_span(v, kill=True))


