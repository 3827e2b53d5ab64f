"""vLLM's incremental detokenization, replayed by the proxy: which generated ids its text covers.

vLLM streams text only once the ids decode to whole characters: a character cut over several
byte tokens (a CJK character, an emoji, the random byte soup of a test model) is held back until
its last byte arrives. At a crash, the ids the proxy received can run ahead of the text it
received. A continuation that started from all the ids would make the next generation's
detokenizer begin inside a character (its first text comes out wrong: tokenizers 0.23 repeats
the whole prompt there); so the proxy resumes from the ids the text covers, and sends a client
that asked for token ids only ids whose text it has also sent.

To know that point, the proxy runs the same algorithm vLLM's `FastIncrementalDetokenizer` runs
(`vllm/v1/engine/detokenizer.py`, 0.25.1 and 0.32.0): a `tokenizers.decoders.DecodeStream`
primed with the prompt's ids, one `step` per generated id, text out when a step returns some.
It checks each chunk's text against vLLM's: a request whose text differs (another tokenizer, a
slow tokenizer, special-token handling vLLM adds) is not resumed, never resumed wrongly.

Where the tokenizer is: `--tokenizer` among the vLLM arguments, else the model; a directory with
a `tokenizer.json`, or a Hugging Face model id already in the local cache. `--tokenizer-mode`
other than auto/hf and `--skip-tokenizer-init` leave the proxy without one: streams are then
not resumable mid-way (requests that reached no client are still re-run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import structlog

from vllm_guard.core.vllm_api import arg_value

log = structlog.get_logger("vllm_guard.proxy")

INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' error vLLM recovers from (vLLM #17448)


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


@dataclass(frozen=True)
class BackendFacts:
    """What vLLM's arguments say about how it answers (the same for every generation)."""

    tokenizer: str  # a directory or a Hugging Face id
    tokenizer_revision: str | None
    tokenizer_usable: str | None  # None: a tokenizer.json can be looked for; else why not
    reasoning_parser: bool  # chat answers go through a reasoning parser: content is not the raw text
    tool_parser: bool


def facts_of(model: str, vllm_args: Sequence[str]) -> BackendFacts:
    tok = arg_value(vllm_args, "--tokenizer") or model
    mode = arg_value(vllm_args, "--tokenizer-mode") or "auto"
    why = None
    if has_flag(vllm_args, "--skip-tokenizer-init"):
        why = "vLLM runs with --skip-tokenizer-init"
    elif mode not in ("auto", "hf"):
        why = f"vLLM's --tokenizer-mode is {mode!r}"
    return BackendFacts(
        tokenizer=tok,
        tokenizer_revision=arg_value(vllm_args, "--tokenizer-revision") or arg_value(vllm_args, "--revision"),
        tokenizer_usable=why,
        reasoning_parser=bool(arg_value(vllm_args, "--reasoning-parser")),
        tool_parser=bool(arg_value(vllm_args, "--tool-call-parser")) or has_flag(vllm_args, "--enable-auto-tool-choice"),
    )


def tokenizer_file(facts: BackendFacts) -> Path | None:
    """The tokenizer.json vLLM loads, when it can be found without a network."""
    if facts.tokenizer_usable is not None or not facts.tokenizer:
        return None
    d = Path(facts.tokenizer).expanduser()
    if d.is_dir():
        f = d / "tokenizer.json"
        return f if f.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(facts.tokenizer, "tokenizer.json", revision=facts.tokenizer_revision,
                                       cache_dir=os.environ.get("HF_HUB_CACHE"))
    except Exception:  # noqa: BLE001 - not a repo id: no tokenizer to be found
        return None
    return Path(found) if isinstance(found, str) else None


def load(facts: BackendFacts) -> tuple[Any | None, str]:
    """(tokenizer, "") or (None, why not). Blocking: run it in a thread."""
    if facts.tokenizer_usable is not None:
        return None, facts.tokenizer_usable
    path = tokenizer_file(facts)
    if path is None:
        return None, f"no tokenizer.json found for {facts.tokenizer!r}"
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream

        tok = Tokenizer.from_file(str(path))
        DecodeStream(ids=[0], skip_special_tokens=True)  # tokenizers >= 0.22: primed streams, as vLLM uses
    except Exception as e:  # noqa: BLE001 - no tokenizer: streams are not resumed, requests still served
        return None, f"the tokenizer at {path} cannot be used: {type(e).__name__}: {e}"
    return tok, ""


class Coverage:
    """One stream's detokenization as vLLM does it: feed the ids of each chunk, get their text.

    `covered` counts the generated ids up to the last point where no bytes waited: the point a
    continuation can start from. An id whose step gave no text either waits for more bytes (part
    of a character) or has none to give (a skipped special token, an id the tokenizer does not
    know: a random-weight model with a borrowed tokenizer makes many); the second kind is covered,
    the first is not, and a continuation from `covered` generates it again.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tok = tokenizer
        self.skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self.fed = 0  # generated ids fed
        self.covered = 0
        self._waiting: list[int] = []  # ids since the last text

    def feed(self, ids: Sequence[int]) -> str:
        out = []
        for tid in ids:
            self.fed += 1
            piece = self._step(tid)
            if piece is not None:
                out.append(piece)
                self.covered, self._waiting = self.fed, []
                continue
            self._waiting.append(tid)
            if not self.tok.decode(self._waiting, skip_special_tokens=self.skip):
                self.covered, self._waiting = self.fed, []  # nothing of a character waits
        return "".join(out)

    def _step(self, tid: int) -> str | None:
        from tokenizers.decoders import DecodeStream

        try:
            piece: str | None = self._stream.step(self.tok, tid)
        except (OverflowError, TypeError):  # vLLM logs these and emits nothing (vLLM #21951)
            return None
        except Exception as e:
            if not str(e).startswith(INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip)  # vLLM's own recovery
            piece = self._stream.step(self.tok, tid)
        return piece
