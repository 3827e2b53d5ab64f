"""The admission rules as pure functions (milliseconds): what a body asks for, the bounds, who the
client is, the per-client ledger; the config's cross-key rules; vLLM's own cap in the child's
environment. The proxy applying them on a real socket is in test_faults_proxy.py, against real
vLLM in test_bounds.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_guard.core import config as C
from vllm_guard.core.errors import ConfigError
from vllm_guard.core.protocol import RejectReason as R
from vllm_guard.core.vllm_api import api_keys, context_length
from vllm_guard.runtime.child.backend import child_env
from vllm_guard.runtime.frontdoor.admission import Admission, Ask, Limits, Pass, Refusal, check, client_of, read

LIM = Limits(max_n=16, max_request_tokens=32768, max_client_requests=3, max_client_tokens=40000, context=4096)


def ask(path: str, body: object, lim: Limits = LIM) -> Ask | Refusal | None:
    return read(path, json.dumps(body).encode(), lim)


def test_what_a_request_asks_for_is_read_as_vllm_reads_it() -> None:
    assert ask("/v1/completions", {"prompt": "x"}) == Ask(1, 16, False)  # vLLM's default max_tokens
    assert ask("/v1/completions", {"prompt": "x", "n": "4", "max_tokens": 100.0}) == Ask(4, 100, True)
    assert ask("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 10}) == Ask(4, 10, True)
    assert ask("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10}) == Ask(1, 10, True)  # token ids: one
    assert ask("/v1/completions", {"prompt": "x", "n": 2, "best_of": 5, "max_tokens": 1}) == Ask(5, 1, True)
    assert ask("/v1/chat/completions", {"messages": [], "n": None}) == Ask(1, 4096, False)  # the context
    assert ask("/v1/chat/completions", {"messages": [], "max_completion_tokens": 7, "max_tokens": 9}) == Ask(1, 7, True)
    assert ask("/v1/responses", {"input": "x", "max_output_tokens": 50}) == Ask(1, 50, True)
    assert ask("/v1/messages", {"messages": [], "max_tokens": 30}) == Ask(1, 30, True)
    assert ask("/v1/embeddings", {"input": "x"}) is None  # nothing generated: only in-flight counts
    # the guard does not know the context: a sequence without max_tokens counts max_request_tokens
    assert ask("/v1/chat/completions", {"messages": []}, Limits(max_n=16, max_request_tokens=32768)) == Ask(1, 32768, False)


@pytest.mark.parametrize("body, reason, param", [
    (b"{", R.BAD_REQUEST, None),
    (b"\xff\xfe", R.BAD_REQUEST, None),
    (b'"x"', R.BAD_REQUEST, None),
    (b'{"n": 2.5}', R.BAD_REQUEST, "n"),
    (b'{"max_tokens": [1]}', R.BAD_REQUEST, "max_tokens"),
    (b'{"n": 17}', R.N_TOO_LARGE, "n"),
    (b'{"n": "64", "max_tokens": 4000}', R.N_TOO_LARGE, "n"),
])
def test_a_body_that_cannot_be_read_or_asks_too_many_sequences_is_refused(body: bytes, reason: R,
                                                                         param: str | None) -> None:
    r = read("/v1/completions", body, LIM)
    assert isinstance(r, Refusal) and r.status == 400 and r.reason is reason and r.param == param, r


def test_the_per_request_bounds() -> None:
    assert check(Ask(8, 4096, True), LIM) is None  # 32768: at the bound
    r = check(Ask(16, 4000, True), LIM)
    assert r is not None and r.reason is R.REQUEST_TOKENS_TOO_LARGE and "16 sequences x 4000 tokens" in r.message
    r = check(Ask(9, 4096, False), LIM)
    assert r is not None and "max_tokens not set: the context" in r.message
    capped = Limits(max_n=16, max_tokens=1024, context=4096)
    assert check(Ask(1, 1024, True), capped) is None
    r = check(Ask(1, 4096, False), capped)  # not set: it may run the whole context
    assert r is not None and r.reason is R.MAX_TOKENS_TOO_LARGE and "not set" in r.message
    # off (0) everywhere: only n is bounded
    assert check(Ask(16, 10**9, True), Limits(max_n=16)) is None
    # no per-request bound but a per-client one: a request that could never fit is a 400, not a 429 forever
    r = check(Ask(1, 50_000, True), Limits(max_n=16, max_client_tokens=40_000))
    assert r is not None and r.status == 400


def test_a_client_is_one_of_vllms_keys_else_its_address() -> None:
    import hashlib

    keys = frozenset({hashlib.sha256(b"k1").digest()})
    assert client_of("Bearer k1", "10.0.0.1", keys).startswith("key:")
    assert client_of("bearer k1", "10.0.0.2", keys) == client_of("Bearer k1", "10.0.0.1", keys)
    assert client_of("Bearer invented", "10.0.0.1", keys) == "addr:10.0.0.1"
    assert client_of("Bearer k1", "10.0.0.1", frozenset()) == "addr:10.0.0.1"  # vLLM demands no key
    assert client_of(None, None, keys) == "addr:unknown"
    assert "k1" not in client_of("Bearer k1", "10.0.0.1", keys)


def test_the_client_ledger_bounds_requests_and_tokens_and_gives_back() -> None:
    a = Admission(LIM)
    body = json.dumps({"prompt": "x", "max_tokens": 16000}).encode()
    p1 = a.admit("/v1/completions", body, None, "1.1.1.1")
    p2 = a.admit("/v1/completions", body, None, "1.1.1.1")
    assert isinstance(p1, Pass) and isinstance(p2, Pass) and a.clients["addr:1.1.1.1"].tokens == 32000
    r = a.admit("/v1/completions", body, None, "1.1.1.1")  # 48000 > 40000
    assert isinstance(r, Refusal) and r.status == 429 and r.reason is R.CLIENT_TOKENS
    assert isinstance(a.admit("/v1/completions", body, None, "2.2.2.2"), Pass)  # another client
    small = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    p3 = a.admit("/v1/embeddings", b"not even json", None, "1.1.1.1")  # not generated: in flight only
    assert isinstance(p3, Pass) and p3.tokens == 0
    r = a.admit("/v1/completions", small, None, "1.1.1.1")
    assert isinstance(r, Refusal) and r.reason is R.CLIENT_REQUESTS
    for p in (p1, p2, p3):
        a.release(p)
    assert "addr:1.1.1.1" not in a.clients  # nothing held: forgotten (memory stays bounded)
    assert isinstance(a.admit("/v1/completions", small, None, "1.1.1.1"), Pass)


def test_the_context_and_the_keys_are_read_as_vllm_reads_its_arguments() -> None:
    assert context_length(["--max-model-len", "4096"]) == 4096
    assert context_length(["--max-model-len=4k"]) == 4000 and context_length(["--max-model-len", "4K"]) == 4096
    assert context_length(["--max-model-len", "auto"]) is None and context_length([]) is None
    assert context_length(["--max-model-len", "1.5K"]) is None  # vLLM refuses it too
    assert api_keys(["--api-key", "a", "b", "--enforce-eager"], {}) == {"a", "b"}
    assert api_keys(["--api-key=z"], {"VLLM_API_KEY": "e"}) == {"z"}  # the flag wins over the env
    assert api_keys([], {"VLLM_API_KEY": "e"}) == {"e"} and api_keys([], {}) == frozenset()


@pytest.mark.parametrize("toml, needle", [
    ("[server]\nmax_n = 0\n", "[server] max_n has value 0: must be >= 1"),
    ("[server]\nmax_n = 20000\n", "[server] max_n has value 20000: must be <= 16384"),
    ("[server]\nmax_client_tokens = 1000\n", "[server] max_client_tokens has value 1000: less than max_request_tokens"),
    ("[server]\nvllm_args = ['--max-model-len', '65536']\n",
     "[server] max_request_tokens has value 32768: less than the context (--max-model-len 65536)"),
    ("[server]\nmax_tokens = -1\n", "[server] max_tokens has value -1"),
])
def test_admission_settings_that_cannot_work_are_one_line(tmp_path: Path, toml: str, needle: str) -> None:
    f = tmp_path / "guard.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as e:
        C.load(f)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_settings_that_work_load() -> None:
    cfg = C.from_data({"server": {"vllm_args": ["--max-model-len", "65536"], "max_request_tokens": 65536,
                                  "max_client_tokens": 0}})
    assert cfg.server.max_request_tokens == 65536
    C.from_data({"server": {"vllm_args": ["--max-model-len", "65536"], "max_tokens": 2048}})  # every sequence capped


def test_every_generation_gets_vllms_own_cap_on_n(tmp_path: Path) -> None:
    cfg = C.from_data({"server": {"max_n": 8}})
    env = child_env(cfg, tmp_path, 1, base={"VLLM_MAX_N_SEQUENCES": "99999", "PATH": "/bin"})
    assert env["VLLM_MAX_N_SEQUENCES"] == "8"  # the guard's bound and vLLM's never disagree


@pytest.mark.parametrize("raw, n", [
    (b'["a", "b\\"c", "d\\\\", "e\\\\\\"f"]', 4),  # escaped quotes and backslashes, as JSON reads them
    (b'["[", "]", ","]', 3),
    (b' [ "a" ]', 1),
    (b'[[1, 2], [3]]', 2),
    (b'[1, 2, 3]', 1),  # token ids: one prompt
    (b'"x"', 1),
])
def test_prompts_of_a_batch_are_counted_on_the_raw_bytes_as_json_reads_them(raw: bytes, n: int) -> None:
    body = b'{"prompt": ' + raw + b', "max_tokens": 1}'
    a = read("/v1/completions", body, LIM)
    assert isinstance(a, Ask) and a.sequences == n, a


@pytest.mark.parametrize("body, expect", [
    (b'{"prompt": "x", "temperature": NaN, "n": 3}', 3),  # json (vLLM's reader) takes NaN: so does the guard
    (b'\xef\xbb\xbf{"prompt": "x", "n": 3}', 3),  # a UTF-8 byte order mark
    (b'{"n": 1, "n": 5}', 5),  # the last of a repeated key, as json has it
    (b'{"\\u006e": 6}', 6),  # an escaped key is the key
])
def test_bodies_json_takes_are_read_as_json_reads_them(body: bytes, expect: int) -> None:
    a = read("/v1/completions", body, LIM)
    assert isinstance(a, Ask) and a.sequences == expect, a


@pytest.mark.parametrize("body", [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested beyond any reader
    b'{"n": [' + b"1," * 100 + b'1]}',  # a "count" of 200 bytes
])
def test_a_body_made_to_be_expensive_is_one_400(body: bytes) -> None:
    r = read("/v1/completions", body, LIM)
    assert isinstance(r, Refusal) and r.reason is R.BAD_REQUEST, r
