"""Fault injection inside real vLLM processes (off unless `VLLM_GUARD_INJECT` / `[inject]` asks).

Counts are requests the engine finished, probes excluded (see `engine.is_probe`). Everything the
injector does is published to `inject.jsonl` (its own channel) and logged at WARNING, so tests
compare the guards against the injector's record instead of letting the guards read it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from vllm_guard.core.config import InjectConfig

from .engine import FATAL, HOOKS, install_init_device_hook, install_scheduler_hooks
from .report import Channel

log = logging.getLogger("vllm.vllm_guard.inject")
PAGE = 4096


def touched_buffer(nbytes: int) -> bytearray:
    """A host buffer whose every page is written, so it really is resident (RSS moves)."""
    buf = bytearray(nbytes)
    n_pages = (nbytes + PAGE - 1) // PAGE
    buf[::PAGE] = b"\x5a" * n_pages
    return buf


class Injector:
    """Engine-side faults; one per EngineCore process."""

    def __init__(self, spec: InjectConfig, channel: Channel) -> None:
        self.spec = spec
        self.channel = channel
        self.host: list[bytearray] = []
        self.device: list[Any] = []
        self.host_bytes = 0
        self.device_bytes = 0
        self.leaked_blocks = 0
        self.tripped = False

    def install(self) -> None:
        install_scheduler_hooks()
        HOOKS.on_finish.append(self.on_finish)
        HOOKS.on_add.append(self.on_add)
        HOOKS.on_skipped_free.append(self.on_skipped_free)
        log.warning("vllm-guard FAULT INJECTION active in EngineCore pid %d: %s", os.getpid(), self.spec.active)
        self.channel.inject({"event": "armed", "role": "engine_core", "spec": self.spec.active})

    def on_finish(self, sched: Any, request: Any, probe: bool) -> None:
        if probe:
            return
        n = HOOKS.counted
        s = self.spec
        if s.block_leak_every and n % s.block_leak_every == 0:
            HOOKS.skip_free.add(request.request_id)
        if s.host_leak_mb_per_request:
            buf = touched_buffer(int(s.host_leak_mb_per_request * 2**20))
            self.host.append(buf)
            self.host_bytes += len(buf)
        if s.device_leak_mb_per_request:
            self._device_leak(int(s.device_leak_mb_per_request * 2**20))
        self.channel.inject({"event": "request", "n": n, "request_id": request.request_id,
                             "host_bytes": self.host_bytes, "device_bytes": self.device_bytes})
        if s.host_leak_mb_per_request or s.device_leak_mb_per_request:
            if n % 100 == 0:
                log.warning("vllm-guard injected leak: %d requests, host %d B, device %d B",
                            n, self.host_bytes, self.device_bytes)

    def _device_leak(self, nbytes: int) -> None:
        """Retained where the CUDA allocator lives (this process with TP=1); host memory on CPU.

        A CUDA OOM here is the leak's real consequence: it is marked fatal so it propagates out
        of the scheduler and kills EngineCore, as an OOM inside vLLM's own step would."""
        import torch

        if torch.cuda.is_available():
            try:
                t = torch.ones(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
            except torch.OutOfMemoryError as e:
                setattr(e, FATAL, True)
                self.channel.inject({"event": "oom", "n": HOOKS.counted, "device_bytes": self.device_bytes,
                                     "error": str(e).splitlines()[0][:300]})
                log.error("vllm-guard injected device leak hit CUDA OOM after %d requests (%d B retained)",
                          HOOKS.counted, self.device_bytes)
                raise
        else:
            t = torch.ones(nbytes, dtype=torch.uint8)
        self.device.append(t)
        self.device_bytes += nbytes

    def on_skipped_free(self, sched: Any, request: Any) -> None:
        coord = sched.kv_cache_manager.coordinator
        ids = sorted({b.block_id for group in coord.get_blocks(request.request_id) for b in group if not b.is_null})
        self.leaked_blocks += len(ids)
        log.warning("vllm-guard injected block leak: request %s keeps blocks %s", request.request_id, ids)
        self.channel.inject({"event": "block_leak", "n": HOOKS.counted, "request_id": request.request_id,
                             "block_ids": ids})

    def on_add(self, sched: Any, request: Any) -> None:
        """Hang or crash on the first request that arrives after N finished ones (probes included)."""
        s = self.spec
        n = HOOKS.counted
        if s.crash_after_requests and n >= s.crash_after_requests:
            self.channel.inject({"event": "crash", "n": n})
            log.warning("vllm-guard injected CRASH after %d requests: SIGKILL pid %d", n, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        if s.hang_after_requests and n >= s.hang_after_requests and not self.tripped:
            self.tripped = True
            self.channel.inject({"event": "hang", "n": n})
            log.warning("vllm-guard injected HANG after %d requests: engine thread blocks forever", n)
            threading.Event().wait()

    def summary(self) -> dict[str, Any]:
        return {"spec": self.spec.active, "requests": HOOKS.counted, "host_bytes": self.host_bytes,
                "device_bytes": self.device_bytes, "leaked_blocks": self.leaked_blocks}


def install_gpu_budget(spec: InjectConfig, channel: Channel) -> None:
    """`torch.cuda.set_per_process_memory_fraction` once the worker's device is set."""

    def after(worker: Any) -> None:
        import torch

        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory
        fraction = min(1.0, spec.gpu_memory_budget_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
        log.warning("vllm-guard injected GPU budget: %.1f GiB of %.1f GiB (fraction %.4f) on cuda:%d",
                    spec.gpu_memory_budget_gib, total / 2**30, fraction, dev)
        channel.inject({"event": "gpu_budget", "gib": spec.gpu_memory_budget_gib, "fraction": fraction,
                        "total_bytes": total, "device": dev})

    install_init_device_hook(after)
