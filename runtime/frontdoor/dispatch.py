"""Where a request goes, and what happens when its generation fails it: one loop, read here.

    take a target (router, through the wait queue) → try there (upstream) → answered: done;
    else policy.decide(what happened) → RETRY / RESUME: move on, back to the top;
    FAIL: the error it ends with; END: the client left.

A request whose backend dies under it moves to another generation, up to the policy's
`num_retries` (`[server] migration_limit`) times: one that got no byte yet is sent again whole;
a stream of completions or chat that the proxy follows goes on from its last token as a
continuation (`resume`, `stitch`); the others end with one error. A move never goes back to a
generation that failed it with a dead engine, and never waits behind newly arrived requests
(`waiting`). The rules are `policy`'s; this module carries them out and keeps the books
(counters, log lines, the access line of the try that ended the request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import structlog
from aiohttp import web

from vllm_guard.core import sse
from vllm_guard.core.config import ServerConfig

from . import resume
from .answers import answer, backend_error_event, error_event
from .detok import BackendFacts
from .done import Counters
from .flight import Flight, client_gone
from .policy import NO_TARGET, Action, Failure, RetryPolicy, Step, Try, decide
from .router import Move
from .stitch import Stream
from .target import Target, Ticket
from .upstream import CLIENT_GONE, Answer, Answered, Broke, Upstream, count_tokens
from .waiting import NoTarget, WaitQueue

log = structlog.get_logger("vllm_guard.proxy")

MOVES = (Action.RETRY, Action.RESUME)


@dataclass(eq=False)
class Course:
    """One request's way across generations: what its client has, where it may go next."""

    stream: Stream | None  # a stream the proxy may follow event by event (resumable)
    deadline: float  # monotonic: the wait for a target ends here
    move: Move | None = None  # set once it moved: the generations it avoids
    resp: web.StreamResponse | None = None  # the client's response, once its headers went out
    followed: bool = False  # that response carries a stream the proxy follows (it may go on elsewhere)

    def answered(self, resp: web.StreamResponse | None, followed: bool) -> None:
        if self.resp is None and resp is not None:
            self.resp, self.followed = resp, followed

    def moving(self, deadline: float) -> Move:
        """It moves on: a fresh wait for a target, with the generations it avoids."""
        self.deadline = deadline
        if self.move is None:
            self.move = Move()
        return self.move


class Dispatch:
    def __init__(self, cfg: ServerConfig, policy: RetryPolicy, queue: WaitQueue, upstream: Upstream,
                 counters: Counters, on_error: Callable[[Target], None]) -> None:
        self.cfg = cfg
        self.policy = policy
        self.queue = queue
        self.upstream = upstream
        self.counters = counters
        self.on_error = on_error  # a generation failed a request: the supervisor hears of it

    async def run(self, request: web.Request, body: bytes, f: Flight, facts: BackendFacts,
                  tokenizer: Any) -> web.StreamResponse:
        """Send the request to a backend, and on as `policy.decide` says when one fails it."""
        planned = resume.plan(request.path, body, facts, tokenizer is not None) \
            if f.counted and request.method == "POST" else None
        stream: Stream | None = None
        if isinstance(planned, resume.Plan):
            stream, body = Stream(planned, tokenizer), planned.body
        elif isinstance(planned, str):
            f.not_resumable(planned)
        course = Course(stream, deadline=f.t0 + self.cfg.queue_max_wait)
        while True:
            ticket = await self.queue.take(f, course.deadline, course.move)
            if isinstance(ticket, NoTarget):
                step = decide(self.policy, self._what(course, f, ticket.failure, ticket.message, None))
                return await self._end(step, course, f, None, ticket.message, None, ticket.failure)
            t = ticket.target
            try:
                tried = await self._try(request, ticket, body, f, course)
                if isinstance(tried, Answered):
                    self._access(f, tried.answer, tried.outcome)
                    return tried.resp
                course.answered(tried.resp, tried.followed)
                step = decide(self.policy, self._what(course, f, tried.failure, tried.detail, t))
                if step.uncount:
                    await self.queue.uncount(ticket)
                if step.blame:
                    self.on_error(t)
                if step.action in MOVES:
                    self._move(step, course, f, t, tried.detail, tried.failure)
                    continue
                return await self._end(step, course, f, t, tried.detail, tried.answer, tried.failure)
            finally:
                self.queue.release(ticket)

    async def _try(self, request: web.Request, ticket: Ticket, body: bytes, f: Flight,
                   course: Course) -> Answered | Broke:
        """The request whole while nothing reached its client; after that, its continuation."""
        if course.resp is None:
            return await self.upstream.whole(request, ticket, body, f, course.stream)
        assert course.stream is not None
        return await self.upstream.continuation(course.resp, ticket, course.stream, f, request.headers)

    def _what(self, course: Course, f: Flight, failure: Failure, detail: str, t: Target | None) -> Try:
        """What happened, as the policy reads it. Whether a followed stream can go on is asked
        only when the policy may resume it (the question may replay its detokenization)."""
        why_not = f.unresumable
        if course.followed and (failure in self.policy.resume_on or failure is Failure.HANDED):
            assert course.stream is not None
            why_not = course.stream.resumable()
        return Try(failure, sent=course.resp is not None, followed=course.followed, why_not=why_not, moves=f.moves,
                   generation=t.generation if t is not None else None, detail=detail)

    def _move(self, step: Step, course: Course, f: Flight, t: Target, detail: str, failure: Failure) -> None:
        """RETRY or RESUME: on to another generation, avoiding this one as the step says."""
        now = time.monotonic()
        course.moving(now + self.policy.move_wait_s).failed_at(t, step.never_again, now + step.hold_off_s)
        if step.seam:
            assert course.stream is not None
            course.stream.seam()
        first_resume = f.moved(resumed=step.seam)
        if step.action is Action.RETRY:
            self.counters.retried += 1
        if step.seam:
            assert course.stream is not None
            if failure is Failure.HANDED:
                self.counters.handed_over += 1
            elif first_resume:
                self.counters.resumed += 1
            log.info("request_resuming", request_id=f.rid, generation=t.generation, move=f.moves,
                     generated=len(course.stream.gen), error=detail)
        else:
            log.info("request_retry", request_id=f.rid, generation=t.generation, move=f.moves, error=detail,
                     continuation=step.action is Action.RESUME)

    async def _end(self, step: Step, course: Course, f: Flight, t: Target | None, detail: str,
                   tried: Answer | None, failure: Failure) -> web.StreamResponse:
        """FAIL or END: the request ends here."""
        generation = t.generation if t is not None else None
        if step.action is Action.END:
            client_gone(f, self.counters, generation)
        elif step.status:  # nothing reached the client: the proxy answers
            assert step.outcome is not None and step.cause is not None
            f.end(step.outcome, step.status, step.reason, step.cause)
            if failure in NO_TARGET:
                log.warning("request_rejected", request_id=f.rid, reason=step.reason, cause=step.cause.value)
            else:
                log.warning("request_failed", request_id=f.rid, generation=generation, moves=f.moves, error=detail)
            return answer(f.rid, step.status, step.message, step.cause.value,
                          retry_after=self.cfg.retry_after if step.retry_after else None)
        else:
            await self._fail_in_stream(step, course, f, generation, detail)
        if tried is not None:
            self._access(f, tried, "client_gone" if f.gone else "failed")
        assert course.resp is not None
        return course.resp

    async def _fail_in_stream(self, step: Step, course: Course, f: Flight, generation: int | None,
                              detail: str) -> None:
        """The client already reads the answer: one error event, then [DONE]."""
        resp = course.resp
        assert resp is not None and step.outcome is not None and step.cause is not None
        if step.cut:
            self.counters.unresumable += 1
        f.end(step.outcome, resp.status, step.reason, step.cause)
        log.warning("request_failed", request_id=f.rid, generation=generation, streaming=True, moves=f.moves,
                    error=detail, reason=step.message)
        if course.followed:
            assert course.stream is not None
            count_tokens(course.stream, f)
            event = error_event(step.message)
        elif f.stream:
            event = backend_error_event(step.message, step.cause.value)
        else:
            return  # not an event stream: the body just ends
        try:
            await resp.write(event + sse.DONE)
            await resp.write_eof()
        except CLIENT_GONE:
            client_gone(f, self.counters, generation)

    def _access(self, f: Flight, a: Answer, outcome: str) -> None:
        """The access line of the try that ended the request (`[server] access_log`)."""
        if not self.cfg.access_log:
            return
        e2e_ms = round((time.monotonic() - f.t0) * 1000, 2)
        if a.continuation:
            log.info("request", request_id=f.rid, generation=a.generation, method=a.method, path=a.path,
                     status=a.status, outcome=outcome, resumed=f.resumed, e2e_ms=e2e_ms)
        else:
            log.info("request", request_id=f.rid, generation=a.generation, method=a.method, path=a.path,
                     status=a.status, outcome=outcome, ttft_ms=a.ttft_ms, e2e_ms=e2e_ms)
