"""Which CPUs a generation's start may use while another generation of its replica serves.

A successor or a standby starts beside the serving engine: it imports torch and vLLM, creates its
CUDA context, loads the compiled artifact and captures its graphs. On a GPU box that is host work,
and Inductor's compile pool alone starts a worker per core. The serving engine's API server and
EngineCore are single busy threads on the same cores, so each of its requests waits longer for
its first token while a start runs beside it (on an H100 with a 7B model, TTFT p99 once grew by
half even in the start's import phase, before any model work on the GPU).

With `[server] start_cpus = "auto"` such a start runs on the last quarter of the runtime's CPUs,
so the serving engine's threads wake on cores nobody else wants. It gets every CPU back once nothing
serves beside it: at its gate, when it is told to stop pacing, or when it goes live. Affinity,
unlike a nice level, can be given back without privilege.

Auto leaves it off on vLLM-CPU, whose engine binds its own compute threads to cores, and where
the operator asked vLLM for its own binding (`--numa-bind`). Opt-in: on one H100 with the 7B
shape the overlap's TTFT p99 was no better with it (1.32x plain's, 1.14x without, one run each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

StartCpus = Literal["auto", "off"] | int

AUTO_MIN_CPUS = 8  # fewer: a quarter is one or two cores, too few for the start's own threads
AUTO_SHARE = 4  # auto gives the start 1/AUTO_SHARE of the runtime's CPUs
NUMA_BIND_FLAGS = ("--numa-bind", "--numa-bind-nodes", "--numa-bind-cpus")


@dataclass(frozen=True)
class StartCpuSet:
    """The CPUs a start beside a serving generation runs on (empty: all of the runtime's), and why."""

    cpus: tuple[int, ...]
    why: str


def start_cpus(setting: StartCpus, allowed: Sequence[int], gpu: bool, vllm_args: Sequence[str]) -> StartCpuSet:
    """The rule: `setting` is `[server] start_cpus`, `allowed` the runtime's own affinity, `gpu`
    whether the generations run on a GPU."""
    cpus = sorted(allowed)
    if setting == "off":
        return StartCpuSet((), "[server] start_cpus = \"off\"")
    if any(a == f or a.startswith(f + "=") for a in vllm_args for f in NUMA_BIND_FLAGS):
        return StartCpuSet((), "vLLM binds its own CPUs (--numa-bind)")
    if setting == "auto":
        if not gpu:
            return StartCpuSet((), "vLLM-CPU binds its engine's threads to cores itself")
        if len(cpus) < AUTO_MIN_CPUS:
            return StartCpuSet((), f"{len(cpus)} CPUs: fewer than {AUTO_MIN_CPUS}")
        n = len(cpus) // AUTO_SHARE
    else:
        n = int(setting)
        if n >= len(cpus):
            return StartCpuSet((), f"{n} of {len(cpus)} CPUs: all of them")
    return StartCpuSet(tuple(cpus[-n:]), f"{n} of the runtime's {len(cpus)} CPUs while another generation serves")
