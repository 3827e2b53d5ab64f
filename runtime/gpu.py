"""NVML for the runtime: GPU name and per-process used memory, when a GPU exists.

The runtime only needs two answers from NVML: how much memory each of its children holds
(for the growth trigger) and whether an old generation's memory is gone before the next
starts. No NVML (a CPU box, a container without the driver) is a normal state, not an error.
"""

from __future__ import annotations

import os
import threading
from typing import Any

try:  # nvidia-ml-py
    import pynvml
except ImportError:  # pragma: no cover - base dependency, but be tolerant
    pynvml = None  # type: ignore[assignment]


class Nvml:
    """Thin, lazily initialised NVML session; every call degrades to 'unknown' on error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self.error = ""

    @property
    def available(self) -> bool:
        if self._ok is None:
            with self._lock:
                if self._ok is None:
                    self._ok = self._init()
        return bool(self._ok)

    def _init(self) -> bool:
        if pynvml is None:
            self.error = "nvidia-ml-py is not installed"
            return False
        try:
            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetCount() > 0
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.error = f"NVML unavailable: {e}"
            return False

    def _handles(self) -> list[Any]:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def gpu_names(self) -> list[str]:
        if not self.available:
            return []
        try:
            return [str(pynvml.nvmlDeviceGetName(h)) for h in self._handles()]
        except Exception:
            return []

    def process_memory_mb(self) -> dict[int, float]:
        """Used GPU memory per pid (MiB), summed over GPUs; {} without NVML."""
        if not self.available:
            return {}
        out: dict[int, float] = {}
        try:
            for h in self._handles():
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    used = p.usedGpuMemory or 0
                    out[int(p.pid)] = out.get(int(p.pid), 0.0) + used / 2**20
        except Exception:
            return out
        return out


def visible_gpu_name(nvml: Nvml) -> str:
    """Name of the GPU(s) the child will see, for the ledger ('' on CPU)."""
    names = nvml.gpu_names()
    if not names:
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        idx = [int(x) for x in visible.split(",") if x.strip().isdigit() and int(x) < len(names)]
        if idx:
            names = [names[i] for i in idx]
    return names[0] if len(set(names)) == 1 else ",".join(names)
