"""Replicas: which GPUs each vLLM server gets, and the memory readings a recycle's strategy is
chosen from.

GPUs: `[server] gpus` (or `--gpus 0,1`) lists GPU indexes (as `nvidia-smi` numbers them) or
UUIDs; every `tensor_parallel_size` of them make one replica, whose generations get
`CUDA_VISIBLE_DEVICES=<their UUIDs>` (the one GPU-index rule, `core.gpu.select_gpus`). Without
a GPU list, `[server] replicas = N` starts N servers with the runtime's own environment (CPU, or
several small servers sharing one GPU).

Rolling (`machine.rolling`): a replica begins a recycle only when no other replica is recycling
and every other replica serves; otherwise it keeps serving (past its count limit) until its
turn. A crashed or hung replica is restarted at once, whatever the others do: that is a
failure, not a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from vllm_guard.core import plugin
from vllm_guard.core.config import ConfigError, GuardConfig
from vllm_guard.core.gpu import capped_total_mb, select_gpus, visible_uuids
from vllm_guard.core.host import host_memory
from vllm_guard.core.protocol import MemoryReading, Role
from vllm_guard.core.vllm_api import arg_value
from vllm_guard.core.weightfiles import weights_bytes

from .strategy import MemoryFit

DEFAULT_GPU_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    gpus: list[str] = field(default_factory=list)  # UUIDs; empty: the runtime's own environment

    def env(self) -> dict[str, str]:
        """What this replica's generations get on top of the runtime's environment."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}


def plan(cfg: GuardConfig, static: Sequence[Mapping[str, Any]], env: Mapping[str, str]) -> list[ReplicaPlan]:
    """The replicas to run; ConfigError (one line naming the key) when the settings disagree."""
    s = cfg.server
    explicit = "replicas" in cfg.explicit.get("server", frozenset())
    if not s.gpus:
        return [ReplicaPlan(i) for i in range(s.replicas)]
    if not static:
        raise ConfigError(f"[server] gpus has value {s.gpus!r}: NVML sees no GPU on this machine")
    try:
        uuids = select_gpus(static, s.gpus, env)
    except ValueError as e:
        raise ConfigError(f"[server] gpus has value {s.gpus!r}: {e}") from e
    tp = plugin.tensor_parallel_size(s.vllm_args)
    if len(uuids) % tp:
        raise ConfigError(f"[server] gpus has value {s.gpus!r}: {len(uuids)} GPUs do not split into groups of "
                          f"--tensor-parallel-size {tp}")
    groups = [uuids[i:i + tp] for i in range(0, len(uuids), tp)]
    if explicit and s.replicas != len(groups):
        raise ConfigError(f"[server] replicas has value {s.replicas!r}: [server] gpus {s.gpus!r} with "
                          f"--tensor-parallel-size {tp} makes {len(groups)}")
    return [ReplicaPlan(i, g) for i, g in enumerate(groups)]


# -- the readings a strategy is chosen from ----------------------------------------------------
def gpu_utilization(vllm_args: Sequence[str]) -> float:
    text = arg_value(vllm_args, "--gpu-memory-utilization")
    try:
        return float(text) if text is not None else DEFAULT_GPU_UTILIZATION
    except ValueError:
        return DEFAULT_GPU_UTILIZATION


HOLDER_CONTEXT_MB = 1024.0  # the holder's CUDA context and slack


def holder_room(vllm_args: Sequence[str], model: str, gpu_total_mb: float | None) -> str | None:
    """Why `hold_weights = "auto"` keeps no holder on this GPU, or None: vLLM's start check wants
    `--gpu-memory-utilization` x total free, and the held weights are another process's memory,
    so what the utilization leaves must hold them (vLLM's default 0.9 leaves too little)."""
    weights = weights_bytes(model) / 2**20
    if gpu_total_mb is None or weights <= 0:
        return "the GPU's total memory or the model's size is unknown"
    util = gpu_utilization(vllm_args)
    if (1 - util) * gpu_total_mb < weights + HOLDER_CONTEXT_MB:
        return (f"--gpu-memory-utilization {util:g} leaves {(1 - util) * gpu_total_mb / 1024:.1f} GiB of "
                f"{gpu_total_mb / 1024:.1f} GiB: vLLM's start check would fail beside the held weights "
                f"({weights / 1024:.1f} GiB); lower it (with --kv-cache-memory-bytes) or set hold_weights = \"on\"")
    return None


def prestage_mb(cfg: GuardConfig, model: str) -> float:
    """Host RAM (MiB) a parked generation's prestaged weights hold: the model's safetensors, when
    `[server] prestage_weights = "on"` and vLLM would load them in its engine; else 0."""
    if cfg.server.prestage_weights != "on" or plugin.prestage_applies(cfg.server.vllm_args) is not None:
        return 0.0
    return weights_bytes(model) / 2**20


def memory_fit(cfg: GuardConfig, reading: MemoryReading | None, devices: Mapping[str, tuple[float, float]],
               uuids: Sequence[str], gate_unavailable: str | None, host_available_mb: float | None = None,
               prestaged_mb: float = 0.0) -> MemoryFit:
    """Readings for `strategy.choose`: the serving generation's `reading` (its processes), the
    GPUs `uuids` of its replica from `devices` ({uuid: (used, total)} MiB), the host's RAM;
    `prestaged_mb` (`prestage_mb`) is added to what a parked generation holds."""
    avail = host_memory()["mem_available_mb"] if host_available_mb is None else host_available_mb
    footprint = parked = None
    if reading is not None:
        uss = reading.uss_mb if reading.uss_mb else None
        footprint = uss if uss is not None else reading.rss_mb
        api = [p.rss_mb for p in reading.per_process if p.role is Role.API_SERVER]
        # the API server and an EngineCore, both fully imported (+ the weights it prestaged)
        parked = 2 * api[0] + prestaged_mb if api else None
    fit = MemoryFit(host_available_mb=avail, host_footprint_mb=footprint, parked_mb=parked,
                    margin_mb=cfg.server.overlap_margin_mb, late_margin_mb=cfg.server.late_gate_margin_mb,
                    gate_unavailable=gate_unavailable)
    mine = [devices[u] for u in uuids if u in devices]
    if not mine:
        return fit
    totals = [capped_total_mb(total, cfg.inject.gpu_cap_mb) for _, total in mine]
    util = gpu_utilization(cfg.server.vllm_args)
    per_gpu = None
    if reading is not None and reading.gpu_mb is not None:
        per_gpu = reading.gpu_mb / len(mine)
    return MemoryFit(
        host_available_mb=avail, host_footprint_mb=footprint, parked_mb=parked, margin_mb=fit.margin_mb,
        late_margin_mb=fit.late_margin_mb, gate_unavailable=gate_unavailable,
        gpu_free_mb=min(t - used for t, (used, _) in zip(totals, mine)), gpu_total_mb=min(totals),
        gpu_footprint_mb=per_gpu,
        vllm_free_mb=min(total - used for used, total in mine), vllm_needs_mb=max(util * total for _, total in mine),
    )


def start_fits(cfg: GuardConfig, devices: Mapping[str, tuple[float, float]], uuids: Sequence[str]) -> bool:
    """vLLM's own start check would pass on these GPUs: free >= gpu_memory_utilization x total."""
    util = gpu_utilization(cfg.server.vllm_args)
    return all(total - used >= util * total for u, (used, total) in devices.items() if u in uuids)


def replica_uuids(static: Sequence[Mapping[str, Any]], replica: ReplicaPlan, env: Mapping[str, str]) -> list[str]:
    """The GPUs a replica's generations see (all visible ones when it has no list of its own)."""
    return list(replica.gpus) if replica.gpus else visible_uuids(static, env)
