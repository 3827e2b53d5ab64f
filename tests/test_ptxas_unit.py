"""The ptxas pin, each case in a fresh interpreter (the process environment and torch's cached
choice are the thing under test): a TRITON_PTXAS_PATH already set is kept; without torch, or with
torch's CPU build, nothing is pinned and the report says why; with torch's real choice function and
no ptxas bundled, nothing differs between processes, so nothing is pinned; where torch's choice sets
a ptxas (torch 2.11's wheels ship one), the process uses it from the plugin's load on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vllm_guard.patches import ptxas

PIN = """
import json, os, sys
from vllm_guard.patches import ptxas
{setup}
try:
    note = ptxas.pin()
    print(json.dumps({{"pinned": note, "env": os.environ.get(ptxas.VAR)}}))
except ptxas.NotNeeded as e:
    print(json.dumps({{"skipped": str(e), "env": os.environ.get(ptxas.VAR)}}))
"""


def pin_in_fresh_process(setup: str = "", env: dict[str, str] | None = None) -> dict[str, Any]:
    full = {k: v for k, v in os.environ.items() if k != ptxas.VAR} | (env or {})
    code = PIN.format(setup=textwrap.dedent(setup))
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_ptxas_set_in_the_environment_is_kept() -> None:
    got = pin_in_fresh_process(env={ptxas.VAR: "/opt/cuda/bin/ptxas"})
    assert got == {"skipped": f"{ptxas.VAR} is set in the environment (/opt/cuda/bin/ptxas): "
                              "every process already uses it", "env": "/opt/cuda/bin/ptxas"}


def test_without_torch_nothing_is_imported_or_pinned() -> None:
    got = pin_in_fresh_process(setup="assert 'torch' not in sys.modules")
    assert got["skipped"].startswith("torch is not imported in this process") and got["env"] is None


def test_a_cpu_build_of_torch_has_no_ptxas_to_pin() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    got = pin_in_fresh_process(setup="import torch")
    assert got == {"skipped": "not a CUDA build of torch: no Triton kernels for NVIDIA GPUs", "env": None}


def test_torch_that_bundles_no_ptxas_leaves_every_process_on_tritons_own() -> None:
    """torch's real choice function, on a build that reports CUDA: the torch here bundles no ptxas
    (as torch 2.12 and later), so it sets nothing, and every process agrees without a pin."""
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("torch._inductor.runtime.compile_tasks")
    if not callable(getattr(ct, "_set_triton_ptxas_path", None)):
        pytest.skip("this torch has no ptxas choice")
    bundled = [p for p in (Path(torch.__file__).parent / "bin" / "ptxas",
                           Path(torch.__file__).parent / "_inductor" / "bin" / "ptxas") if p.exists()]
    if bundled:
        pytest.skip(f"this torch bundles {bundled[0]}")
    got = pin_in_fresh_process(setup="import torch; torch.version.cuda = '13.0'")
    assert got == {"skipped": "this torch bundles no ptxas: every process uses Triton's own", "env": None}


def test_where_torch_chooses_its_ptxas_the_process_uses_it_from_the_start(tmp_path: Path) -> None:
    """The torch on the GPU box (2.11, CUDA 13) ships torch/bin/ptxas and sets it on its first own
    Triton compile; here its choice is played by a function that does exactly that."""
    pytest.importorskip("torch._inductor.runtime.compile_tasks")
    exe = tmp_path / "ptxas"
    exe.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    exe.chmod(0o755)
    got = pin_in_fresh_process(setup=f"""
        import torch
        from torch._inductor.runtime import compile_tasks
        torch.version.cuda = '13.0'
        compile_tasks._set_triton_ptxas_path = lambda: os.environ.setdefault(ptxas.VAR, {str(exe)!r})
    """)
    assert got == {"pinned": f"{ptxas.VAR}={exe} from the start, as in a process that compiles the model",
                   "env": str(exe)}
