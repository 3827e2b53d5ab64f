"""A generation's start, phase by phase: the names the runtime records (`generations.start_phases`
in the ledger, `start_phases` in status) and what a start is doing once it has reached each.

One vocabulary for the runtime, which marks the phases (`runtime/child/anatomy.py`), and the
report, which reads them back (`report/tail.py`): the runtime's own milestones (spawned, parked
at the gate, gate opened, `/health` answered, the ready probe passed, the first request routed)
among vLLM's, read from the lines it logs (weights loaded, compile, KV cache, CUDA graphs, engine up).
"""

from __future__ import annotations

# the order a start goes through (the runtime's milestones among vLLM's)
ORDER = ("spawned", "parked", "gate_opened", "model_load_started", "weights_loaded", "compiled", "kv_allocated",
         "graphs_captured", "engine_up", "api_up", "health_ok", "ready", "first_request")
# what a start is doing once it has reached each phase (a start that dies says where it was)
UNDER_WAY = {
    "spawned": "starting vLLM", "parked": "parked at its startup gate", "gate_opened": "starting the engine",
    "model_load_started": "loading weights", "weights_loaded": "compiling and profiling",
    "compiled": "allocating the KV cache", "kv_allocated": "warming up", "graphs_captured": "warming up",
    "engine_up": "starting the API server", "api_up": "waiting for /health", "health_ok": "readiness probe",
    "ready": "going live", "first_request": "serving",
}
# a start's engine work, on the device it will serve from (the GPU; on vLLM-CPU the cores) beside
# whatever else computes there: from its weights (their load, or the first phase after it where the
# load is not logged) until its engine is up; vLLM's profile run ("compiling and profiling") and
# graph capture ("warming up") are in it. Before it: imports, the API server, a gate; after it:
# the API server and the runtime's probes.
ENGINE_WORK_FROM = ("model_load_started", "weights_loaded")
ENGINE_WORK_TO = "engine_up"


def engine_work(at: dict[str, float]) -> tuple[float, float] | None:
    """The span of a start's engine work, from its phases' times (any one clock); None when the
    start never reached its weights."""
    start = min((at[p] for p in ENGINE_WORK_FROM if p in at), default=None)
    if start is None:
        return None
    return start, at.get(ENGINE_WORK_TO, float("inf"))
