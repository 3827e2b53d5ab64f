"""The retry and migration decision without sockets: what the proxy does next when a try fails.

Each row is one situation (the failure, whether the client has bytes, whether the proxy follows
the stream, how often the request moved) and the step `decide` must take. The proxy tests
(tests/test_faults_proxy.py, tests/test_resume_proxy.py) check that the proxy carries them out on
real sockets; these run in milliseconds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import FailReason, RejectReason
from vllm_guard.runtime.frontdoor.done import Outcome
from vllm_guard.runtime.frontdoor.policy import (
    BEFORE_ANSWER, CONTINUATION, MID_STREAM, NEVER_AGAIN, NO_TARGET, RETRY_HOLDOFF_S, Action, Failure, RetryPolicy,
    Step, Try, decide,
)

F = Failure
P = RetryPolicy()  # the runtime's defaults: 3 moves
RETRY, RESUME, FAIL, END = Action.RETRY, Action.RESUME, Action.FAIL, Action.END
HOLD = RETRY_HOLDOFF_S

# (id, policy, try, expected fields of the step)
TABLE: list[tuple[str, RetryPolicy, Try, dict[str, Any]]] = [
    # -- nothing reached the client: the request is sent again whole -----------------------------
    ("refused before any byte", P, Try(F.REFUSED),
     dict(action=RETRY, never_again=True, hold_off_s=0.0, blame=True, uncount=True)),
    ("dropped before any byte", P, Try(F.DROPPED),
     dict(action=RETRY, never_again=False, hold_off_s=HOLD, blame=True, uncount=True)),
    ("engine dead before the first token", P, Try(F.ENGINE_DEAD),
     dict(action=RETRY, never_again=True, blame=True, uncount=True)),
    ("a stream that ended before its first event", P, Try(F.EMPTY),
     dict(action=RETRY, never_again=False, hold_off_s=HOLD)),
    ("the second of three moves", P, Try(F.DROPPED, moves=2), dict(action=RETRY)),
    ("past the limit: 502", P, Try(F.DROPPED, moves=3, detail="ServerDisconnectedError: x"),
     dict(action=FAIL, status=502, retry_after=False, outcome=Outcome.FAILED, cause=FailReason.BACKEND_ERROR,
          blame=True, uncount=True, message="the backend failed before answering, 4 times: ServerDisconnectedError: x",
          reason="backend failed before answering: ServerDisconnectedError: x")),
    ("limit 0: the first failure ends it", RetryPolicy(num_retries=0), Try(F.REFUSED),
     dict(action=FAIL, status=502, cause=FailReason.BACKEND_ERROR)),
    ("limit 1: one move", RetryPolicy(num_retries=1), Try(F.ENGINE_DEAD, moves=0), dict(action=RETRY)),
    ("limit 1: no second move", RetryPolicy(num_retries=1), Try(F.ENGINE_DEAD, moves=1),
     dict(action=FAIL, status=502, message="the backend failed before answering, 2 times: ")),
    ("a 5xx is vLLM's answer unless retry_on names it: not retried", P, Try(F.HTTP_5XX),
     dict(action=FAIL, status=502, cause=FailReason.BACKEND_ERROR)),
    ("a 5xx retried when retry_on names it", replace(P, retry_on=P.retry_on | {F.HTTP_5XX}), Try(F.HTTP_5XX),
     dict(action=RETRY, never_again=False, hold_off_s=HOLD, uncount=True)),
    ("a failure retry_on leaves out ends it", replace(P, retry_on=frozenset({F.REFUSED})), Try(F.DROPPED),
     dict(action=FAIL, status=502)),
    ("a followed stream that got no byte yet is sent again whole", P, Try(F.DROPPED, followed=True),
     dict(action=RETRY)),
    ("hold-off from the policy", replace(P, hold_off_s=0.5), Try(F.DROPPED), dict(hold_off_s=0.5)),
    # -- no generation took it ------------------------------------------------------------------
    ("held or shutting down: rejected 503", P, Try(F.UNAVAILABLE, detail="held: maintenance"),
     dict(action=FAIL, status=503, retry_after=True, outcome=Outcome.REJECTED, cause=RejectReason.UNAVAILABLE,
          message="held: maintenance", reason="held: maintenance", blame=False, uncount=False)),
    ("queue full: failed 503", P, Try(F.QUEUE_FULL, detail="queue full (4 waiting)"),
     dict(action=FAIL, status=503, retry_after=True, outcome=Outcome.FAILED, cause=FailReason.QUEUE_FULL)),
    ("queue wait over: failed 503", P, Try(F.QUEUE_TIMEOUT),
     dict(action=FAIL, status=503, outcome=Outcome.FAILED, cause=FailReason.QUEUE_TIMEOUT)),
    ("a moving stream no generation took: one error event", P,
     Try(F.QUEUE_TIMEOUT, sent=True, followed=True, generation=None, detail="no backend"),
     dict(action=FAIL, status=0, cut=True, cause=FailReason.UNRESUMABLE, outcome=Outcome.FAILED,
          message="the backend failed mid-stream and it could not be resumed: no backend")),
    ("held while a stream moves: one error event", P, Try(F.UNAVAILABLE, sent=True, followed=True, detail="held: x"),
     dict(action=FAIL, status=0, cut=True, cause=FailReason.UNRESUMABLE)),
    # -- the backend died under a followed stream: it goes on from its last token ---------------
    ("died mid-stream after some tokens: resumed", P, Try(F.DIED, sent=True, followed=True, generation=1),
     dict(action=RESUME, seam=True, never_again=True, blame=True, uncount=False)),
    ("died on its third move: resumed", P, Try(F.DIED, sent=True, followed=True, moves=2), dict(action=RESUME)),
    ("died past the limit: one error event naming it", P,
     Try(F.DIED, sent=True, followed=True, moves=3, generation=4),
     dict(action=FAIL, status=0, cut=True, blame=True, cause=FailReason.UNRESUMABLE,
          message="the backend failed mid-stream (generation 4) and it cannot be resumed: "
                  "it moved 3 times ([server] migration_limit)")),
    ("died and cannot be resumed: says why", P,
     Try(F.DIED, sent=True, followed=True, why_not="vLLM sent a chunk without token ids", generation=2),
     dict(action=FAIL, cut=True, blame=True, cause=FailReason.UNRESUMABLE,
          message="the backend failed mid-stream (generation 2) and it cannot be resumed: "
                  "vLLM sent a chunk without token ids")),
    ("why it cannot be resumed goes before the limit", P,
     Try(F.DIED, sent=True, followed=True, why_not="no chunk of the stream had come", moves=9),
     dict(action=FAIL, message="the backend failed mid-stream and it cannot be resumed: "
                               "no chunk of the stream had come")),
    ("resumption off: one error event", replace(P, resume_on=frozenset()), Try(F.DIED, sent=True, followed=True),
     dict(action=FAIL, cut=True, blame=True)),
    # -- an overlap's switch: the old generation hands its followed streams to the new one --------
    ("handed over at the switch: resumed, nobody blamed", P,
     Try(F.HANDED, sent=True, followed=True, generation=1),
     dict(action=RESUME, seam=True, never_again=True, blame=False, uncount=False)),
    ("handed over past the move limit: resumed all the same (not a failure)", P,
     Try(F.HANDED, sent=True, followed=True, moves=3), dict(action=RESUME, blame=False)),
    ("handed over though it cannot go on: one error event naming why", P,
     Try(F.HANDED, sent=True, followed=True, why_not="n > 1", generation=1),
     dict(action=FAIL, cut=True, blame=False, cause=FailReason.UNRESUMABLE,
          message="the backend failed mid-stream (generation 1) and it could not be resumed: n > 1")),
    # -- its continuation failed before its first byte: the continuation is sent again -----------
    ("continuation refused: sent again elsewhere", P, Try(F.REFUSED, sent=True, followed=True, moves=1),
     dict(action=RESUME, seam=False, never_again=True, blame=True, uncount=True)),
    ("continuation dropped: sent again after the hold-off", P, Try(F.DROPPED, sent=True, followed=True, moves=1),
     dict(action=RESUME, seam=False, never_again=False, hold_off_s=HOLD)),
    ("continuation failed past the limit", P,
     Try(F.ENGINE_DEAD, sent=True, followed=True, moves=3, generation=3, detail="engine dead (HTTP 500)"),
     dict(action=FAIL, status=0, cut=True, blame=True, uncount=True, cause=FailReason.UNRESUMABLE,
          message="the backend failed mid-stream and its continuation failed too: engine dead (HTTP 500)")),
    ("no tokens left for the continuation", P,
     Try(F.NO_ROOM, sent=True, followed=True, generation=2, detail="0 tokens were left to generate"),
     dict(action=FAIL, cut=True, blame=False, uncount=False, cause=FailReason.UNRESUMABLE,
          message="the backend failed mid-stream (generation 2) and 0 tokens were left to generate")),
    ("the next generation declines the continuation", P,
     Try(F.DECLINED, sent=True, followed=True, generation=2,
         detail="generation 2 refused its continuation (HTTP 400: x)"),
     dict(action=FAIL, cut=True, blame=False, cause=FailReason.UNRESUMABLE)),
    # -- a followed stream that ran past the per-try timeout: it ends, it does not move ----------
    ("timeout mid-stream: ends, not blamed, not counted unresumable", P,
     Try(F.TIMEOUT, sent=True, followed=True, generation=1),
     dict(action=FAIL, status=0, cut=False, blame=False, cause=FailReason.BACKEND_BROKE, outcome=Outcome.FAILED,
          message="the backend failed mid-stream (generation 1) and it ran past [server] request_timeout")),
    ("timeout resumed when resume_on names it", replace(P, resume_on=frozenset({F.DIED, F.TIMEOUT})),
     Try(F.TIMEOUT, sent=True, followed=True), dict(action=RESUME, seam=True, never_again=False, hold_off_s=HOLD)),
    # -- a stream the proxy passes through broke: it cannot move ---------------------------------
    ("pass-through broke: the backend's error, not counted unresumable", P,
     Try(F.DIED, sent=True, generation=3, detail="ClientPayloadError: x"),
     dict(action=FAIL, status=0, cut=False, blame=True, cause=FailReason.BACKEND_BROKE,
          message="backend generation 3 failed: ClientPayloadError: x",
          reason="the backend broke mid-stream: ClientPayloadError: x")),
    ("pass-through of a stream that could not be followed: unresumable", P,
     Try(F.DIED, sent=True, why_not="n > 1", generation=3, detail="e"),
     dict(action=FAIL, cut=True, cause=FailReason.UNRESUMABLE,
          message="backend generation 3 failed: e (it could not be resumed: n > 1)")),
    ("pass-through timed out: as broke", P, Try(F.TIMEOUT, sent=True, generation=1),
     dict(action=FAIL, blame=True, cause=FailReason.BACKEND_BROKE)),
    # -- the client left --------------------------------------------------------------------------
    ("client gone before any byte", P, Try(F.CLIENT_GONE), dict(action=END, blame=False, uncount=False)),
    ("client gone mid-stream", P, Try(F.CLIENT_GONE, sent=True, followed=True, moves=7), dict(action=END)),
]


@pytest.mark.parametrize("policy,what,want", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_the_decision_table(policy: RetryPolicy, what: Try, want: dict[str, Any]) -> None:
    step = decide(policy, what)
    got = {k: getattr(step, k) for k in want}
    assert got == want, step


@pytest.mark.parametrize("failure", list(Failure))
@pytest.mark.parametrize("sent", [False, True])
@pytest.mark.parametrize("followed", [False, True])
@pytest.mark.parametrize("moves", [0, 3])
def test_every_situation_has_one_consistent_step(failure: Failure, sent: bool, followed: bool, moves: int) -> None:
    """Total: every failure in every situation gives a step, and the step is coherent."""
    if (failure in MID_STREAM or failure in CONTINUATION) and not sent:
        return  # cannot happen: these fail a stream the client already reads
    step = decide(P, Try(failure, sent=sent, followed=followed, moves=moves, generation=1, detail="x"))
    if step.action is Action.RETRY:
        assert not sent, "a request whose client has bytes is never sent again whole"
    if failure is Failure.HANDED:  # not a failure: it moves whatever its moves, blaming nobody
        assert not step.blame and step.action is (Action.RESUME if followed else Action.FAIL)
    elif step.action in (Action.RETRY, Action.RESUME):
        assert moves < P.num_retries and step.blame
        assert step.never_again == (failure in NEVER_AGAIN) and (step.hold_off_s == 0) == step.never_again
    if step.action is Action.FAIL:
        assert step.outcome is not None and step.cause is not None and step.message and step.reason
        assert (step.status != 0) == (not sent), "an HTTP answer only while nothing was sent"
        assert step.retry_after == (step.status == 503)
    if step.cut:
        assert step.action is Action.FAIL and step.cause is FailReason.UNRESUMABLE
    assert step.uncount == (failure in BEFORE_ANSWER), "only a try that never reached its engine is uncounted"


def test_the_named_sets_cover_every_failure_once() -> None:
    kinds = [BEFORE_ANSWER, MID_STREAM, CONTINUATION, NO_TARGET, frozenset({Failure.CLIENT_GONE})]
    assert sum(len(k) for k in kinds) == len(Failure) and frozenset().union(*kinds) == set(Failure)


def test_the_runtime_policy_comes_from_its_config() -> None:
    p = RetryPolicy.of(ServerConfig(migration_limit=5, request_timeout=120.0, queue_max_wait=30.0))
    assert (p.num_retries, p.per_try_timeout_s, p.move_wait_s, p.hold_off_s) == (5, 120.0, 30.0, RETRY_HOLDOFF_S)
    assert p.retry_on == {F.REFUSED, F.DROPPED, F.ENGINE_DEAD, F.EMPTY} and p.resume_on == {F.DIED}


@pytest.mark.parametrize("bad,key", [
    (dict(retry_on=frozenset({F.DIED})), "retry_on"),
    (dict(resume_on=frozenset({F.REFUSED})), "resume_on"),
    (dict(num_retries=-1), "num_retries"),
    (dict(per_try_timeout_s=0.0), "per_try_timeout_s"),
    (dict(move_wait_s=float("nan")), "move_wait_s"),
    (dict(hold_off_s=-1.0), "hold_off_s"),
])
def test_a_policy_that_cannot_work_is_refused_naming_the_key(bad: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        RetryPolicy(**bad)


def test_a_step_is_a_value() -> None:
    a, b = decide(P, Try(F.DROPPED)), decide(P, Try(F.DROPPED))
    assert a == b and isinstance(a, Step) and hash(a) == hash(b)
