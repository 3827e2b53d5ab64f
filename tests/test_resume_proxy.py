"""Streams that survive their backend, against the real proxy on real sockets (milliseconds).

The backend is `scripted_vllm.ScriptedVllm`: vLLM's chunk format with token ids, its text made
by a real tokenizer (the embedded model's) the way vLLM makes it, dying at a chosen point:
before the first token, inside a multi-byte character, between the halves of a stop string,
after the last token. Generation 1 dies; the test's stand-in for the supervisor then puts
generation 2 in its place, which serves the continuation. Every resumed stream is compared,
byte for byte, with what an uninterrupted run of the same script gives the client.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from scripted_vllm import Death, ScriptedVllm, chat_prompt
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.vllm_api import unix_url
from vllm_guard.core import sse
from vllm_guard.runtime.frontdoor import resume
from vllm_guard.runtime.frontdoor.detok import Coverage, facts_of
from vllm_guard.runtime.frontdoor.proxy import Proxy, Target

pytestmark = pytest.mark.faults

TEXT = " héllo wörld, 漢字 and 🙂 end. STOP here ü"
PROMPT = "the quick fox"
MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tok(tiny_model: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(tiny_model) / "tokenizer.json"))


UNKNOWN, EOS = 5000, 2  # an id the tokenizer does not know (a borrowed tokenizer), a skipped special token


def script_of(tok: Tokenizer) -> list[int]:
    return [*tok.encode(TEXT, add_special_tokens=False).ids, UNKNOWN, EOS, UNKNOWN + 1]


def prompt_ids(tok: Tokenizer, chat: bool) -> list[int]:
    return chat_prompt(tok, MESSAGES) if chat else list(tok.encode(PROMPT, add_special_tokens=False).ids)


@dataclass
class Got:
    """What a client read: every event, the text, ids, finish and usage."""

    status: int = 0
    raw: bytes = b""
    text: str = ""
    ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    chunk_ids: set[str] = field(default_factory=set)
    objects: set[str] = field(default_factory=set)
    errors: list[dict[str, Any]] = field(default_factory=list)
    dones: int = 0
    body: dict[str, Any] | None = None  # a non-streaming answer
    generation: str | None = None


class Rig:
    def __init__(self, proxy: Proxy, gens: list[ScriptedVllm], url: str) -> None:
        self.proxy, self.gens, self.url = proxy, gens, url
        self.targets: list[Target] = []
        self.errors: list[int] = []

    async def serve(self, i: int) -> Target:
        t = Target(generation=i + 1, url=unix_url(str(self.gens[i].sock)))
        t.open(60.0)
        self.targets.append(t)
        await self.proxy.add_target(t)
        return t

    def on_error(self, t: Target) -> None:
        """The supervisor's part: a generation that failed is replaced by the next one."""
        self.errors.append(t.generation)
        if t.generation < len(self.gens) and not t.dead:
            async def replace() -> None:
                await self.proxy.stop_dispatch(t, dead=True)
                await self.serve(t.generation)
            asyncio.get_running_loop().create_task(replace())

    async def ask(self, body: dict[str, Any], chat: bool, headers: dict[str, str] | None = None) -> Got:
        g = Got()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + path, json=body, headers=headers) as r:
                g.status, g.generation = r.status, r.headers.get("X-Vllm-Guard-Generation")
                g.raw = await r.read()
        if not body.get("stream"):
            g.body = json.loads(g.raw)
            return g
        split = sse.Splitter()
        for ev in split.feed(g.raw):
            assert ev.data is not None, ev
            if ev.done:
                g.dones += 1
                continue
            obj = json.loads(ev.data)
            if "error" in obj:
                g.errors.append(obj["error"])
                continue
            g.chunk_ids.add(obj["id"])
            g.objects.add(obj["object"])
            if obj.get("usage"):
                g.usage = obj["usage"]
            if obj.get("prompt_token_ids"):
                g.prompt_ids = obj["prompt_token_ids"]
            for c in obj["choices"]:
                g.text += (c["delta"].get("content") or "") if chat else c["text"]
                g.ids += c.get("token_ids") or []
                if c.get("prompt_token_ids"):
                    g.prompt_ids = c["prompt_token_ids"]
                if c.get("finish_reason") is not None:
                    g.finish_reason, g.stop_reason = c["finish_reason"], c.get("stop_reason")
        assert not split.pending, split.pending
        return g


def run(tmp_path: Path, tiny_model: str, tok: Tokenizer, deaths: list[Death | None],
        scenario: Callable[[Rig], Awaitable[None]], chunking: list[int] | None = None, chat: bool = False,
        **server: Any) -> None:
    async def main() -> None:
        anchor = len(prompt_ids(tok, chat))
        gens = [ScriptedVllm(tmp_path / f"gen{i}.sock", tok, script_of(tok), anchor, chunking, d)
                for i, d in enumerate(deaths)]
        for g in gens:
            await g.start()
        cfg = ServerConfig(port=free_port(), model=tiny_model, **server)
        rig: Rig | None = None
        proxy = Proxy(cfg, on_limit=lambda t: None, on_error=lambda t: rig.on_error(t) if rig else None)
        rig = Rig(proxy, gens, f"http://127.0.0.1:{cfg.port}")
        await proxy.start()
        while proxy.tokenizer is None:  # loads in a thread at start
            assert proxy.tokenizer_why.startswith("the guard's tokenizer is still loading"), proxy.tokenizer_why
            await asyncio.sleep(0.01)
        await rig.serve(0)
        try:
            await scenario(rig)
        finally:
            for t in rig.targets:
                await t.close()
            await proxy.stop()
            for g in gens:
                await g.stop()

    asyncio.run(main())


def request(chat: bool, stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                            "stream": stream, **extra}
    if chat:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = PROMPT
    return body


def reference(tmp_path: Path, tiny_model: str, tok: Tokenizer, body: dict[str, Any], chat: bool) -> Got:
    """The same request, its backend never dying."""
    out: list[Got] = []

    async def scenario(rig: Rig) -> None:
        out.append(await rig.ask(body, chat))

    (tmp_path / "ref").mkdir(exist_ok=True)
    run(tmp_path / "ref", tiny_model, tok, [None], scenario, chat=chat)
    return out[0]


def decoded(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    s = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(s.step(tok, i) or "" for i in ids)


# -- the matrix: completions and chat x where it dies x stop strings x chunking ------------------
MID_CHAR = 15  # inside 漢 (two of its three bytes generated)
IN_EMOJI = 27  # inside 🙂
CLEAN = 12  # after "ld"
IN_STOP = 37  # between "ST" and "OP" of STOP
AFTER_SILENT = 48  # after an unknown id and a special token: no text, but nothing waits either

CASES = [
    # (name, death, stop, chunking, extra)
    ("mid-char drop", Death(MID_CHAR, "drop"), None, [1], {}),
    ("mid-char error event", Death(MID_CHAR, "error"), None, [1], {}),
    ("in emoji, coalesced chunks", Death(IN_EMOJI, "drop"), None, [3, 1, 2], {}),
    ("clean, eof without DONE", Death(CLEAN, "eof"), None, [2], {}),
    ("after ids that give no text", Death(AFTER_SILENT, "drop"), None, [1], {}),
    ("after ids that give no text, ids asked", Death(AFTER_SILENT, "error"), None, [2],
     {"return_token_ids": True}),
    ("stop string across the seam", Death(IN_STOP, "drop"), ["STOP"], [1], {}),
    ("stop across the seam, coalesced", Death(IN_STOP, "error"), ["xyz", "STOP"], [2, 3], {}),
    ("stop across the seam, client includes it", Death(IN_STOP, "drop"), ["STOP"], [1],
     {"include_stop_str_in_output": True}),
    ("stop after the seam", Death(CLEAN, "drop"), ["STOP"], [1], {}),
    ("client asks ids, mid-char", Death(MID_CHAR, "drop"), None, [3], {"return_token_ids": True}),
    ("continuous usage, mid-char", Death(IN_EMOJI, "error"), None, [1],
     {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("usage, after the last token", Death(MAX_TOKENS, "finish"), None, [1],
     {"stream_options": {"include_usage": True}}),
    ("death before the first token", Death(0, "error"), None, [1], {}),
    ("connection drop before the first token", Death(0, "drop"), None, [1],
     {"stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name,death,stop,chunking,extra", CASES, ids=[c[0] for c in CASES])
def test_a_stream_whose_backend_dies_is_the_stream_it_would_have_been(
        tmp_path: Path, tiny_model: str, tok: Tokenizer, chat: bool, name: str, death: Death,
        stop: list[str] | None, chunking: list[int], extra: dict[str, Any]) -> None:
    body = request(chat, **extra, **({"stop": stop} if stop else {}))
    want = reference(tmp_path, tiny_model, tok, {**body, "return_token_ids": True}, chat)
    assert want.dones == 1 and not want.errors and want.finish_reason in ("length", "stop")
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        got_.append(await rig.ask(body, chat))
        p = rig.proxy.counters
        before = death.after == 0
        finish = death.how == "finish"
        assert p.failed_requests == 0 and p.completed == 1 and p.requests_total == 1
        assert (p.resumed, p.resumes) == ((0, 0) if before or finish else (1, 1)), vars(p)
        assert p.retried == (1 if before else 0)
        if not (before or finish):  # what the continuation asked generation 2 for
            cont = rig.gens[1].seen[-1]
            assert cont.path == "/v1/completions"
            c = cont.body
            prompt = prompt_ids(tok, chat)
            assert c["prompt"][:len(prompt)] == prompt
            done = len(c["prompt"]) - len(prompt)
            assert c["prompt"][len(prompt):] == want.ids[:done]
            # it goes on from the last id whose text came out: cut inside a character, before it
            cover = Coverage(tok, prompt)
            cover.feed(want.ids[:death.after])
            assert done == cover.covered and (done < death.after) is (death.after in (MID_CHAR, IN_EMOJI))
            assert c["max_tokens"] == MAX_TOKENS - done  # explicit: the endpoint's default is 16
            assert c["stream"] is True and c["return_token_ids"] is True and c["ignore_eos"] is True
            assert c.get("include_stop_str_in_output", False) is bool(stop)
            assert "messages" not in c and "n" not in c
            # generation 1 got the client's request, rewritten only where the proxy needs it
            orig = rig.gens[0].seen[0].body
            assert orig["return_token_ids"] is True
            assert orig.get("include_stop_str_in_output", False) is bool(stop)

    run(tmp_path, tiny_model, tok, [death, None], scenario, chunking, chat)
    got = got_[0]
    assert got.status == 200 and got.dones == 1 and not got.errors, (got.errors, got.raw[-400:])
    assert len(got.chunk_ids) == 1 and got.objects == {"chat.completion.chunk" if chat else "text_completion"}
    assert got.text == want.text, (got.text, want.text)
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    # the text is what vLLM's detokenizer makes of the ids asked for, no byte twice, none missing
    prompt = prompt_ids(tok, chat)
    full = decoded(tok, prompt, want.ids)
    if stop:
        cut = min(i for i in (full.find(s) for s in stop) if i >= 0)
        assert got.text == (full[:cut + 4] if extra.get("include_stop_str_in_output") else full[:cut])
    else:
        assert got.text == full and len(want.ids) == MAX_TOKENS
    if extra.get("return_token_ids"):
        assert got.ids == want.ids and got.prompt_ids == prompt
    else:
        assert got.ids == [] and got.prompt_ids is None  # the proxy's token ids never reach the client
    if "stream_options" in extra:
        assert got.usage == {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(want.ids),
                             "completion_tokens": len(want.ids)}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_handed_over_at_a_switch_goes_on_at_the_new_generation_blaming_none(
        tmp_path: Path, tiny_model: str, tok: Tokenizer, chat: bool) -> None:
    """An overlap's switch: generation 2 is live and generation 1 hands its followed streams
    over (`stop_dispatch(hand_over=True)`) instead of computing beside it. Generation 1 is
    mid-stream and would go on (stalled here, so that the switch surely falls mid-stream): the
    stream is cut, goes on at generation 2 from its last token and is the stream it would have
    been; nobody is blamed and nothing failed."""
    body = request(chat, stop=["STOP"])
    want = reference(tmp_path, tiny_model, tok, {**body, "return_token_ids": True}, chat)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        asking = asyncio.get_running_loop().create_task(rig.ask(body, chat))
        while not rig.gens[0].dead:  # it sent CLEAN ids and waits, its connection open
            await asyncio.sleep(0.01)
        one = rig.targets[0]
        assert len(one.followed) == 1
        await rig.serve(1)
        await rig.proxy.stop_dispatch(one, hand_over=True)
        got_.append(await asyncio.wait_for(asking, 60))
        p = rig.proxy.counters
        assert p.failed_requests == 0 and p.completed == 1, vars(p)
        assert (p.handed_over, p.resumes, p.resumed) == (1, 1, 0), vars(p)  # moved on, not revived
        assert rig.errors == [] and not one.dead  # handed over, not failed: the supervisor hears nothing
        assert not one.followed and not one.cut and one.in_flight == 0
        c = rig.gens[1].seen[-1].body  # the continuation: the prompt and what generation 1 made
        assert c["prompt"][len(prompt_ids(tok, chat)):] == want.ids[:CLEAN]

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "stall"), None], scenario, [1], chat)
    got = got_[0]
    assert got.status == 200 and got.dones == 1 and not got.errors, (got.errors, got.raw[-400:])
    assert got.text == want.text and (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("how,after", [("drop", 0), ("error", 0), ("drop", 20), ("error", 20)])
def test_a_request_that_is_not_streamed_is_run_again_whole(tmp_path: Path, tiny_model: str, tok: Tokenizer,
                                                           chat: bool, how: str, after: int) -> None:
    body = request(chat, stream=False, stop=["STOP"])
    want = reference(tmp_path, tiny_model, tok, body, chat)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        got_.append(await rig.ask(body, chat))
        p = rig.proxy.counters
        assert (p.completed, p.failed_requests, p.retried, p.resumed) == (1, 0, 1, 0)
        assert rig.gens[1].seen[0].body == body  # the very same request, nothing rewritten

    run(tmp_path, tiny_model, tok, [Death(after, how), None], scenario, chat=chat)
    got = got_[0]
    assert got.status == 200 and got.generation == "2"
    assert got.body is not None and want.body is not None
    key = "message" if chat else "text"
    assert got.body["choices"][0][key] == want.body["choices"][0][key]
    assert got.body["usage"] == want.body["usage"]


def test_a_chat_without_max_tokens_goes_on_for_what_the_context_leaves(tmp_path: Path, tiny_model: str,
                                                                      tok: Tokenizer) -> None:
    """Its continuation's max_tokens comes from the next generation's /v1/models (max_model_len):
    left to itself, /v1/completions would stop at 16."""
    body = request(True)
    del body["max_tokens"]
    want = reference(tmp_path, tiny_model, tok, body, True)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        got_.append(await rig.ask(body, True))
        c = rig.gens[1].seen[-1].body
        assert c["max_tokens"] == ScriptedVllm.MAX_MODEL_LEN - len(c["prompt"])

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "drop"), None], scenario, chat=True)
    got = got_[0]
    assert got.text == want.text and got.finish_reason == "length" and got.dones == 1 and not got.errors


def test_the_continuation_carries_the_clients_api_key(tmp_path: Path, tiny_model: str, tok: Tokenizer) -> None:
    """vLLM run with --api-key refuses a continuation without it (and its /v1/models too)."""
    body = request(True)
    del body["max_tokens"]  # the continuation reads max_model_len from /v1/models first
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        for g in rig.gens:
            g.api_key = "sesame"
        got_.append(await rig.ask(body, True, headers={"Authorization": "Bearer sesame"}))
        assert rig.proxy.counters.resumed == 1 and rig.proxy.counters.failed_requests == 0

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "drop"), None], scenario, chat=True)
    assert got_[0].dones == 1 and not got_[0].errors and got_[0].finish_reason == "length", got_[0].errors


# -- moving: limits, dead targets, order ---------------------------------------------------------
def test_a_stream_moves_as_often_as_its_backends_die(tmp_path: Path, tiny_model: str, tok: Tokenizer) -> None:
    """Generation 1 dies inside a character, 2 between the halves of the stop string, 3 serves:
    one stream, resumed twice, still the uninterrupted text."""
    body = request(False, stop=["STOP"], stream_options={"include_usage": True})
    want = reference(tmp_path, tiny_model, tok, body, False)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        done: list[Any] = []
        rig.proxy.listeners.append(done.append)
        got_.append(await rig.ask(body, False))
        p = rig.proxy.counters
        assert (p.requests_total, p.resumed, p.resumes, p.completed, p.failed_requests) == (1, 1, 2, 1, 0)
        assert len(done) == 1, done  # one request, one record
        r = done[0]
        assert (r.outcome.value, r.resumed, r.generation, r.stream) == ("completed", 2, 3, True)
        assert r.completion_tokens == want.usage["completion_tokens"] and r.prompt_tokens == want.usage["prompt_tokens"]

    run(tmp_path, tiny_model, tok, [Death(MID_CHAR, "drop"), Death(IN_STOP, "error"), None], scenario)
    got = got_[0]
    assert got.text == want.text and got.usage == want.usage and got.dones == 1 and not got.errors


def test_past_the_migration_limit_a_stream_ends_with_one_error(tmp_path: Path, tiny_model: str,
                                                              tok: Tokenizer) -> None:
    body = request(False)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        got_.append(await rig.ask(body, False))
        p = rig.proxy.counters
        assert (p.failed_requests, p.unresumable, p.resumed, p.completed) == (1, 1, 1, 0)

    run(tmp_path, tiny_model, tok, [Death(10, "drop"), Death(20, "drop"), None], scenario, migration_limit=1)
    got = got_[0]
    assert got.status == 200 and got.dones == 1 and len(got.errors) == 1
    assert "migration_limit" in got.errors[0]["message"] and got.errors[0]["code"] == 502


def test_a_stream_that_cannot_be_resumed_ends_with_one_error_that_says_why(tmp_path: Path, tiny_model: str,
                                                                         tok: Tokenizer) -> None:
    body = request(False, presence_penalty=0.5)
    got_: list[Got] = []

    async def scenario(rig: Rig) -> None:
        got_.append(await rig.ask(body, False))
        p = rig.proxy.counters
        assert (p.failed_requests, p.unresumable, p.resumed) == (1, 1, 0)
        assert "return_token_ids" not in rig.gens[0].seen[0].body  # passed through as the client sent it

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "drop"), None], scenario)
    got = got_[0]
    assert len(got.errors) == 1 and "presence penalty" in got.errors[0]["message"], got.errors


def test_a_generation_that_answered_engine_dead_is_never_tried_again(tmp_path: Path, tiny_model: str,
                                                                     tok: Tokenizer) -> None:
    """Its replacement comes only after the retry hold-off: the request waits for it instead of
    going back to the dead one (which answered 502 after two attempts under load before)."""
    body = request(False, stream=False)

    async def scenario(rig: Rig) -> None:
        rig.on_error = lambda t: rig.errors.append(t.generation)  # type: ignore[method-assign]  # no replacement

        async def late() -> None:
            while not rig.errors:
                await asyncio.sleep(0.01)
            await asyncio.sleep(6.0)  # past RETRY_HOLDOFF_S, the dead one still open for dispatch
            await rig.serve(1)

        task = asyncio.create_task(late())
        got = await rig.ask(body, False)
        await task
        assert got.status == 200 and got.generation == "2", got.raw[:300]
        assert len(rig.gens[0].seen) == 1  # never sent there again
        assert rig.proxy.counters.retried == 1

    run(tmp_path, tiny_model, tok, [Death(0, "error"), None], scenario)


def test_a_moving_request_goes_before_requests_that_arrived_while_it_waited(tmp_path: Path, tiny_model: str,
                                                                             tok: Tokenizer) -> None:
    async def scenario(rig: Rig) -> None:
        rig.on_error = lambda t: rig.errors.append(t.generation)  # type: ignore[method-assign]
        first = asyncio.create_task(rig.ask(request(False), False))
        while not rig.errors:
            await asyncio.sleep(0.01)
        await rig.proxy.stop_dispatch(rig.targets[0], dead=True)
        while rig.proxy.queued < 1:  # the moving stream waits for a generation
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(rig.ask(request(False, max_tokens=4), False)) for _ in range(5)]
        while rig.proxy.queued < 6:
            await asyncio.sleep(0.01)
        await rig.serve(1)
        got = await first
        assert got.dones == 1 and not got.errors
        assert all(g.dones == 1 for g in [await t for t in later])
        seen = [x.body["prompt"] for x in rig.gens[1].seen]
        assert isinstance(seen[0], list) and seen[1:] == [PROMPT] * 5  # the continuation (token ids) first

    run(tmp_path, tiny_model, tok, [Death(10, "drop"), None], scenario)



def test_a_moving_stream_no_generation_takes_ends_with_one_error(tmp_path: Path, tiny_model: str,
                                                                  tok: Tokenizer) -> None:
    """Its backend died and nothing replaces it within the queue's wait: the client, already
    reading, gets one error event and [DONE], not a hang (policy: no target while sent)."""
    body = request(False)

    async def scenario(rig: Rig) -> None:
        rig.on_error = lambda t: rig.errors.append(t.generation)  # type: ignore[method-assign]  # no replacement
        got = await rig.ask(body, False)
        assert got.status == 200 and got.dones == 1 and len(got.errors) == 1, got.raw[-400:]
        assert "could not be resumed" in got.errors[0]["message"], got.errors
        assert got.text  # what came before the death stays
        p = rig.proxy.counters
        assert (p.failed_requests, p.unresumable, p.resumed, p.completed) == (1, 1, 1, 0)
        assert rig.errors == [1] and rig.proxy.queued == 0 and rig.proxy.in_flight == 0

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "drop")], scenario, queue_max_wait=1)


def test_a_stream_past_the_per_try_timeout_ends_there_and_does_not_move(tmp_path: Path, tiny_model: str,
                                                                        tok: Tokenizer) -> None:
    """The policy's per-try timeout ([server] request_timeout) is the proxy's, whatever the
    target's session says (the rig opens it with 60 s): a hung stream ends with one error event
    after 1 s, the generation is not blamed and the next one never sees it."""
    body = request(False)

    async def scenario(rig: Rig) -> None:
        t0 = asyncio.get_running_loop().time()
        got = await rig.ask(body, False)
        took = asyncio.get_running_loop().time() - t0
        assert got.status == 200 and got.dones == 1 and len(got.errors) == 1, got.raw[-400:]
        assert "request_timeout" in got.errors[0]["message"], got.errors
        assert 0.9 <= took < 10, took
        p = rig.proxy.counters
        assert (p.failed_requests, p.unresumable, p.resumed, p.resumes) == (1, 0, 0, 0)
        assert rig.errors == [] and len(rig.gens[1].seen) == 0

    run(tmp_path, tiny_model, tok, [Death(CLEAN, "stall"), None], scenario, request_timeout=1)

# -- the pure parts ------------------------------------------------------------------------------
def test_the_splitter_gives_whole_events_whatever_the_pieces() -> None:
    raw = (b'data: {"a":1}\n\n: comment\n\ndata: {"b":\ndata: 2}\r\n\r\ndata: [DONE]\n\n')
    for cut in range(1, 9):
        s = sse.Splitter()
        evs = [e for i in range(0, len(raw), cut) for e in s.feed(raw[i:i + cut])]
        assert [e.data for e in evs] == [b'{"a":1}', None, b'{"b":\n2}', b"[DONE]"], cut
        assert b"".join(e.raw for e in evs) == raw and evs[-1].done and not s.pending


def test_which_streams_can_be_resumed() -> None:
    facts = facts_of("/m", [])
    base = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 8}

    def why(path: str = resume.COMPLETIONS, f: Any = facts, **kw: Any) -> Any:
        p = resume.plan(path, json.dumps({**base, **kw}).encode(), f, True)
        return p if isinstance(p, str) or p is None else "resumable"

    assert why() == "resumable"
    assert why(stream=False) is None  # re-run whole instead
    assert why(temperature=0.7, seed=3, top_p=0.9, stop=["a"], logprobs=None, echo=False, presence_penalty=0,
               user="u", priority=1, stream_options={"include_usage": True}) == "resumable"
    for kw, reason in ((dict(n=2), "n > 1"), (dict(logprobs=0), "logprobs"), (dict(logprobs=2), "logprobs"),
                       (dict(prompt_logprobs=1), "prompt_logprobs"), (dict(echo=True), "echo"),
                       (dict(presence_penalty=0.1), "presence"), (dict(frequency_penalty=1), "frequency"),
                       (dict(bad_words=["x"]), "bad_words"), (dict(response_format={"type": "json_object"}),
                                                              "response_format"),
                       (dict(structured_outputs={"json": {}}), "structured"), (dict(guided_json={}), "guided"),
                       (dict(prompt=["a", "b"]), "several prompts"), (dict(use_beam_search=True), "beam"),
                       (dict(truncate_prompt_tokens=5), "truncate"), (dict(spaces_between_special_tokens=False),
                                                                      "spaces_between"),
                       (dict(frobnicate=1), "frobnicate")):
        assert reason in str(why(**kw)), (kw, why(**kw))
    chat = dict(messages=[{"role": "user", "content": "hi"}], prompt=None)
    assert why(resume.CHAT, **chat) == "resumable"
    assert "tools" in why(resume.CHAT, **chat, tools=[{"type": "function", "function": {"name": "f"}}])
    assert "other content" in why(resume.CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}])
    assert "reasoning parser" in why(resume.CHAT, facts_of("/m", ["--reasoning-parser", "qwen3"]), **chat)
    assert "tool-call parser" in why(resume.CHAT, facts_of("/m", ["--tool-call-parser=hermes"]), **chat)
    assert why(resume.COMPLETIONS, facts_of("/m", ["--reasoning-parser", "qwen3"])) == "resumable"
    assert resume.plan("/v1/embeddings", b"{}", facts, True) is None
    assert "tokenizer" in str(resume.plan(resume.COMPLETIONS, json.dumps(base).encode(), facts, False))


def test_the_rewritten_request_and_its_limits() -> None:
    facts = facts_of("/m", [])
    p = resume.plan(resume.COMPLETIONS, json.dumps({"prompt": "x", "stream": True, "stop": "ab"}).encode(), facts, True)
    assert isinstance(p, resume.Plan)
    sent = json.loads(p.body)
    assert sent["return_token_ids"] is True and sent["include_stop_str_in_output"] is True
    assert p.max_tokens == 16 and p.stops == ("ab",) and p.hold == 1  # the endpoint's default
    p = resume.plan(resume.CHAT, json.dumps({"messages": [], "stream": True, "max_completion_tokens": 7,
                                             "max_tokens": 9}).encode(), facts, True)
    assert isinstance(p, resume.Plan) and p.max_tokens == 7 and p.hold == 0
    p = resume.plan(resume.CHAT, json.dumps({"messages": [], "stream": True}).encode(), facts, True)
    assert isinstance(p, resume.Plan) and p.max_tokens is None  # to the model's length


def test_coverage_stops_at_the_last_id_whose_text_came_out(tok: Tokenizer) -> None:
    ids = script_of(tok)
    prompt = prompt_ids(tok, False)
    c = Coverage(tok, prompt)
    text = ""
    for n, i in enumerate(ids, 1):
        text += c.feed([i])
        assert text == decoded(tok, prompt, ids[:c.covered])
        if n in (MID_CHAR, IN_EMOJI):
            assert c.covered < n  # bytes of a character wait for the rest
    assert c.covered == len(ids) and text == TEXT  # the last two ids give no text, and leave none waiting
