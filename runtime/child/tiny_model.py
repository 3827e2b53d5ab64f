"""The embedded default model: a tiny Llama with random weights and a locally trained tokenizer.

Its output is noise. It exists so `serve`, the demo and the tests run real vLLM end to end on a
machine with no network and no model download. head_dim is 64 because vLLM's CPU attention
rejects 16. Building it needs torch, transformers and tokenizers (all come with vLLM); the
runtime runs this module in a child interpreter so the supervisor itself never imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MARKER = "vllm-guard-tiny.json"
SPEC: dict[str, Any] = {
    "name": "vllm-guard-tiny-llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 64
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 512,
    "seed": 0,
    "note": "random weights: the text this model generates is noise",
}


def default_dir() -> Path:
    """Where `serve` keeps the embedded model when no --model is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-guard" / "tiny-llama"


def is_built(out: Path) -> bool:
    return (out / MARKER).is_file() and (out / "config.json").is_file()


def build(out: Path) -> Path:
    """Build the model into `out` (idempotent; imports torch, so call it in a child)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = "the quick brown fox jumps over the lazy dog hello world how are you today".split()
    corpus = [" ".join(words[(i + j) % len(words)] for j in range(9)) + f" {i}" for i in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SPEC["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(str(out))
    settings: dict[str, Any] = {
        "vocab_size": len(fast), "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        **{k: SPEC[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "max_position_embeddings")},
    }
    cfg = LlamaConfig(**settings)
    torch.manual_seed(SPEC["seed"])
    model: Any = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps(SPEC, indent=2) + "\n")
    for f in out.iterdir():  # safetensors writes 0600: a dedicated service user must read it
        f.chmod(0o644)
    return out


def ensure(out: Path, python: str = sys.executable) -> Path:
    """Build the model in a child interpreter unless it is already there."""
    if is_built(out):
        return out
    proc = subprocess.run(
        [python, "-m", "vllm_guard.runtime.child.tiny_model", str(out)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not is_built(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"building the tiny model in {out} failed: {tail[0]}")
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir()
    build(target)
    print(f"tiny model built in {target} (random weights: its text is noise)")
