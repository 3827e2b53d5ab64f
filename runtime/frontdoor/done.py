"""What the proxy knows of a request once it has ended: one typed record per request, and the
counters derived from those records.

The proxy emits exactly one `RequestDone` per request it received, when its handler ends,
whatever the path (answered, refused, failed, the client gone). Everything that accounts for
requests reads these records instead of hooking into the proxy's paths: the ledger's request
rows and latency histograms, the runtime's Prometheus histograms, the outcome counters
(`Counters.add`, the one place where an outcome is counted). A listener runs on the event loop
and must not block (queue the work; the ledger has a writer thread).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Callable, TypeAlias, Union

from vllm_guard.core.protocol import FailReason, RejectReason

USAGE_TAIL = 1024  # bytes of a response's end kept to find vLLM's usage record (it comes last)
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


class Outcome(str, enum.Enum):
    """Exactly one per request."""

    COMPLETED = "completed"  # answered in full by vLLM
    REJECTED = "rejected"  # refused (a client error, a bound, held, shutting down): the service did not fail
    FAILED = "failed"  # the service failed it (backend error after retries, a stall past the queue's wait)
    CLIENT_DISCONNECTED = "client_disconnected"  # the client left before the end


Cause: TypeAlias = Union[RejectReason, FailReason]
# refused at the front door (route, body, admission): they never reached the dispatch path
FRONT_DOOR = frozenset({
    RejectReason.NOT_SERVED, RejectReason.BODY_TOO_LARGE, RejectReason.BODY_STALLED, RejectReason.BODY_BUFFER_FULL,
    RejectReason.BAD_REQUEST, RejectReason.N_TOO_LARGE, RejectReason.MAX_TOKENS_TOO_LARGE,
    RejectReason.REQUEST_TOKENS_TOO_LARGE, RejectReason.CLIENT_REQUESTS, RejectReason.CLIENT_TOKENS,
})


@dataclass(frozen=True)
class RequestDone:
    request_id: str
    counted: bool  # an engine request (completions, chat, ...): the ones that count toward limits
    outcome: Outcome
    status: int  # the HTTP status the client got (0: none was sent)
    reason: str  # why it was rejected or failed ("" when completed)
    arrived: float  # wall-clock seconds (epoch) when the proxy received it
    e2e_s: float  # arrival -> end
    ttft_s: float | None = None  # arrival -> its first body bytes sent to the client
    generation: int | None = None  # the generation that answered (the last one, if resumed)
    replica: int | None = None
    chunks: int = 0  # body chunks sent to the client
    max_gap_s: float | None = None  # the longest pause between two chunks sent to the client
    stream: bool = False  # answered as server-sent events
    prompt_tokens: int | None = None  # from vLLM's usage record, when it sent one
    completion_tokens: int | None = None
    resumed: int = 0  # times it went on at another generation after its backend died
    cause: Cause | None = None  # the reason's kind, for counting (rejected and failed requests)


Listener = Callable[[RequestDone], None]


@dataclass
class Counters:
    """The proxy's request counters. Outcomes are counted from `RequestDone` records only (`add`);
    the rest are events on the way (received, retried, a connection lost, the queue's peak)."""

    requests_total: int = 0  # engine requests received (the only ones that can count)
    completed: int = 0
    failed_requests: int = 0
    rejected: int = 0
    client_disconnects: int = 0
    rejected_by: dict[RejectReason, int] = field(default_factory=dict)
    failed_by: dict[FailReason, int] = field(default_factory=dict)
    retried: int = 0  # re-sent whole after a backend failed before answering (each time)
    resumed: int = 0  # streams that went on at another generation after their backend died (once each)
    resumes: int = 0  # continuations sent (after a death or a hand-over)
    handed_over: int = 0  # streams an overlap's switch moved on to the new generation (once each)
    unresumable: int = 0  # streams cut by a dead backend that could not go on (a subset of failed)
    not_forwarded: int = 0  # refused at the front door (not in the API, body, admission), counted or not
    connections_lost: int = 0  # requests whose client connection went away mid-request, counted or not
    max_queued: int = 0  # high-water mark, reset by the supervisor at each recycle

    def client_lost(self) -> None:
        """A request's client connection went away (counted once per request)."""
        self.connections_lost += 1

    def add(self, r: RequestDone) -> None:
        """Count one ended request (the proxy calls this once per request)."""
        if r.cause in FRONT_DOOR:
            self.not_forwarded += 1
        if not r.counted:
            return
        if r.outcome is Outcome.COMPLETED:
            self.completed += 1
        elif r.outcome is Outcome.REJECTED:
            self.rejected += 1
            if isinstance(r.cause, RejectReason):
                self.rejected_by[r.cause] = self.rejected_by.get(r.cause, 0) + 1
        elif r.outcome is Outcome.FAILED:
            self.failed_requests += 1
            if isinstance(r.cause, FailReason):
                self.failed_by[r.cause] = self.failed_by.get(r.cause, 0) + 1
        else:
            self.client_disconnects += 1


def usage_of(tail: bytes) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of the last `"usage"` record in a response's tail: the JSON
    body's, or a stream's final usage chunk (`stream_options.include_usage`); Nones without one."""
    i = tail.rfind(b'"usage"')
    if i < 0:
        return None, None
    seg = tail[i:]
    p, c = _PROMPT.search(seg), _COMPLETION.search(seg)
    return (int(p.group(1)) if p else None), (int(c.group(1)) if c else None)
