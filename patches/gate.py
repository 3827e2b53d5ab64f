"""The startup gate, in a gated generation's EngineCore: park before CUDA until the runtime opens it.

A gated recycle starts the next generation while the old one still serves: its API server and
EngineCore import everything and shake hands (most of a cold start), then the EngineCore waits
here, in `register()`, which vLLM calls from `EngineCore.__init__` before it builds the
executor (the worker, the CUDA context, the weights). The runtime drains and stops the old
generation, waits until NVML shows its memory free, and opens the gate (`core.plugin`).

Only when the runtime asked (VLLM_GUARD_GATE) and only in EngineCore. If this process cannot
park safely (the patch is disabled, the vLLM is outside the verified range or shaped otherwise,
or CUDA is already initialized here), it says so at the gate and exits: it must never go on to
allocate GPU memory beside a generation that still holds it. The runtime then recycles cold. A
gate that is not opened within VLLM_GUARD_GATE_TIMEOUT (the runtime died) ends the process too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

from vllm_guard.core import plugin as contract
from vllm_guard.core.timefmt import utcnow

from .report import write_json_atomic

log = logging.getLogger("vllm.vllm_guard.gate")

EXIT_GATE = 75  # EX_TEMPFAIL: this generation cannot go on; the runtime starts another
POLL_S = 0.05
DEFAULT_TIMEOUT_S = 600.0


def requested(env: Mapping[str, str] = os.environ) -> Path | None:
    text = env.get(contract.GATE_VAR, "").strip()
    return Path(text) if text else None


def timeout_s(env: Mapping[str, str] = os.environ) -> float:
    try:
        return max(1.0, float(env.get(contract.GATE_TIMEOUT_VAR, "")))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def cuda_initialized() -> bool:
    """Whether this process already has a CUDA context (parking would hold GPU memory)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a CPU build may not even have the call: no CUDA then
        return False


def caller() -> str:
    """The vLLM function that loaded the plugins (EngineCore.__init__ is the one verified)."""
    frames = [f for f in traceback.extract_stack() if "/vllm/" in f.filename and "/vllm/plugins/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('/vllm/', 1)[1]}:{f.lineno} {f.name}"


_NOTES: dict[str, Any] = {}  # said with every later state (what was prestaged before parking)


def note_prestage(record: dict[str, Any]) -> None:
    """What this engine staged before parking (`patches.prestage`): part of each state it writes."""
    _NOTES["prestage"] = record


def note_warm(record: dict[str, Any]) -> None:
    """What this engine imported before parking (`patches.warmstart`): part of each state it writes."""
    _NOTES["warm"] = record


def _say(gate: Path, state: str, version: str, reason: str = "", waited: float | None = None) -> None:
    data = {"state": state, "pid": os.getpid(), "at": utcnow(), "reason": reason, "vllm_version": version,
            "where": caller(), "waited_s": None if waited is None else round(waited, 3), **_NOTES}
    try:
        write_json_atomic(gate / contract.GATE_STATE, data)
    except OSError:
        log.exception("vllm-guard could not write its gate state to %s", gate)


def refuse(gate: Path, reason: str, version: str) -> None:
    """Cannot park safely here: say why at the gate and end this process (never go on)."""
    log.error("vllm-guard startup gate: cannot park (%s); exiting so the runtime recycles cold", reason)
    _say(gate, "skipped", version, reason)
    os._exit(EXIT_GATE)


def park(gate: Path, limit_s: float, version: str, poll_s: float = POLL_S, what: str = "before CUDA") -> float:
    """Wait until the runtime opens `gate`; returns the seconds waited. Exits the process when
    the gate stays shut past `limit_s` or the parent (the API server) is gone. `what`: where in
    the start it parks (before CUDA; or, late-gated, ready on the held KV cache)."""
    parent = os.getppid()
    start = time.monotonic()
    _NOTES["stage"] = what
    _say(gate, "parked", version)
    log.warning("vllm-guard startup gate: EngineCore pid %d parked (%s) at %s (up to %.0f s)",
                os.getpid(), what, gate, limit_s)
    while not contract.gate_is_open(gate):
        waited = time.monotonic() - start
        if waited > limit_s:
            log.error("vllm-guard startup gate: not opened within %.0f s; exiting", limit_s)
            _say(gate, "timed_out", version, f"not opened within {limit_s:.0f}s", waited)
            os._exit(EXIT_GATE)
        if os.getppid() != parent:
            _say(gate, "timed_out", version, "the API server is gone", waited)
            os._exit(EXIT_GATE)
        time.sleep(poll_s)
    waited = time.monotonic() - start
    _say(gate, "opened", version, waited=waited)
    log.warning("vllm-guard startup gate: opened after %.1f s; EngineCore goes on", waited)
    return waited
