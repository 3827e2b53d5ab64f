"""Admission: what one request and one client may ask of the engine, decided once per client
request from its body, before it is queued or sent.

Why: vLLM bounds a request only by the context, and `n` by `VLLM_MAX_N_SEQUENCES` (16 384).
`{"n": 64, "max_tokens": 4000, "ignore_eos": true}` is accepted and keeps 64 sequences (~256 000
tokens) running while every other request queues behind them; nothing stops one client from
sending many. So the proxy reads the fields vLLM 0.32 reads (completions: `prompt`, `n`,
`max_tokens`, default 16; chat: `n`, `max_completion_tokens` before `max_tokens`; responses:
`max_output_tokens`; messages: `max_tokens`; `best_of` where an older vLLM has it; beams count
as sequences) with pydantic's lax integers, as vLLM does ("8", 8.0 and 8 are all 8), and bounds:

- `n` (and `best_of`) at most `max_n`;
- the tokens a sequence may generate at most `max_tokens` (when set): its own `max_tokens`, or
  when it gives none, vLLM's default: 16 for completions, else the rest of the context;
- the request's sequences (prompts x n) x those tokens at most `max_request_tokens`;
- per client, requests in flight and the tokens they ask for (429 with Retry-After).

The body is read with msgspec into only the fields above (everything else is skipped without
being built): a 32 MB body is one scan, not millions of Python objects on the event loop (the
standard `json` takes seconds over a body of 4 million token ids). Prompts of a batch are counted
on the raw bytes. A body msgspec refuses (NaN, UTF-16) is read with `json` when it is small.

The context is `--max-model-len`; a request that sets no `max_tokens` where the guard is not
told the context is charged `max_request_tokens` per sequence (one sequence always passes, more
must say how long they may run).

A client is its API key when vLLM demands keys and the request carries one of them (compared
by SHA-256, as vLLM does), else its peer address: invented keys do not make new clients.

Pure (no I/O, no clock): the proxy calls `Admission.admit` once per client request, never for
its internal retries or continuations, and `release` with what it got when that request ends.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec
from pydantic import TypeAdapter, ValidationError

from vllm_guard.core import vllm_api
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.protocol import RejectReason

# path -> (the fields that give a sequence's max tokens, first set wins; the default when none
# is: an int, or None for the rest of the context)
GENERATION: dict[str, tuple[tuple[str, ...], int | None]] = {
    "/v1/completions": (("max_tokens",), 16),
    "/v1/chat/completions": (("max_completion_tokens", "max_tokens"), None),
    "/v1/responses": (("max_output_tokens",), None),
    "/v1/messages": (("max_tokens",), None),
}
_INT: TypeAdapter[int] = TypeAdapter(int)
_FIELDS = ("n", "best_of", "max_tokens", "max_completion_tokens", "max_output_tokens")
_NULL = msgspec.Raw(b"null")
FALLBACK_MAX = 1 << 20  # a body msgspec refuses is read with `json` up to this size
_SCALAR_MAX = 64  # bytes of JSON an integer field may take ("  12 ", 1e3, "8"); more is not a count


class _Body(msgspec.Struct):
    """The top-level fields admission reads, raw; every other field is skipped unbuilt."""

    n: msgspec.Raw = _NULL
    best_of: msgspec.Raw = _NULL
    max_tokens: msgspec.Raw = _NULL
    max_completion_tokens: msgspec.Raw = _NULL
    max_output_tokens: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL


_DECODER = msgspec.json.Decoder(_Body)


@dataclass(frozen=True)
class Limits:
    max_n: int
    max_tokens: int = 0  # 0: off
    max_request_tokens: int = 0
    max_client_requests: int = 0
    max_client_tokens: int = 0
    context: int | None = None  # --max-model-len; None: not given
    key_hashes: frozenset[bytes] = frozenset()  # SHA-256 of the keys vLLM accepts

    @classmethod
    def of(cls, cfg: ServerConfig, env: Mapping[str, str]) -> Limits:
        keys = vllm_api.api_keys(cfg.vllm_args, env)
        return cls(max_n=cfg.max_n, max_tokens=cfg.max_tokens, max_request_tokens=cfg.max_request_tokens,
                   max_client_requests=cfg.max_client_requests, max_client_tokens=cfg.max_client_tokens,
                   context=vllm_api.context_length(cfg.vllm_args),
                   key_hashes=frozenset(hashlib.sha256(k.encode()).digest() for k in keys))

    @property
    def unset_tokens(self) -> int:
        """What a sequence that sets no max_tokens may generate, as far as the guard knows."""
        return self.context or self.max_request_tokens


@dataclass(frozen=True)
class Refusal:
    """One refusal: its status, reason and message (the proxy answers it in OpenAI's shape)."""

    status: int
    reason: RejectReason
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Ask:
    """What a request asks the engine for."""

    sequences: int  # prompts x n (or best_of, or beams)
    per_sequence: int  # tokens each may generate: its max_tokens, or the default
    given: bool  # the request set max_tokens itself

    @property
    def tokens(self) -> int:
        return self.sequences * self.per_sequence


@dataclass(frozen=True)
class Pass:
    """An admitted client request: what `release` gives back when it ends."""

    client: str
    tokens: int


def _int_field(obj: Mapping[str, Any], name: str) -> int | None | Refusal:
    value = obj.get(name)
    if value is None:
        return None
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return Refusal(400, RejectReason.BAD_REQUEST, f"{name} has value {str(value)[:40]!r}: not an integer", name)


def _raw_prompts(raw: bytes) -> int:
    """Prompts in a raw, valid JSON `prompt`, counted on its bytes: a list of strings is that many
    (quotes not escaped, halved: escaped backslashes go first, as a JSON reader takes them), a
    list of token lists is at most its inner `[`s; a string or a list of token ids is one."""
    head = raw.lstrip()
    if not head.startswith(b"["):
        return 1
    first = head[1:].lstrip()[:1]
    if first == b'"':
        if b"\\" not in raw:
            return max(1, raw.count(b'"') // 2)
        plain = raw.replace(b"\\\\", b"")
        return max(1, (plain.count(b'"') - plain.count(b'\\"')) // 2)
    if first == b"[":
        return max(1, raw.count(b"[") - 1)
    return 1


def _py_prompts(p: Any) -> int:
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        return len(p)
    return 1


def _fields(body: bytes) -> tuple[dict[str, Any], int] | Refusal:
    """The fields admission reads (as JSON values) and the number of prompts; Refusal for a body
    that is not a JSON object."""
    try:
        b = _DECODER.decode(body[3:] if body.startswith(b"\xef\xbb\xbf") else body)
    except RecursionError:
        return Refusal(400, RejectReason.BAD_REQUEST, "the request body is nested too deeply")
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        if len(body) <= FALLBACK_MAX:  # what json (vLLM's reader) takes, msgspec may not: NaN, UTF-16
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
            else:
                if not isinstance(obj, dict):
                    return Refusal(400, RejectReason.BAD_REQUEST, "the request body is not a JSON object")
                return {k: obj.get(k) for k in _FIELDS}, _py_prompts(obj.get("prompt"))
        what = "not a JSON object" if isinstance(e, msgspec.ValidationError) else f"not JSON: {str(e)[:100]}"
        return Refusal(400, RejectReason.BAD_REQUEST, f"the request body is {what}")
    out: dict[str, Any] = {}
    for name in _FIELDS:
        raw = bytes(getattr(b, name))
        if len(raw) > _SCALAR_MAX:
            return Refusal(400, RejectReason.BAD_REQUEST, f"{name} has a value of {len(raw)} bytes: not an integer",
                           name)
        out[name] = json.loads(raw)
    return out, _raw_prompts(bytes(b.prompt))


def read(path: str, body: bytes, limits: Limits) -> Ask | Refusal | None:
    """What a generation request asks for, from its body; None: not a generation route (nothing
    to bound but the client's requests in flight); Refusal: a body vLLM could not run either."""
    route = GENERATION.get(path.rstrip("/"))
    if route is None:
        return None
    got = _fields(body)
    if isinstance(got, Refusal):
        return got
    obj, prompts = got
    seqs = []
    for name in ("n", "best_of"):
        v = _int_field(obj, name)
        if isinstance(v, Refusal):
            return v
        if v is not None and v > limits.max_n:
            return Refusal(400, RejectReason.N_TOO_LARGE, f"{name} has value {v}: at most {limits.max_n} "
                                                          "sequences per request here", name)
        seqs.append(v or 1)
    fields, default = route
    given: int | None = None
    for name in fields:
        v = _int_field(obj, name)
        if isinstance(v, Refusal):
            return v
        if v is not None:
            given = v
            break
    per = max(0, given) if given is not None else default if default is not None else limits.unset_tokens
    return Ask(sequences=max(1, max(seqs)) * (prompts if path.rstrip("/") == "/v1/completions" else 1),
               per_sequence=per, given=given is not None)


def check(ask: Ask, limits: Limits) -> Refusal | None:
    """The per-request bounds (400: retrying the same request never helps)."""
    if limits.max_tokens and ask.per_sequence > limits.max_tokens:
        if ask.given:
            why = f"max_tokens has value {ask.per_sequence}"
        else:
            why = f"max_tokens is not set, so a sequence may run {ask.per_sequence} tokens (the context)"
        return Refusal(400, RejectReason.MAX_TOKENS_TOO_LARGE, f"{why}: at most {limits.max_tokens} here",
                       "max_tokens")
    bound = min(b for b in (limits.max_request_tokens, limits.max_client_tokens, 1 << 62) if b)
    if ask.tokens > bound:
        unset = "" if ask.given else " (max_tokens not set: the context)"
        return Refusal(400, RejectReason.REQUEST_TOKENS_TOO_LARGE,
                       f"the request asks for {ask.sequences} sequences x {ask.per_sequence} tokens{unset} = "
                       f"{ask.tokens} tokens: at most {bound} per request here; lower n or max_tokens", "max_tokens")
    return None


def client_of(authorization: str | None, peer: str | None, key_hashes: frozenset[bytes]) -> str:
    """The client a request counts for: `key:<digest>` for one of vLLM's keys, else `addr:<peer>`."""
    if key_hashes and authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
            if digest in key_hashes:
                return "key:" + digest.hex()[:12]
    return f"addr:{peer or 'unknown'}"


@dataclass
class _InFlight:
    requests: int = 0
    tokens: int = 0


@dataclass
class Admission:
    """The bounds and, per client, what its admitted requests hold until they end."""

    limits: Limits
    clients: dict[str, _InFlight] = field(default_factory=dict)

    def admit(self, path: str, body: bytes, authorization: str | None, peer: str | None) -> Pass | Refusal:
        """Decide one client request: a Pass to give back at its end, or the refusal to answer."""
        ask = read(path, body, self.limits)
        if isinstance(ask, Refusal):
            return ask
        tokens = 0
        if ask is not None:
            refused = check(ask, self.limits)
            if refused is not None:
                return refused
            tokens = ask.tokens
        client = client_of(authorization, peer, self.limits.key_hashes)
        mine = self.clients.get(client, _InFlight())
        lim = self.limits
        if lim.max_client_requests and mine.requests >= lim.max_client_requests:
            return Refusal(429, RejectReason.CLIENT_REQUESTS, f"this client has {mine.requests} requests in "
                           f"progress: at most {lim.max_client_requests} here; retry when one has ended")
        if lim.max_client_tokens and mine.requests and mine.tokens + tokens > lim.max_client_tokens:
            return Refusal(429, RejectReason.CLIENT_TOKENS, f"this client's requests in progress ask for "
                           f"{mine.tokens} tokens, this one for {tokens}: at most {lim.max_client_tokens} "
                           "at once here; retry when one has ended")
        mine.requests += 1
        mine.tokens += tokens
        self.clients[client] = mine
        return Pass(client, tokens)

    def release(self, p: Pass) -> None:
        """The request `p` admitted has ended (whatever its outcome)."""
        mine = self.clients.get(p.client)
        if mine is None:
            return
        mine.requests -= 1
        mine.tokens -= p.tokens
        if mine.requests <= 0:
            del self.clients[p.client]
