"""One request on its way through the proxy (`Flight`): what its logs, the disconnect accounting
and its one `RequestDone` record need. Every path that ends a request ends its flight; the
first one decides the outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from .done import Cause, Counters, Outcome, RequestDone

log = structlog.get_logger("vllm_guard.proxy")


@dataclass(eq=False)
class Flight:
    """One request through the proxy: what the logs, the disconnect accounting and its
    `RequestDone` record need."""

    rid: str
    t0: float
    counted: bool
    stage: str = "reading body"
    gone: bool = False  # the client left (counted once)
    arrived: float = field(default_factory=time.time)  # wall clock, for records
    outcome: Outcome | None = None  # set once, by the path that ends it
    status: int = 0
    reason: str = ""
    cause: Cause | None = None
    first_sent: float | None = None  # monotonic: its first body bytes went to the client
    last_sent: float | None = None
    max_gap_s: float | None = None
    chunks: int = 0
    stream: bool = False
    generation: int | None = None
    replica: int | None = None
    resumed: int = 0  # continuations: times it went on at another generation
    moves: int = 0  # re-dispatches after a backend failed it (retries and continuations)
    unresumable: str | None = None  # why its stream could not go on elsewhere (for the error)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def at(self, stage: str) -> None:
        self.stage = stage

    def count(self, counted: bool) -> None:
        self.counted = counted

    def leaves(self) -> bool:
        """The client left; True the first time (it is counted once)."""
        first, self.gone = not self.gone, True
        return first

    def tokens(self, prompt: int | None, completion: int | None) -> None:
        """vLLM's usage record of the answer, when it carried one."""
        self.prompt_tokens, self.completion_tokens = prompt, completion

    def answered_by(self, generation: int, replica: int, stream: bool) -> None:
        self.generation, self.replica, self.stream = generation, replica, stream

    def not_resumable(self, why: str) -> None:
        self.unresumable = why

    def moved(self, resumed: bool) -> bool:
        """It moves to another generation (a re-send, or a continuation when `resumed`); True
        the first time it is resumed (the streams resumed are counted once)."""
        self.moves += 1
        if resumed:
            self.resumed += 1
        return resumed and self.resumed == 1

    def end(self, outcome: Outcome, status: int, reason: str = "", cause: Cause | None = None) -> None:
        """The first path to end the request decides its outcome (and, rejected or failed, its cause)."""
        if self.outcome is None:
            self.outcome, self.status, self.reason, self.cause = outcome, status, reason, cause

    def sent(self, now: float) -> None:
        """A body chunk went to the client."""
        if self.first_sent is None:
            self.first_sent = now
        elif self.last_sent is not None:
            gap = now - self.last_sent
            self.max_gap_s = gap if self.max_gap_s is None else max(self.max_gap_s, gap)
        self.last_sent = now
        self.chunks += 1

    def record(self, now: float) -> RequestDone:
        return RequestDone(
            request_id=self.rid, counted=self.counted, outcome=self.outcome or Outcome.CLIENT_DISCONNECTED,
            status=self.status, reason=self.reason, arrived=self.arrived, e2e_s=now - self.t0,
            ttft_s=None if self.first_sent is None else self.first_sent - self.t0, generation=self.generation,
            replica=self.replica, chunks=self.chunks, max_gap_s=self.max_gap_s, stream=self.stream,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, resumed=self.resumed,
            cause=self.cause)


def client_gone(f: Flight, counters: Counters, generation: int | None = None, how: str = "") -> None:
    """The client went away: one log line per request, never a traceback."""
    f.end(Outcome.CLIENT_DISCONNECTED, f.status)
    if f.leaves():
        counters.client_lost()
        log.info("client_disconnected", request_id=f.rid, stage=f.stage, generation=generation,
                 **({"how": how} if how else {}))
