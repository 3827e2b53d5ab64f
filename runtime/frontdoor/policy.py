"""What happens to a request when its try fails: the retry and migration policy, as data.

Like envoy's route `retry_policy`, the policy is a value (`RetryPolicy`): which failures send a
request again (`retry_on`), which let a stream go on from its last token (`resume_on`), how
often a request may move (`num_retries`), how long one try may run (`per_try_timeout_s`) and
how a move backs off (`hold_off_s`, `move_wait_s`). `decide` is the one place that reads it:
given what happened to a try (`Try`), it returns the next step (`Step`). The proxy does the
socket work and carries the step out; nothing else decides whether a request moves.

The failures (`Failure`), and the sets that name their kinds once:

- before the try's answer (`BEFORE_ANSWER`): the connection was refused, dropped (or timed out)
  before any byte, the answer said the engine is dead, a stream ended before its first event, or
  (only when `retry_on` names it) an HTTP 5xx. Nothing of this try reached the client and the
  engine never took it: its count is undone and the generation hears of it (the router passes it
  over for a moment). With nothing sent yet the request is sent again whole (`RETRY`); when its
  stream had already reached the client, the continuation is sent again (`RESUME`, no new seam);
- mid-stream (`MID_STREAM`): the backend died under a stream that had reached the client, or the
  stream ran past `per_try_timeout_s`, or its generation handed it over at an overlap's switch
  (`HANDED`: cut on purpose, so that one generation computes; it resumes whatever its moves
  before, and blames nobody). A stream the proxy follows goes on elsewhere (`RESUME`)
  when the failure is in `resume_on` and the stream can be resumed; else, and for streams it only
  passes through, the client gets one error event and `[DONE]`;
- a continuation that cannot be sent (`NO_ROOM`: no tokens left) or that the next generation
  declines (`DECLINED`): the stream ends with one error event;
- no generation took the request (`NO_TARGET`): held or shutting down, the queue full, or its
  wait over. 503 with Retry-After when nothing was sent yet, else one error event;
- the client left (`CLIENT_GONE`): nothing more is sent (`END`).

A generation that refused the connection, answered "engine dead" or died under a stream is never
tried again for that request (`NEVER_AGAIN`); one that failed otherwise is passed over for
`hold_off_s` (even when it is the only one), then may be tried again if it is still open.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import FailReason, RejectReason

from .done import Cause, Outcome


class Failure(str, enum.Enum):
    """What happened to one try of a request."""

    REFUSED = "refused"  # the connection was refused: nothing listens there any more
    DROPPED = "dropped"  # the connection failed, dropped or timed out before the answer's first byte
    ENGINE_DEAD = "engine_dead"  # the answer said that the engine is dead
    EMPTY = "empty"  # a stream that ended before its first event
    HTTP_5XX = "http_5xx"  # an HTTP 5xx from a live engine: a failure only when `retry_on` names it
    DIED = "died"  # the backend died under a stream that had reached the client
    HANDED = "handed"  # its generation handed it to the next one at an overlap's switch (no failure)
    TIMEOUT = "timeout"  # a stream ran past per_try_timeout_s after it had reached the client
    NO_ROOM = "no_room"  # a continuation with no tokens left to generate
    DECLINED = "declined"  # the next generation answered a continuation with an error
    UNAVAILABLE = "unavailable"  # no generation: the runtime is held or shutting down
    QUEUE_FULL = "queue_full"  # no generation, and the queue is full
    QUEUE_TIMEOUT = "queue_timeout"  # no generation within the wait
    CLIENT_GONE = "client_gone"  # the client left


BEFORE_ANSWER = frozenset({Failure.REFUSED, Failure.DROPPED, Failure.ENGINE_DEAD, Failure.EMPTY, Failure.HTTP_5XX})
MID_STREAM = frozenset({Failure.DIED, Failure.TIMEOUT, Failure.HANDED})
CONTINUATION = frozenset({Failure.NO_ROOM, Failure.DECLINED})
NO_TARGET = frozenset({Failure.UNAVAILABLE, Failure.QUEUE_FULL, Failure.QUEUE_TIMEOUT})
NEVER_AGAIN = frozenset({Failure.REFUSED, Failure.ENGINE_DEAD, Failure.DIED, Failure.HANDED})

# what a request no generation took is counted as (held or shutting down is the operator's
# choice: rejected; a full queue or its wait is the service failing it)
_NO_TARGET_CAUSE: dict[Failure, Cause] = {
    Failure.UNAVAILABLE: RejectReason.UNAVAILABLE,
    Failure.QUEUE_FULL: FailReason.QUEUE_FULL,
    Failure.QUEUE_TIMEOUT: FailReason.QUEUE_TIMEOUT,
}
RETRY_HOLDOFF_S = 5.0  # a generation that dropped a request is not tried again for it before this


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures move a request, how often, and how it waits; read by `decide` only."""

    retry_on: frozenset[Failure] = frozenset({Failure.REFUSED, Failure.DROPPED, Failure.ENGINE_DEAD, Failure.EMPTY})
    resume_on: frozenset[Failure] = frozenset({Failure.DIED})
    num_retries: int = 3  # moves per request, re-sends and continuations together ([server] migration_limit)
    per_try_timeout_s: float = 3600.0  # one try, from sending to the answer's end ([server] request_timeout)
    move_wait_s: float = 900.0  # a move waits this long for a generation, from the failure ([server] queue_max_wait)
    hold_off_s: float = RETRY_HOLDOFF_S

    def __post_init__(self) -> None:
        if not self.retry_on <= BEFORE_ANSWER:
            raise ValueError(f"retry_on has {sorted(f.value for f in self.retry_on - BEFORE_ANSWER)}: "
                             f"only failures before an answer can be retried")
        if not self.resume_on <= MID_STREAM:
            raise ValueError(f"resume_on has {sorted(f.value for f in self.resume_on - MID_STREAM)}: "
                             f"only failures mid-stream can be resumed")
        if self.num_retries < 0:
            raise ValueError(f"num_retries has value {self.num_retries}: not a count (0 or more)")
        for key in ("per_try_timeout_s", "move_wait_s", "hold_off_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0) or (key != "hold_off_s" and value == 0):
                raise ValueError(f"{key} has value {value}: not a duration")

    @classmethod
    def of(cls, cfg: ServerConfig) -> RetryPolicy:
        """The runtime's policy: its counts and times from `[server]`."""
        return cls(num_retries=cfg.migration_limit, per_try_timeout_s=float(cfg.request_timeout),
                   move_wait_s=float(cfg.queue_max_wait))


@dataclass(frozen=True)
class Try:
    """What happened to one try of a request, as `decide` needs it."""

    failure: Failure
    sent: bool = False  # the client has bytes of the answer already (of this try or an earlier one)
    followed: bool = False  # a stream the proxy follows event by event (it may go on elsewhere)
    why_not: str | None = None  # why the stream cannot go on elsewhere (None: it can, or it is no stream)
    moves: int = 0  # times the request moved before this failure
    generation: int | None = None  # the generation of the try (None: no generation took it)
    detail: str = ""  # what failed, in words (the exception, the status, the queue's message)


class Action(str, enum.Enum):
    RETRY = "retry"  # send the request again, whole, to another generation: nothing reached the client
    RESUME = "resume"  # go on at another generation with a continuation from the stream's last token
    FAIL = "fail"  # end it: an HTTP error when nothing reached the client, else one error event and [DONE]
    END = "end"  # the client left: nothing more to send


@dataclass(frozen=True)
class Step:
    """What the proxy does next with a request whose try failed."""

    action: Action
    blame: bool = False  # the generation failed the request: the supervisor hears of it
    uncount: bool = False  # the try never reached the engine: its count toward the limit is undone
    never_again: bool = False  # RETRY, RESUME: the failed generation is not tried again for this request
    hold_off_s: float = 0.0  # RETRY, RESUME otherwise: it is not tried again before this long
    seam: bool = False  # RESUME: the stream died, cut a new seam (else its continuation is sent again)
    status: int = 0  # FAIL: the HTTP status the proxy answers with; 0: an error event in the stream
    retry_after: bool = False  # FAIL with a status: the answer carries Retry-After
    outcome: Outcome | None = None  # FAIL: how the request is counted
    cause: Cause | None = None  # FAIL: why, as counted
    cut: bool = False  # FAIL in the stream: its backend cut it and it could not go on (counted unresumable)
    message: str = ""  # FAIL: what the client reads
    reason: str = ""  # FAIL: the request's record


def decide(p: RetryPolicy, t: Try) -> Step:
    """The next step for a request whose try ended in `t.failure` (the table in the docstring)."""
    f = t.failure
    if f is Failure.CLIENT_GONE:
        return Step(Action.END)
    if f in NO_TARGET:
        if t.sent:
            return _cut(t, f"it could not be resumed: {t.detail}", named=False)
        cause = _NO_TARGET_CAUSE[f]
        outcome = Outcome.REJECTED if isinstance(cause, RejectReason) else Outcome.FAILED
        return Step(Action.FAIL, status=503, retry_after=True, outcome=outcome, cause=cause, message=t.detail,
                    reason=t.detail)
    if f in BEFORE_ANSWER:
        if f in p.retry_on and t.moves < p.num_retries:
            return _move(p, Action.RESUME if t.sent else Action.RETRY, f, uncount=True)
        if t.sent:
            return _cut(t, f"its continuation failed too: {t.detail}", named=False, blame=True, uncount=True)
        return Step(Action.FAIL, blame=True, uncount=True, status=502, outcome=Outcome.FAILED,
                    cause=FailReason.BACKEND_ERROR,
                    message=f"the backend failed before answering, {t.moves + 1} times: {t.detail}",
                    reason=f"backend failed before answering: {t.detail}")
    if f is Failure.HANDED:
        # not a failure: the old generation cut the stream so that it goes on at the new one
        # (only streams that could were cut); no blame, whatever the moves before
        if t.followed and t.why_not is None:
            return Step(Action.RESUME, never_again=True, seam=True)
        return _cut(t, f"it could not be resumed: {t.why_not or 'not followed'}")
    if f in MID_STREAM:
        if not t.followed:
            return _broke(t)
        if f not in p.resume_on:
            if f is Failure.TIMEOUT:
                return _cut(t, "it ran past [server] request_timeout", cut=False)
            return _cut(t, f"it cannot be resumed: the retry policy does not resume after {f.value}", blame=True)
        why = t.why_not or (f"it moved {t.moves} times ([server] migration_limit)" if t.moves >= p.num_retries
                            else None)
        if why is not None:
            return _cut(t, f"it cannot be resumed: {why}", blame=True)
        return _move(p, Action.RESUME, f, seam=True)
    assert f in CONTINUATION, f
    return _cut(t, t.detail)


def _move(p: RetryPolicy, action: Action, f: Failure, uncount: bool = False, seam: bool = False) -> Step:
    """Another generation, never again the one that failed it this way, else after `hold_off_s`."""
    never = f in NEVER_AGAIN
    return Step(action, blame=True, uncount=uncount, never_again=never, hold_off_s=0.0 if never else p.hold_off_s,
                seam=seam)


def _cut(t: Try, why: str, named: bool = True, cut: bool = True, blame: bool = False,
         uncount: bool = False) -> Step:
    """A stream the proxy follows ends with one error event: `why` it could not go on. `named`:
    the message names the try's generation."""
    where = f" (generation {t.generation})" if named and t.generation else ""
    msg = f"the backend failed mid-stream{where} and {why}"
    return Step(Action.FAIL, blame=blame, uncount=uncount, outcome=Outcome.FAILED,
                cause=FailReason.UNRESUMABLE if cut else FailReason.BACKEND_BROKE, cut=cut, message=msg, reason=msg)


def _broke(t: Try) -> Step:
    """A stream the proxy passes through (it does not follow it) broke mid-way: it cannot move."""
    cut = t.why_not is not None
    why = f" (it could not be resumed: {t.why_not})" if cut else ""
    return Step(Action.FAIL, blame=True, outcome=Outcome.FAILED,
                cause=FailReason.UNRESUMABLE if cut else FailReason.BACKEND_BROKE, cut=cut,
                message=f"backend generation {t.generation} failed: {t.detail}{why}",
                reason=f"the backend broke mid-stream: {t.detail}")
