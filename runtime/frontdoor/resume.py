"""Streams that survive their backend: which requests can go on at another generation, and how.

A streaming completion or chat completion whose backend dies mid-way (EngineCore crashed or
was killed, the API server went down, the runtime killed a hung or restarted generation) goes
on at the next generation or another replica as a `/v1/completions` continuation: its prompt is
the token ids of the original prompt and of the text already generated, its parameters the
client's, except `max_tokens` (what is left, always explicit: the endpoint's default is 16) and
`min_tokens` (reduced by what was generated). The client sees one stream: the same id, no text
twice, none missing, usage over all parts, the finish reason of the last part.

What makes that exact (the rules checked against vLLM 0.25.1 and 0.32.0's sources):
- the proxy asks vLLM for the token ids of every chunk (`return_token_ids`; the prompt's come
  in the first chunk) and strips them from what the client gets unless it asked for them;
- vLLM holds streamed text back by the longest stop string minus one character, so at a crash
  the text lags the ids. The proxy turns that off (`include_stop_str_in_output`) and does the
  hold-back itself: it keeps the same number of characters unsent and cuts the stop string
  from the end when vLLM stops on one. A stop string that spans the seam (begun before the
  crash, completed by the continuation) is invisible to vLLM, which checks only the text it
  generated; the proxy finds it and ends the stream there;
- text that has not come out yet because its bytes end inside a character is not covered by
  the ids the proxy has: it resumes from the last id whose text came out (`detok.Coverage`).

Not resumable (they end with one error event if their backend dies mid-way): `n` > 1, several
prompts, logprobs, prompt_logprobs, echo, suffix, beam search, presence or frequency penalties
(vLLM counts them over the output tokens only: a continuation would count a different set),
bad_words, response_format / structured outputs / guided decoding, tools, image or audio
content, truncate_prompt_tokens, `spaces_between_special_tokens: false`, any field this module
does not know, and chat on a server with a reasoning or tool-call parser (its content is not
the raw text). Requests that got no byte yet, streaming or not, are simply sent again whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from .detok import BackendFacts

# What vLLM says when its engine is gone: an answer with one of these was not a real answer.
ENGINE_DEAD = (b"EngineDeadError", b"EngineCore encountered an issue", b"Engine loop has died")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# Copied to a continuation as the client sent them.
CARRIED = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "repetition_penalty",
    "skip_special_tokens", "logit_bias", "allowed_token_ids", "priority", "user", "cache_salt", "stream_options",
    "stream_interval", "session_id", "spaces_between_special_tokens",
})
# Set by this module (from the client's value).
HANDLED = frozenset({"prompt", "messages", "stream", "n", "max_tokens", "max_completion_tokens", "min_tokens",
                     "stop", "include_stop_str_in_output", "return_token_ids", "request_id"})
# Shape only the prompt (already in its token ids) or extras a continuation need not repeat.
PROMPT_ONLY = frozenset({
    "add_special_tokens", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "mm_processor_kwargs", "media_io_kwargs", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "return_prompt_text", "return_token_offsets", "length_penalty",
    "return_tokens_as_token_ids",
})
# Allowed only with their neutral values; the reason names what the field changes.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "echo"),
    "logprobs": ((False,), "logprobs"),
    "top_logprobs": ((0,), "logprobs"),
    "prompt_logprobs": ((), "prompt_logprobs"),
    "logprob_token_ids": ((), "logprobs"),
    "presence_penalty": ((0, 0.0), "a presence penalty (vLLM counts it over output tokens only)"),
    "frequency_penalty": ((0, 0.0), "a frequency penalty (vLLM counts it over output tokens only)"),
    "bad_words": (([],), "bad_words"),
    "response_format": (({"type": "text"},), "response_format (structured output)"),
    "structured_outputs": ((), "structured outputs"),
    "guided_json": ((), "guided decoding"), "guided_regex": ((), "guided decoding"),
    "guided_choice": ((), "guided decoding"), "guided_grammar": ((), "guided decoding"),
    "tools": (([],), "tools"),
    "tool_choice": (("none", "auto"), "a tool choice"),
    "use_beam_search": ((False,), "beam search"),
    "suffix": (("",), "suffix"),
    "prompt_embeds": ((), "prompt embeddings"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens"),
    "truncation_side": ((), "truncation_side"),
    "vllm_xargs": (({},), "vllm_xargs"),
    "thinking_token_budget": ((), "a thinking token budget"),
    "repetition_detection": ((), "repetition detection"),
    "watermarking": ((), "watermarking"),
    "kv_transfer_params": ((), "KV transfer"), "ec_transfer_params": ((), "encoder-cache transfer"),
    "return_mm_kwargs": ((False,), "multimodal outputs"), "mm_payload": (("tensors",), "multimodal payloads"),
    "routed_experts_prompt_start": ((0,), "routed experts"),
    "return_assistant_tokens_mask": ((False,), "the assistant tokens mask"),
}


def dumps(obj: Any) -> bytes:
    """JSON as vLLM writes it (pydantic: compact, UTF-8 kept; msgspec writes the same bytes,
    several times faster than the json module, which matters once per streamed chunk)."""
    return msgspec.json.encode(obj)


def engine_dead(data: bytes) -> bool:
    return any(m in data for m in ENGINE_DEAD)


@dataclass(frozen=True)
class Plan:
    """A resumable stream: what the client asked for, and the body the proxy sends instead."""

    kind: str  # COMPLETIONS or CHAT (what the client sees)
    body: bytes  # the original request as the proxy forwards it
    model: Any
    carried: dict[str, Any]
    client_ids: bool  # the client asked for token ids itself
    client_include_stop: bool
    stops: tuple[str, ...]
    max_tokens: int | None  # None: up to the model's length (chat without a limit)
    min_tokens: int
    skip_special_tokens: bool
    include_usage: bool
    window: int = 0  # how far back a stop string can begin: the longest one less one character
    hold: int = 0  # characters held back unsent, as vLLM would hold them without the proxy's rewrite


def plan(path: str, body: bytes, facts: BackendFacts, tokenizer_ready: bool) -> Plan | str | None:
    """A Plan for a stream that can be resumed; a reason (str) for one that cannot; None for a
    request that is not a stream of completions or chat (re-run whole if it fails)."""
    path = path.rstrip("/")
    if path not in (COMPLETIONS, CHAT):
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None  # vLLM answers it 400
    if not isinstance(req, dict) or req.get("stream") is not True:
        return None
    why = _refusal(path, req, facts)
    if why is not None:
        return why
    if not tokenizer_ready:
        return "the guard has no tokenizer to follow the stream with"
    return _plan(path, req)


def _refusal(path: str, req: dict[str, Any], facts: BackendFacts) -> str | None:
    if req.get("n") not in (None, 1):
        return "n > 1"
    if path == CHAT:
        if facts.reasoning_parser:
            return "chat on a server with a reasoning parser"
        if facts.tool_parser:
            return "chat on a server with a tool-call parser"
        msgs = req.get("messages")
        if not isinstance(msgs, list):
            return "messages is not a list"
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") in ("text", "input_text"))
                                                 for p in content):
                return "the messages carry other content than text"
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) and len(prompt) != 1:
            return "several prompts"
    for key, value in req.items():
        if key in CARRIED or key in HANDLED or key in PROMPT_ONLY or value is None:
            continue
        if key in NEUTRAL:
            allowed, what = NEUTRAL[key]
            if not any(type(value) is type(a) and value == a for a in allowed):
                return what
            continue
        return f"the field {key!r} (unknown to the guard's resumption)"
    if req.get("spaces_between_special_tokens") is False:
        return "spaces_between_special_tokens: false"
    stop = req.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        return "stop is not a string or a list"
    return None


def _plan(path: str, req: dict[str, Any]) -> Plan:
    stop = req.get("stop")
    stops = tuple(s for s in ([stop] if isinstance(stop, str) else (stop or [])) if isinstance(s, str) and s)
    client_ids = bool(req.get("return_token_ids"))
    client_include = bool(req.get("include_stop_str_in_output"))
    sent = dict(req)
    sent["return_token_ids"] = True
    if stops and not client_include:
        sent["include_stop_str_in_output"] = True  # vLLM holds back nothing; the proxy does
    if path == COMPLETIONS:
        limit = req.get("max_tokens")
        max_tokens: int | None = 16 if limit is None else int(limit)  # vLLM's default when absent or null
    else:
        limit = req.get("max_completion_tokens", req.get("max_tokens"))
        if limit is None:
            limit = req.get("max_tokens")
        max_tokens = None if limit is None else int(limit)
    opts = req.get("stream_options") or {}
    window = max((len(s) for s in stops), default=1) - 1
    return Plan(
        kind=path, body=dumps(sent), model=req.get("model"),
        carried={k: v for k, v in req.items() if k in CARRIED and v is not None},
        client_ids=client_ids, client_include_stop=client_include, stops=stops, max_tokens=max_tokens,
        min_tokens=int(req.get("min_tokens") or 0), skip_special_tokens=req.get("skip_special_tokens") is not False,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        window=window, hold=0 if client_include else window,
    )
