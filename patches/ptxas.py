"""triton-ptxas: every generation compiles and finds vLLM's Triton kernels with the same ptxas.

torch's inductor points Triton at the ptxas bundled with torch (`TRITON_PTXAS_PATH`; torch 2.11's
wheels, for one, ship it in `torch/bin`) the first time it compiles a Triton kernel
itself, that is only in a process that compiles the model. Triton keys its cache by the ptxas
version. So vLLM's own kernels (the sampler's top-k/top-p, compiled in vLLM's warm-up) were cached
under torch's ptxas by the generation that compiled the model, and looked up under Triton's own by
the next one, which loads the compiled model from vLLM's cache: it compiled them again, 9–14 s
after its gate on an H200. Applying torch's own choice when the plugin loads, before anything is
compiled, gives every generation the same key, whether it compiles the model or loads it.
"""

from __future__ import annotations

import os
import sys

VAR = "TRITON_PTXAS_PATH"


class NotNeeded(Exception):
    """Nothing differs between a process that compiles and one that does not; the reason why."""


def pin() -> str:
    """Apply torch's ptxas choice in this process now; the note for the process report."""
    if (given := os.environ.get(VAR)) is not None:
        raise NotNeeded(f"{VAR} is set in the environment ({given}): every process already uses it")
    torch = sys.modules.get("torch")
    if torch is None:
        raise NotNeeded("torch is not imported in this process (vLLM imports it before its plugins)")
    if getattr(torch.version, "cuda", None) is None:
        raise NotNeeded("not a CUDA build of torch: no Triton kernels for NVIDIA GPUs")
    try:
        from torch._inductor.runtime import compile_tasks
    except Exception as e:  # noqa: BLE001 - any failure: this torch has no such choice to mirror
        raise NotNeeded(f"torch's inductor runtime does not import: {type(e).__name__}: {e}") from e
    choose = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if not callable(choose):
        raise NotNeeded("this torch does not choose a ptxas for Triton: every process uses Triton's own")
    choose()
    path = os.environ.get(VAR)
    if path is None:
        raise NotNeeded("this torch bundles no ptxas: every process uses Triton's own")
    return f"{VAR}={path} from the start, as in a process that compiles the model"
