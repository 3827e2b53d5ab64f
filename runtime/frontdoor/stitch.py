"""One resumable stream, event by event: the ids it generated, the text the client has, and the
rewriting of vLLM's events (the original request's, then each continuation's) into the one
stream the client sees. Pure: the proxy feeds it events and writes what it returns.

Per event of the original request: the token ids go (unless the client asked for them), the
text is held back by the stop strings as vLLM would have held it, the rest is vLLM's own bytes
re-encoded. A continuation's chunks are rebuilt in the client's kind (a chat chunk from the
continuation's text) under the original id; usage counts the original prompt and every
completion token. The rules are in `resume`'s docstring.
"""

from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from vllm_guard.core import sse

from .detok import Coverage
from .resume import CHAT, COMPLETIONS, Plan, dumps, engine_dead


class _Delta(msgspec.Struct):
    content: Union[str, None] = None


class _Choice(msgspec.Struct):
    text: Union[str, None] = None
    delta: Union[_Delta, None] = None
    token_ids: Union[list[int], None] = None
    prompt_token_ids: Union[list[int], None] = None
    finish_reason: Union[str, None] = None
    stop_reason: Union[int, str, None] = None


class _Chunk(msgspec.Struct):
    """What the lean path reads of a chunk (msgspec skips the rest without building it)."""

    id: Union[str, None] = None
    created: Union[int, None] = None
    model: Union[str, None] = None
    choices: Union[list[_Choice], None] = None
    prompt_token_ids: Union[list[int], None] = None
    usage: Union[dict[str, Any], None] = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_IDS = b'"token_ids":['
_PROMPT_IDS = b'"prompt_token_ids":['


_TEXT = {COMPLETIONS: re.compile(rb'"text":("(?:[^"\\]|\\.)*")'),  # the choice's text, as a JSON string
         CHAT: re.compile(rb'"content":("(?:[^"\\]|\\.)*")')}


def _null_ids(raw: bytes, key: bytes, last: bool = True) -> bytes:
    """`raw` with the id list after `key` replaced by null (what vLLM writes when ids were not
    asked for)."""
    i = raw.rfind(key) if last else raw.find(key)
    if i < 0:
        return raw
    j = raw.find(b"]", i)
    return raw[:i + len(key) - 1] + b"null" + raw[j + 1:]


@dataclass
class Stream:
    """One resumable stream as it passes: the ids it generated, what the client got, and the
    rewriting of every event (vLLM's, or a continuation's) into the client's stream.

    `feed` takes one upstream event and returns the events for the client. After a death,
    `seam()` prepares the continuation and `continuation()` is its body.
    """

    plan: Plan
    tokenizer: Any
    prompt_ids: array[int] | None = None  # 4 bytes an id: a long prompt held for the whole stream
    gen: array[int] = field(default_factory=lambda: array("i"))  # generated ids (a cut-off tail dropped at each seam)
    coverage: Coverage | None = None
    base: int = 0  # ids of gen before the current part (where its coverage began)
    ids_sent: int = 0  # of gen, given to a client that asked for ids
    held: str = ""  # text held back for the stop strings
    tail: str = ""  # the last `window` characters of the text received (where a seam stop may begin)
    part: int = 0  # 0: the original request; n: the n-th continuation
    finished: bool = False  # a finish_reason went to the client
    usage_sent: bool = False
    done: bool = False  # [DONE] went to the client
    error: str | None = None  # an error event (not the engine's death) went to the client
    dead: bool = False  # vLLM said its engine died (that event and what follows are not passed on)
    why_not: str | None = None  # set once the stream cannot be resumed any more
    meta: dict[str, Any] = field(default_factory=dict)  # id, created, model of the client's stream
    seam_text: str | None = None  # while a stop string may span the seam: the text before it
    seam_after: str = ""  # the continuation's text since the seam
    stop_at_seam: str | None = None  # the proxy ended the stream on this stop string, across the seam
    texts: list[str] = field(default_factory=list)  # the current part's text, chunk by chunk (lean path)

    @property
    def lean(self) -> bool:
        """The original request's events need only their token ids nulled and their text held
        back by the stop strings (no ids to give the client): they are read with a typed decoder
        and passed on as they came, spliced where the text changes, and the detokenization is
        replayed only if the backend dies (`resumable`)."""
        return self.part == 0 and not self.plan.client_ids

    # -- the events ---------------------------------------------------------------------------
    def feed(self, ev: sse.Event) -> list[bytes]:
        if self.dead or self.done or self.stop_at_seam is not None:
            return []  # the engine is gone, or the stream has ended
        if ev.data is None:
            return [ev.raw]  # a comment or another field: passed on as it came
        if ev.done:
            self.done = True
            return [ev.raw]
        if self.lean:
            out = self._lean(ev)
            if out is not None:
                return out
        try:
            obj = msgspec.json.decode(ev.data)
        except msgspec.DecodeError:
            self.why_not = self.why_not or "vLLM sent an event that is not JSON"
            return [ev.raw]
        if not isinstance(obj, dict):
            return [ev.raw]
        if "error" in obj:
            if engine_dead(ev.data):
                self.dead = True
                return []
            self.error = json.dumps(obj["error"])[:300]
            return [ev.raw]
        choices = obj.get("choices")
        if not choices:  # the usage record at the end
            return self._usage_event(obj, ev)
        return [self._chunk(obj, choices[0])]

    def _lean(self, ev: sse.Event) -> list[bytes] | None:
        """The original request's event, the fast way; None: take the full path (nothing of
        the stream's state has changed then)."""
        assert ev.data is not None
        try:
            c = _decode_chunk(ev.data)
        except msgspec.DecodeError:
            return None
        if c.error is not None or not c.choices:
            return None  # an error event, or the usage record: rare, the full path
        ch = c.choices[0]
        chat = self.plan.kind == CHAT
        text = ((ch.delta.content if ch.delta is not None else None) if chat else ch.text) or ""
        raw = ev.raw
        if self.plan.hold:
            m = _TEXT[self.plan.kind].search(raw)
            if m is None:
                return None  # not the shape it should be: the full path
            out = self._hold(text, ch.finish_reason, ch.stop_reason)
            if out != text:
                raw = raw[:m.start(1)] + msgspec.json.encode(out) + raw[m.end(1):]
        if self.prompt_ids is None:
            ids = c.prompt_token_ids if chat else ch.prompt_token_ids
            if ids is None:
                self.why_not = "vLLM sent no prompt token ids"
            self.prompt_ids = array("i", ids or [])
            self.meta = {"id": c.id, "created": c.created, "model": c.model}
            raw = _null_ids(raw, _PROMPT_IDS, last=False)
        if ch.token_ids is None:
            if not (chat and not self.gen and ch.finish_reason is None):
                self.why_not = self.why_not or "vLLM sent a chunk without token ids"
        else:
            self.gen.extend(ch.token_ids)
            raw = _null_ids(raw, _IDS)
        self._keep_text(text)
        if self.plan.window:
            self.tail = (self.tail + text)[-self.plan.window:]
        if ch.finish_reason is not None:
            self.finished = True
        return [raw]

    def _keep_text(self, text: str) -> None:
        """The text received, for the replay at a death; joined as it grows (one str object
        per chunk would cost more than the text)."""
        self.texts.append(text)
        if len(self.texts) >= 256:
            self.texts = ["".join(self.texts)]

    def _chunk(self, obj: dict[str, Any], choice: dict[str, Any]) -> bytes:
        first = self.prompt_ids is None
        if first:
            self._open(obj, choice)
        ids = choice.get("token_ids")
        if ids is None:
            ids = []
            if not (first and self.plan.kind == CHAT):  # chat's first chunk (the role) carries none
                self.why_not = self.why_not or "vLLM sent a chunk without token ids"
        own_chat = self.plan.kind == CHAT and self.part == 0
        text = ((choice.get("delta") or {}).get("content") if own_chat else choice.get("text")) or ""
        fin, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        self._follow(ids, text, fin is not None)
        out = self._seam_stop(text) if self.seam_text is not None else None
        if out is not None:
            fin, stop_reason = "stop", self.stop_at_seam
        else:
            out = self._hold(text, fin, stop_reason)
        out_ids = self._ids_out(fin is not None)
        if fin is not None:
            self.finished = True
        if self.part == 0:
            return self._own(obj, choice, out, out_ids)
        return self._rebuilt(obj, out, out_ids, fin, stop_reason)

    def _open(self, obj: dict[str, Any], choice: dict[str, Any]) -> None:
        """The first chunk: the prompt's ids and the stream's id, kept for every later part."""
        ids = obj.get("prompt_token_ids") if self.plan.kind == CHAT else choice.get("prompt_token_ids")
        if not isinstance(ids, list):
            self.why_not = "vLLM sent no prompt token ids"
            ids = []
        self.prompt_ids = array("i", ids)
        self.meta = {"id": obj.get("id"), "created": obj.get("created"), "model": obj.get("model")}
        self.coverage = Coverage(self.tokenizer, self.prompt_ids.tolist(), self.plan.skip_special_tokens)

    def _follow(self, ids: list[int], text: str, final: bool) -> None:
        """Keep the ids, and check that our detokenization gives vLLM's text."""
        self.gen.extend(ids)
        if self.plan.window:
            self.tail = (self.tail + text)[-self.plan.window:]
        if self.coverage is None:
            self._keep_text(text)  # replayed at a death (`resumable`), as on the lean path
            return
        if self.why_not:
            return
        ours = self.coverage.feed(ids)
        if not final and ours != text:
            self.why_not = "the guard's tokenizer does not give vLLM's text"

    def _hold(self, text: str, fin: str | None, stop_reason: Any) -> str:
        """The text to send now: the proxy's own stop-string hold-back (vLLM's, moved here)."""
        hold = self.plan.hold
        if not hold:
            return text
        self.held += text
        if fin is not None:
            out, self.held = self.held, ""
            if fin == "stop" and isinstance(stop_reason, str) and stop_reason and out.endswith(stop_reason):
                out = out[:-len(stop_reason)]  # vLLM kept it because the proxy asked it to
            return out
        if len(self.held) <= hold:
            return ""
        out, self.held = self.held[:-hold], self.held[-hold:]
        return out

    def _seam_stop(self, text: str) -> str | None:
        """A stop string begun before the seam and completed by the continuation (vLLM checks
        only the text it generated itself, so it cannot see one): the text to send with the
        final chunk, or None when none completes here."""
        assert self.seam_text is not None
        already = len(self.seam_after)
        self.seam_after += text
        before, window = self.seam_text, self.seam_text + self.seam_after
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        if len(self.gen) > self.plan.min_tokens:  # vLLM ignores stop strings until min_tokens
            for s in self.plan.stops:
                i = window.find(s, max(0, len(before) - len(s) + 1))
                if 0 <= i < len(before) and (best is None or i + len(s) < best[0]):
                    best = (i + len(s), i, s)
        if best is None:
            if len(self.seam_after) >= self.plan.window:
                self.seam_text = None  # nothing can span the seam any more: vLLM's job again
            return None
        end, start, s = best
        self.seam_text, self.stop_at_seam = None, s
        if self.plan.client_include_stop:  # nothing held: the text runs to the stop string's end
            return self.seam_after[already:end - len(before)]
        # What is held is the tail of the text before this chunk, and the stop string begins in
        # it: send what precedes the stop string, drop the rest.
        back = already + len(before) - start  # characters from the stop string's start to the held end
        out, self.held = self.held[:max(0, len(self.held) - back)], ""
        return out

    def _ids_out(self, final: bool) -> list[int] | None:
        """Token ids for a client that asked for them: only those whose text it has."""
        if not self.plan.client_ids:
            return None
        upto = len(self.gen) if final or self.coverage is None else self.base + self.coverage.covered
        upto = max(upto, self.ids_sent)
        out, self.ids_sent = self.gen[self.ids_sent:upto].tolist(), upto
        return out

    def _own(self, obj: dict[str, Any], choice: dict[str, Any], text: str, ids: list[int] | None) -> bytes:
        """An event of the original request, as the client would have had it without the proxy."""
        if self.plan.kind == CHAT:
            delta = choice.get("delta")
            if isinstance(delta, dict) and "content" in delta:
                delta["content"] = text
            if "prompt_token_ids" in obj and not self.plan.client_ids:
                obj["prompt_token_ids"] = None
        else:
            choice["text"] = text
            if not self.plan.client_ids:
                choice["prompt_token_ids"] = None
        if "token_ids" in choice:
            choice["token_ids"] = ids
        return sse.event(dumps(obj))

    def _rebuilt(self, obj: dict[str, Any], text: str, ids: list[int] | None, fin: str | None,
                 stop_reason: Any) -> bytes:
        """A continuation's chunk, in the client's stream (its id, its kind)."""
        choice: dict[str, Any]
        if self.plan.kind == COMPLETIONS:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin, "stop_reason": stop_reason,
                      "prompt_token_ids": None, "token_ids": ids}
            out: dict[str, Any] = {"id": self.meta["id"], "object": "text_completion", "created": self.meta["created"],
                                   "model": self.meta["model"], "choices": [choice]}
        else:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": fin}
            if fin is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = ids
            out = {"id": self.meta["id"], "object": "chat.completion.chunk", "created": self.meta["created"],
                   "model": self.meta["model"], "choices": [choice]}
        if obj.get("usage") is not None:
            out["usage"] = self._usage(obj["usage"])
        if obj.get("system_fingerprint") is not None:
            out["system_fingerprint"] = obj["system_fingerprint"]
        return sse.event(dumps(out))

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Usage over every part: the original prompt, all completion tokens."""
        u = dict(usage)
        p = len(self.prompt_ids or [])
        u["prompt_tokens"], u["completion_tokens"], u["total_tokens"] = p, len(self.gen), p + len(self.gen)
        return u

    def _usage_event(self, obj: dict[str, Any], ev: sse.Event) -> list[bytes]:
        if obj.get("usage") is None:
            return [ev.raw]
        self.usage_sent = True
        if self.part == 0:
            return [ev.raw]
        obj["usage"] = self._usage(obj["usage"])
        obj.update(self.meta)
        if self.plan.kind == CHAT:
            obj["object"] = "chat.completion.chunk"
        return [sse.event(dumps(obj))]

    # -- the seam -----------------------------------------------------------------------------
    def resumable(self) -> str | None:
        """None if the stream can go on elsewhere now; else why not."""
        if self.prompt_ids is None:
            return "no chunk of the stream had come"
        if self.coverage is None and not self.why_not:  # the lean path: replay the detokenization now
            self.coverage = Coverage(self.tokenizer, self.prompt_ids.tolist(), self.plan.skip_special_tokens)
            if self.coverage.feed(self.gen.tolist()) != "".join(self.texts):
                self.why_not = "the guard's tokenizer does not give vLLM's text"
        if not self.why_not and self.coverage is not None and self.ids_sent > self.base + self.coverage.covered:
            self.why_not = "token ids beyond the text were already sent"  # never: _ids_out sends only covered ids
        return self.why_not

    def seam(self) -> None:
        """The backend died and `resumable()` said it can go on: drop the ids whose text never
        came, follow a continuation next."""
        assert self.coverage is not None and self.prompt_ids is not None
        keep = self.base + self.coverage.covered
        assert self.ids_sent <= keep, "seam() without resumable()"
        del self.gen[keep:]
        self.base = keep
        self.coverage = Coverage(self.tokenizer, (self.prompt_ids + self.gen).tolist(), self.plan.skip_special_tokens)
        self.part += 1
        self.dead = False
        self.seam_text = self.tail if self.plan.stops else None
        self.seam_after = ""
        self.texts = []

    def left(self, max_model_len: int | None) -> int | None:
        """Tokens left to generate; None when unknown (a chat without a limit, the model's
        length not known yet)."""
        if self.plan.max_tokens is not None:
            return self.plan.max_tokens - len(self.gen)
        if max_model_len is None or self.prompt_ids is None:
            return None
        return max_model_len - len(self.prompt_ids) - len(self.gen)

    def continuation(self, left: int) -> bytes:
        """The body of the `/v1/completions` request that goes on from here."""
        assert self.prompt_ids is not None
        body: dict[str, Any] = dict(self.plan.carried)
        body.update(prompt=(self.prompt_ids + self.gen).tolist(), max_tokens=left, stream=True, return_token_ids=True)
        if self.plan.model is not None:
            body["model"] = self.plan.model
        if self.plan.min_tokens:
            body["min_tokens"] = max(0, self.plan.min_tokens - len(self.gen))
        if self.plan.stops:
            body["stop"] = list(self.plan.stops)
            body["include_stop_str_in_output"] = True
        return dumps(body)

    def closing(self) -> list[bytes]:
        """What the client still needs after the last token when no backend sends it (one died
        after the finish chunk, or the proxy ended the stream on a stop string at the seam)."""
        out: list[bytes] = []
        if self.plan.include_usage and not self.usage_sent:
            p, c = len(self.prompt_ids or []), len(self.gen)
            obj = {**self.meta, "object": "chat.completion.chunk" if self.plan.kind == CHAT else "text_completion",
                   "choices": [], "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}}
            out.append(sse.event(dumps(obj)))
            self.usage_sent = True
        if not self.done:
            out.append(sse.DONE)
            self.done = True
        return out

