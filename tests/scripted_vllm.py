"""A scripted vLLM for the proxy's resumption tests: vLLM's answers, on a real socket, from a
script of token ids, and a death at a chosen point.

It speaks what the proxy relies on, as vLLM 0.32.0 writes it (fields and their order, captured
from the real server): `/v1/completions` and `/v1/chat/completions`, streaming and not, token
ids per chunk and the prompt's in the first (`return_token_ids`), usage (`include_usage`,
`continuous_usage_stats`), the engine-dead error event, a 500 after its engine died. Its text
comes from a real tokenizer the way vLLM makes it: a `DecodeStream` primed with the prompt's
ids, one step per generated id, stop strings checked on the text generated in this request
only, and held back by the longest stop string unless `include_stop_str_in_output`. So a
continuation started inside a character comes out wrong here exactly as it would in vLLM.

What it generates depends only on the position: the id at position p after the original
prompt is `script[p % len(script)]`. A continuation (prompt = original prompt + generated ids)
therefore goes on with the ids an uninterrupted run would have given, and a test compares the
resumed stream with the uninterrupted one byte for byte. Chunks carry `chunking` ids in turn
(vLLM coalesces tokens when its client reads slowly).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
CHAT_TEMPLATE = "{role}: {content}\n"


def j(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def chat_prompt(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The tiny model's chat template (`{role}: {content}` lines, then `assistant:`)."""
    text = "".join(CHAT_TEMPLATE.format(**m) for m in messages) + "assistant:"
    return list(tok.encode(text, add_special_tokens=False).ids)


@dataclass
class Death:
    """Where the backend dies. `after`: generated ids (counted from the original prompt) after
    which it dies; `how`: drop (the connection closes), error (vLLM's engine-dead event, then
    [DONE]), eof (the body ends without [DONE]), finish (after the finish chunk, before usage and
    [DONE]), stall (it hangs, the connection open). after=0 with drop or error: it dies before
    answering (a 500 for error)."""

    after: int
    how: str = "drop"


@dataclass
class Seen:
    path: str
    body: dict[str, Any]


class ScriptedVllm:
    MAX_MODEL_LEN = 160  # a chat without max_tokens runs to it, as vLLM's does

    def __init__(self, sock: Path, tokenizer: Tokenizer, script: list[int], anchor: int,
                 chunking: list[int] | None = None, death: Death | None = None, model: str = "tiny") -> None:
        self.sock, self.tok, self.script, self.anchor = sock, tokenizer, script, anchor
        self.chunking = chunking or [1]
        self.death = death
        self.model = model
        self.dead = False
        self.api_key: str | None = None  # like vLLM's --api-key: every request must carry it
        self.seen: list[Seen] = []
        self.runner: web.AppRunner | None = None
        self._n = 0

    # -- the server ---------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.UnixSite(self.runner, str(self.sock)).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _refused(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return None

    async def models(self, request: web.Request) -> web.Response:
        if (no := self._refused(request)) is not None:
            return no
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "max_model_len": self.MAX_MODEL_LEN}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if (no := self._refused(request)) is not None:
            return no
        body = await request.json()
        self.seen.append(Seen(request.path, body))
        chat = request.path.endswith("/chat/completions")
        if self.dead:
            return self._engine_dead_500()
        prompt = chat_prompt(self.tok, body["messages"]) if chat else self._prompt(body["prompt"])
        d = self.death
        if d is not None and d.how in ("drop", "error") and d.after <= len(prompt) - self.anchor:
            # it dies before this request's first token
            return await self._die_before(request, d)
        self._n += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._n:04d}"
        if body.get("stream"):
            return await self._stream(request, body, prompt, chat, rid)
        return self._whole(request, body, prompt, chat, rid)

    def _prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tok.encode(prompt, add_special_tokens=False).ids)
        return [int(i) for i in prompt]

    def _engine_dead_500(self) -> web.Response:
        return web.json_response({"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                                            "code": 500}}, status=500)

    async def _die_before(self, request: web.Request, d: Death) -> web.StreamResponse:
        self.dead = True
        if d.how == "error":
            return self._engine_dead_500()
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0.05)
        return web.Response()

    # -- generation, as vLLM's detokenizer does it ---------------------------------------------
    def _generate(self, body: dict[str, Any], prompt: list[int]) -> Any:
        """Yields (ids, text, finish_reason, stop_reason, generated here, generated since the
        original prompt) per engine step."""
        stream = DecodeStream(ids=prompt, skip_special_tokens=body.get("skip_special_tokens", True))
        stop = body.get("stop") or []
        stops = [stop] if isinstance(stop, str) else list(stop)
        include = bool(body.get("include_stop_str_in_output"))
        hold = max((len(s) for s in stops), default=1) - 1 if stops and not include else 0
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None:  # vLLM: 16 on /v1/completions, what the context leaves on chat
            max_tokens = 16 if "messages" not in body else self.MAX_MODEL_LEN - len(prompt)
        output, sent, n = "", 0, 0
        pos = len(prompt) - self.anchor
        while True:
            tid = self.script[pos % len(self.script)]
            pos += 1
            n += 1
            piece = stream.step(self.tok, tid) or ""
            new_from = len(output)
            output += piece
            fin: str | None = None
            stop_reason: Any = None
            if stops and n > int(body.get("min_tokens") or 0):
                hit = _check_stop(output, len(output) - new_from, stops, include)
                if hit is not None:
                    stop_reason, cut = hit
                    if cut != -1:
                        output = output[:cut]
                    fin = "stop"
            if fin is None and max_tokens is not None and n >= max_tokens:
                fin = "length"
            end = len(output) if fin is not None else len(output) - hold
            text = output[sent:end] if end > sent else ""
            sent = max(sent, end)
            yield [tid], text, fin, stop_reason, n, pos
            if fin is not None:
                return

    async def _stream(self, request: web.Request, body: dict[str, Any], prompt: list[int], chat: bool,
                      rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        ids_on = bool(body.get("return_token_ids"))
        opts = body.get("stream_options") or {}
        usage_on, continuous = bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.model}
        d = self.death
        first = True
        if chat:
            role: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}],
                                    "prompt_token_ids": prompt if ids_on else None, "prompt_text": None}
            if continuous:
                role["usage"] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt), "completion_tokens": 0}
            await resp.write(f"data: {j(role)}\n\n".encode())
        steps = self._generate(body, prompt)
        total = 0
        k = 0
        done = False
        while not done:
            size = self.chunking[k % len(self.chunking)]
            k += 1
            ids: list[int] = []
            text = ""
            fin: str | None = None
            stop_reason: Any = None
            pos = 0
            for _ in range(size):
                step_ids, piece, fin, stop_reason, total, pos = next(steps)
                ids += step_ids
                text += piece
                if fin is not None or (d is not None and pos >= d.after and d.how != "finish"):
                    break
            done = fin is not None
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": fin}
                if fin is not None:
                    choice["stop_reason"] = stop_reason
                choice["token_ids"] = ids if ids_on else None
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin, "stop_reason": stop_reason,
                          "prompt_token_ids": prompt if ids_on and first else None,
                          "token_ids": ids if ids_on else None}
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + total,
                                  "completion_tokens": total}
            if done and not usage_on:
                chunk["system_fingerprint"] = "vllm-scripted"
            first = False
            await resp.write(f"data: {j(chunk)}\n\n".encode())
            await asyncio.sleep(0)
            if d is not None and pos >= d.after and (d.how != "finish" or done):
                return await self._die_mid(request, resp, d)
        if usage_on:
            u = {**head, "choices": [], "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + total,
                                                  "completion_tokens": total}, "system_fingerprint": "vllm-scripted"}
            await resp.write(f"data: {j(u)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _die_mid(self, request: web.Request, resp: web.StreamResponse, d: Death) -> web.StreamResponse:
        self.dead = True
        if d.how == "error":
            err = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}}
            await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
        elif d.how == "eof":
            await resp.write_eof()
        elif d.how == "stall":
            await asyncio.sleep(3600)  # a hung engine: nothing more comes until the proxy leaves
        else:  # drop, finish: the connection goes
            assert request.transport is not None
            request.transport.close()
        return resp

    def _whole(self, request: web.Request, body: dict[str, Any], prompt: list[int], chat: bool,
               rid: str) -> web.Response:
        ids: list[int] = []
        text = ""
        fin: str | None = None
        stop_reason: Any = None
        for step_ids, piece, fin, stop_reason, _, _ in self._generate(body, prompt):
            ids += step_ids
            text += piece
        d = self.death
        if d is not None and len(prompt) - self.anchor + len(ids) >= d.after:  # died while generating it
            self.dead = True
            if d.how == "error":
                return self._engine_dead_500()
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids)}
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": fin, "stop_reason": stop_reason}
            return web.json_response({"id": rid, "object": "chat.completion", "created": int(time.time()),
                                      "model": self.model, "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin, "stop_reason": stop_reason,
                  "token_ids": ids if body.get("return_token_ids") else None}
        return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                  "model": self.model, "choices": [choice], "usage": usage})


def _check_stop(output: str, new: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM 0.32's `check_stop_strings`: the stop string completing earliest in the new text."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = output.find(s, 1 - new - len(s))
        if i == -1:
            continue
        end = i + len(s)
        if best is None or end < best[0]:
            best = (end, i, s)
    if best is None:
        return None
    end, i, s = best
    if include:
        return s, -1 if end >= len(output) else end
    return s, i


@dataclass
class Reference:
    """What an uninterrupted run gives a client: the text, the ids, the finish."""

    text: str
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
