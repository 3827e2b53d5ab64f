"""The soak: send on schedule, stream results to the ledger, resume after a kill.

Two loops. Open loop (`--rate R`): request i is sent at its seeded run-time offset whether or
not earlier ones have finished (a concurrency cap, when set, delays sends and the delay counts
in the scheduled latencies). Closed loop (no rate): `concurrency` requests in flight, the next
sent as soon as one ends; its scheduled time is the moment its slot freed, so nothing is
charged to the client's own waiting. Both end when the run time reaches `duration_s`: no new
request is sent after it, those in flight finish.

Run time: the schedule's clock counts only while a soak process runs. A segment starts at the
first request without a result; requests the journal shows as sent but the ledger lacks were
in flight when the previous process died and are recorded as `lost_in_flight`, never re-sent,
so every request id reaches the server at most once and every scheduled index ends with one row.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import signal
import time
import uuid
from typing import Any

import aiohttp

from vllm_guard.core import stream as client
from vllm_guard.core.latency import Histogram

from .arrivals import Schedule, prompt_ids
from .params import SoakParams
from .live import Live
from .progress import Progress
from .sampler import StatusSampler
from .store import RequestRow, SoakStore


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str) -> Any:
    """Only with `--tokenizer` (text prompts): transformers is imported then, never otherwise."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def text_prompt(tok: Any, ids: list[int], tries: int = 10) -> str:
    """Text that the tokenizer turns back into len(ids) tokens: decoded ids rarely re-encode to
    the same count (byte pieces merge or split), so re-encode, cut or pad, decode again, as
    `vllm bench serve`'s random dataset does."""
    n, cur = len(ids), list(ids)
    text = tok.decode(cur)
    for _ in range(tries):
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc) == n:
            break
        cur = enc[:n] if len(enc) > n else enc + ids[: n - len(enc)]
        text = tok.decode(cur)
    return text


class Soak:
    def __init__(self, store: SoakStore, run_id: int, token: str, params: SoakParams,
                 progress: bool = True) -> None:
        self.store, self.run_id, self.token, self.p = store, run_id, token, params
        self.sched = Schedule(params.rate, params.burstiness, params.seed, params.mode,
                              params.burst_period_s, params.burst_duty, params.span_requests)
        self.live = Live()
        self.stop = asyncio.Event()
        self.show_progress = progress
        self.segment = 0
        self.sampler: StatusSampler | None = None
        self.behind = 0  # open loop: scheduled before the end but never sent (the cap held them)

    def _body(self, seq: int) -> dict[str, Any]:
        prompt: list[int] | str
        if self.p.tokenizer:  # ids from the whole vocabulary: word pieces, not byte tokens
            tok = load_tokenizer(self.p.tokenizer)
            prompt = text_prompt(tok, prompt_ids(self.p.seed, seq, self.p.prompt_tokens, high=len(tok)))
        else:
            prompt = prompt_ids(self.p.seed, seq, self.p.prompt_tokens)
        return {"model": self.p.model, "prompt": prompt,
                "max_tokens": self.p.output_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0, "stream_options": {"include_usage": True}}

    def _recover(self) -> tuple[int, set[int]]:
        """Record journal-sent requests that have no row as lost; return what to skip."""
        first, above = self.store.progress(self.run_id)
        lost: dict[int, tuple[str, float]] = {}
        for seq, rid, sent_at in self.store.read_journal(self.token):
            if seq >= first and seq not in above:
                lost.setdefault(seq, (rid, sent_at))
        prev = self.store.last_segment(self.run_id)
        for seq, (rid, sent_at) in lost.items():
            self.store.put_request(RequestRow(run_id=self.run_id, seq=seq, request_id=rid, sent_at=sent_at,
                                              segment=prev, error=client.LOST,
                                              detail="soak process died with this request in flight"))
        self.store.flush()
        return self.store.progress(self.run_id)

    async def _slot(self, sem: asyncio.Semaphore | None, deadline: float) -> bool:
        """A free slot under the concurrency cap, or False when the run time is up or the soak
        was told to stop first."""
        if sem is None or not sem.locked():
            if sem is not None:
                await sem.acquire()
            return True
        acquire = asyncio.ensure_future(sem.acquire())
        stop = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({acquire, stop}, timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not acquire.done():
            acquire.cancel()
        got = (await asyncio.gather(acquire, return_exceptions=True))[0] is True
        if got and self.stop.is_set():
            sem.release()
            return False
        return got

    async def run(self) -> str:
        first, skip = self._recover()
        duration, limit = self.p.duration_s, self.p.max_requests
        closed = self.p.closed_loop
        offsets = self.sched.offsets(first)
        # Run time already used: open loop, the offset of the first request to send; closed loop
        # (every offset is 0), the latest send offset a previous segment recorded.
        offset0 = self.store.run_time_used(self.run_id) if closed else next(self.sched.offsets(first))[1]
        mono0, wall0 = time.monotonic(), time.time()
        deadline = mono0 + (duration - offset0)  # run time reaches `duration` here
        self.segment = self.store.start_segment(self.run_id, wall0, offset0, first)
        self.store.open_journal(self.token)
        cap = self.p.concurrency
        sem = asyncio.Semaphore(cap) if cap else None
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        bg: list[asyncio.Task[Any]] = []
        if self.p.state_dir:
            self.sampler = StatusSampler(self.p.state_dir, self.run_id, self.store.put_samples,
                                         self.p.sample_interval_s, self.store.put_status)
            bg.append(asyncio.create_task(self.sampler.run()))
        prog = Progress(self.live, duration, offset0, mono0, enabled=self.show_progress)
        bg.append(asyncio.create_task(prog.run()))
        status = "done"
        async with aiohttp.ClientSession(connector=conn, auto_decompress=False) as session:
            for seq, off in offsets:
                if (limit is not None and seq >= limit) or (closed and time.monotonic() >= deadline):
                    break
                if seq in skip:
                    continue
                if not closed:
                    if off >= duration:
                        break
                    target = mono0 + (off - offset0)
                    delay = target - time.monotonic()
                    if delay > 0.05:  # long gaps: wake early on SIGINT/SIGTERM
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self.stop.wait(), delay)
                    elif delay > 0.0002:
                        await asyncio.sleep(delay)
                if self.stop.is_set():
                    status = "interrupted"
                    break
                if not await self._slot(sem, deadline):
                    if self.stop.is_set():
                        status = "interrupted"
                    elif not closed:  # the cap held requests back until the run time was up
                        self.behind = self.sched.count_within(duration) - seq
                    break
                if closed:  # scheduled = the moment the slot freed: the run time at this send
                    target = time.monotonic()
                    off = offset0 + (target - mono0)
                task = asyncio.create_task(self._one(session, seq, off, target, mono0, wall0, offset0, sem))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                done_wait = asyncio.gather(*tasks, return_exceptions=True)
                grace = 10.0 if self.stop.is_set() else self.p.timeout_s + 5
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(done_wait), grace)
                for t in list(tasks):
                    t.cancel()
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        prog.final()
        self.store.end_run(self.run_id, self.segment, status)
        return status

    async def _one(self, session: aiohttp.ClientSession, seq: int, off: float, target: float,
                   mono0: float, wall0: float, offset0: float, sem: asyncio.Semaphore | None) -> None:
        rid = f"soak-{self.token[:12]}-{seq}"
        try:
            sent_wall = wall0 + (time.monotonic() - mono0)
            self.store.journal_sent(seq, rid, sent_wall)
            self.live.sent += 1
            res, t_send = await client.stream_completion(session, self.p.url, self._body(seq), rid,
                                                         self.p.timeout_s)
        finally:
            if sem is not None:
                sem.release()
        lag = t_send - target
        e2e_sched = (res.e2e_s or 0.0) + lag
        self.live.add(res, lag, e2e_sched)
        ttft_sched = None if res.ttft_s is None else res.ttft_s + lag
        self.store.put_request(RequestRow(
            run_id=self.run_id, seq=seq, request_id=rid, segment=self.segment, offset_s=off,
            scheduled_at=wall0 + (target - mono0), sent_at=wall0 + (t_send - mono0),
            ended_at=wall0 + (t_send + (res.e2e_s or 0.0) - mono0), status=res.status,
            ttft_s=res.ttft_s, ttft_sched_s=ttft_sched, e2e_s=res.e2e_s, e2e_sched_s=e2e_sched,
            itl_mean_s=res.itl_mean_s, itl_max_s=res.itl_max_s, chunks=res.chunks,
            prompt_tokens=res.prompt_tokens, output_tokens=res.output_tokens,
            generation=res.generation, error=res.error, detail=res.detail,
        ))


def new_token() -> str:
    return uuid.uuid4().hex


def summary(s: Soak, status: str) -> dict[str, Any]:
    """End-of-run figures (the benchmark reads these)."""
    L, sm = s.live, s.sampler

    def q(h: Histogram, f: float) -> float | None:
        v = h.quantile(f)
        return None if v is None else round(v, 6)

    return {
        "run_id": s.run_id, "status": status, "loop": "closed" if s.p.closed_loop else "open",
        "concurrency": s.p.concurrency, "sent": L.sent, "not_sent_behind_schedule": s.behind, "finished": L.done, "failed": L.failed,
        "errors": dict(L.errors), "output_tokens": L.output_tokens,
        "ttft_p50_s": q(L.ttft, 0.5), "ttft_p99_s": q(L.ttft, 0.99),
        "e2e_sched_p50_s": q(L.e2e_sched, 0.5), "e2e_sched_p99_s": q(L.e2e_sched, 0.99),
        "lag_p50_s": q(L.lag, 0.5), "lag_p99_s": q(L.lag, 0.99), "lag_max_s": q(L.lag, 1.0),
        "ledger_commits": s.store.commits, "ledger_rows": s.store.rows,
        "rate": None if math.isinf(s.p.rate) else s.p.rate,
        # with --state-dir: memory readings stored, polls without a status, polls whose status
        # did not match this soak's schema (then no memory samples: see the warning)
        "memory_samples": sm.samples if sm else None, "status_errors": sm.errors if sm else None,
        "status_protocol_errors": sm.protocol_errors if sm else None,
    }
