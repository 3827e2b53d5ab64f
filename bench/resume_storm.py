"""Long streams through a guard whose engine is killed under them: the scenario and its checks.

Shared by tests/test_resume_real.py (`make test`) and bench/bench_resume.py: N long streams
(completions and chat, half of them asking for token ids), EngineCore `kill -9`ed only once every
stream has at least `min_tokens` tokens and none has finished (asserted, counted from vLLM's
continuous usage: vLLM coalesces tokens into chunks), M more requests arriving during the
restart. Every stream is then checked whole: HTTP 200, one id, one [DONE], no error event, the
finish reason `length`, exactly the tokens asked for, and where the stream carried token ids
their count and the text they decode to (the embedded model's tokenizer, vLLM's incremental
detokenization) equal to what the client got: no byte twice, none missing.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp


@dataclass
class Stream:
    index: int
    chat: bool
    max_tokens: int
    ask_ids: bool
    status: int = 0
    tokens: int = 0  # vLLM's usage: completion tokens so far
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    dones: int = 0
    errors: list[str] = field(default_factory=list)
    text: str = ""
    ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    chunk_ids: set[str] = field(default_factory=set)
    generation: str | None = None
    sent: float = 0.0
    first: float | None = None
    ended: float = 0.0
    progress: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens) at each new token

    def max_gap(self, since: float | None = None) -> float:
        """The longest pause between two chunks that brought new tokens (after `since`)."""
        pts = [t for t, _ in self.progress if since is None or t >= since]
        return max((b - a for a, b in zip(pts, pts[1:])), default=0.0)

    def body(self, model: str) -> dict[str, Any]:
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                             "stream": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.ask_ids:
            b["return_token_ids"] = True
        if self.chat:
            b["messages"] = [{"role": "user", "content": f"tell me story number {self.index}"}]
        else:
            b["prompt"] = f"once upon a time {self.index}"
        return b


async def run_stream(session: aiohttp.ClientSession, url: str, model: str, s: Stream, timeout: float) -> Stream:
    path = "/v1/chat/completions" if s.chat else "/v1/completions"
    s.sent = time.monotonic()
    buf = b""
    try:
        async with session.post(url + path, json=s.body(model), timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            s.status, s.generation = r.status, r.headers.get("X-Vllm-Guard-Generation")
            if r.status != 200:
                s.errors.append(f"HTTP {r.status}: {(await r.read())[:300]!r}")
                return s
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    _event(s, event)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        s.errors.append(f"{type(e).__name__}: {e}")
    finally:
        s.ended = time.monotonic()
    if buf.strip():
        s.errors.append(f"a partial event at the end: {buf[:200]!r}")
    return s


def _event(s: Stream, event: bytes) -> None:
    if not event.startswith(b"data: "):
        s.errors.append(f"not a data event: {event[:100]!r}")
        return
    data = event[6:]
    if data == b"[DONE]":
        s.dones += 1
        return
    obj = json.loads(data)
    if "error" in obj:
        s.errors.append(json.dumps(obj["error"])[:300])
        return
    now = time.monotonic()
    s.chunk_ids.add(obj["id"])
    if obj.get("prompt_token_ids"):
        s.prompt_ids = obj["prompt_token_ids"]
    for c in obj.get("choices") or []:
        s.text += ((c.get("delta") or {}).get("content") or "") if s.chat else (c.get("text") or "")
        s.ids += c.get("token_ids") or []
        if c.get("prompt_token_ids"):
            s.prompt_ids = c["prompt_token_ids"]
        if c.get("finish_reason") is not None:
            s.finish_reason = c["finish_reason"]
    u = obj.get("usage")
    if u:
        s.prompt_tokens = u.get("prompt_tokens")
        if u["completion_tokens"] > s.tokens:
            if s.first is None:
                s.first = now
            s.progress.append((now, u["completion_tokens"]))
        s.tokens = u["completion_tokens"]


def problems(s: Stream, decode: Callable[[list[int], list[int]], str] | None) -> list[str]:
    """Everything wrong with a finished stream ([] when it is whole)."""
    out = []
    if s.status != 200:
        out.append(f"HTTP {s.status}")
    if s.errors:
        out.append(f"errors: {s.errors}")
    if s.dones != 1:
        out.append(f"{s.dones} [DONE]")
    if len(s.chunk_ids) != 1:
        out.append(f"chunk ids {sorted(s.chunk_ids)}")
    if s.finish_reason != "length":
        out.append(f"finish_reason {s.finish_reason}")
    if s.tokens != s.max_tokens:
        out.append(f"{s.tokens} tokens, asked {s.max_tokens}")
    if s.ask_ids:
        if len(s.ids) != s.max_tokens:
            out.append(f"{len(s.ids)} token ids, asked {s.max_tokens}")
        if s.prompt_ids is None or len(s.prompt_ids) != s.prompt_tokens:
            out.append(f"prompt ids {None if s.prompt_ids is None else len(s.prompt_ids)} vs {s.prompt_tokens}")
        elif decode is not None:
            want = decode(s.prompt_ids, s.ids)
            if want != s.text:
                at = next((i for i, (a, b) in enumerate(zip(want, s.text)) if a != b), min(len(want), len(s.text)))
                out.append(f"text differs from its ids' text at char {at} of {len(want)}/{len(s.text)}: "
                           f"{s.text[max(0, at - 20):at + 20]!r} vs {want[max(0, at - 20):at + 20]!r}")
    elif s.tokens and not s.text:
        out.append("no text")
    return out


def decoder(tokenizer_json: Path) -> Callable[[list[int], list[int]], str]:
    """vLLM's incremental detokenization of `ids` after `prompt` (its fast path)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(str(tokenizer_json))

    def decode(prompt: list[int], ids: list[int]) -> str:
        st = DecodeStream(ids=prompt, skip_special_tokens=True)
        return "".join(st.step(tok, i) or "" for i in ids)

    return decode


@dataclass
class Storm:
    first: list[Stream]
    later: list[Stream]
    killed_at: float  # monotonic
    at_kill: list[int]  # each first stream's tokens when the kill was sent
    kill_info: Any = None


async def storm(url: str, model: str, kill: Callable[[], Any], n: int = 8, max_tokens: int = 1500, later: int = 8,
                later_tokens: int = 64, min_tokens: int = 16, timeout: float = 1800.0,
                start_wait: float = 600.0) -> Storm:
    """`n` streams; `kill()` once all have `min_tokens` and none finished; `later` more after it."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        first = [Stream(i, chat=i % 2 == 1, max_tokens=max_tokens, ask_ids=i % 4 < 2) for i in range(n)]
        tasks = [asyncio.create_task(run_stream(session, url, model, s, timeout)) for s in first]
        end = time.monotonic() + start_wait
        while time.monotonic() < end and not all(s.tokens >= min_tokens for s in first):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.005)
        at_kill = [s.tokens for s in first]
        if not all(s.tokens >= min_tokens for s in first) or any(s.finish_reason for s in first):
            for t in tasks:
                t.cancel()
            raise AssertionError(f"not every stream streamed before the kill: tokens {at_kill}, "
                                 f"finished {[s.finish_reason for s in first]}, errors {[s.errors for s in first]}")
        info = kill()
        killed = time.monotonic()
        second = [Stream(n + i, chat=i % 2 == 1, max_tokens=later_tokens, ask_ids=i % 4 < 2) for i in range(later)]
        tasks2 = []
        for s in second:  # they arrive during the restart
            tasks2.append(asyncio.create_task(run_stream(session, url, model, s, timeout)))
            await asyncio.sleep(0.25)
        await asyncio.gather(*tasks, *tasks2)
    assert all(a < max_tokens for a in at_kill)
    return Storm(first, second, killed, at_kill, info)


def summary(st: Storm, killed_generation: int | None = None) -> dict[str, Any]:
    """Figures of a storm: completion, pauses across the kill (of the streams the killed
    generation served, and of the others when there are), the later requests' TTFT."""
    cut = [s for s in st.first if killed_generation is None or s.generation == str(killed_generation)]
    others = [s for s in st.first if s not in cut]

    def pauses(ss: list[Stream]) -> list[float]:
        return [round(s.max_gap(st.killed_at - 60), 3) for s in ss]

    return {
        "streams": len(st.first), "later": len(st.later),
        "tokens_at_kill": st.at_kill,
        "complete": sum(not problems(s, None) for s in st.first + st.later),
        "cut_streams": [s.index for s in cut],
        "longest_pause_s": max(pauses(cut), default=None),
        "pauses_s": pauses(cut),
        "other_streams_pauses_s": pauses(others),
        "later_ttft_s": [None if s.first is None else round(s.first - s.sent, 3) for s in st.later],
    }
