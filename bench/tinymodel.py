"""The model a bench script serves when given none: `--model`, else `$VLLM_GUARD_TINY_MODEL`,
else the embedded tiny model (`vllm-guard model tiny`), built on the fly into a temporary dir,
so every script runs from a fresh clone with no path of another machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
GUARD = [str(BIN / "vllm-guard")] if (BIN / "vllm-guard").exists() else [sys.executable, "-m", "vllm_guard.cli"]


def tiny_model(given: str | None = None) -> str:
    """A model directory to serve: `given`, the environment's, or a fresh tiny model."""
    if given:
        return given
    pre = os.environ.get("VLLM_GUARD_TINY_MODEL")
    if pre and Path(pre, "config.json").is_file():
        return pre
    out = Path(tempfile.mkdtemp(prefix="vllm-guard-tiny-")) / "model"
    print(f"building the embedded tiny model in {out} (random weights: its text is noise)", file=sys.stderr,
          flush=True)
    subprocess.run([*GUARD, "model", "tiny", str(out)], check=True, capture_output=True)
    return str(out)
