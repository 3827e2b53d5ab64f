"""idle-release: give memory back once per idle period, from a side thread, never per request.

An idle period starts when the process's activity counter stops moving and nothing is in
flight; after `after` seconds of it we run `gc.collect()`, `malloc_trim(0)` (glibc; gc alone
rarely lowers RSS) and, where this process holds the CUDA caching allocator,
`torch.cuda.empty_cache()`. Activity starts a new period. Bytes released are measured (RSS, and
the allocator's reserved bytes on CUDA) and published as an event.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import sys
import threading
import time
from typing import Any, Callable

from .report import Channel

log = logging.getLogger("vllm.vllm_guard.idle")
POLL_S = 0.2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def cuda_reserved() -> int | None:
    """Reserved bytes of this process's CUDA caching allocator, None if it holds none."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_reserved())


def release(trim: bool = True) -> dict[str, Any]:
    """One release; returns what it measured."""
    t0 = time.monotonic()
    rss0, cuda0 = rss_bytes(), cuda_reserved()
    collected = gc.collect()
    trimmed = malloc_trim() if trim else False
    if cuda0 is not None:
        sys.modules["torch"].cuda.empty_cache()
    rss1, cuda1 = rss_bytes(), cuda_reserved()
    out: dict[str, Any] = {"rss_before": rss0, "rss_after": rss1, "gc_collected": collected,
                           "malloc_trim": trimmed, "seconds": round(time.monotonic() - t0, 4)}
    if cuda0 is not None and cuda1 is not None:
        out.update(cuda_reserved_before=cuda0, cuda_reserved_after=cuda1)
        out["released_bytes"] = max(0, cuda0 - cuda1) + max(0, rss0 - rss1)
    else:
        out["released_bytes"] = max(0, rss0 - rss1)
    return out


class IdleReleaser(threading.Thread):
    """Watches `epoch()` and `busy()`; releases once when both stay quiet for `after` seconds."""

    def __init__(self, after: float, epoch: Callable[[], int], busy: Callable[[], bool],
                 channel: Channel, role: str, trim: bool, on_change: Callable[[], None]) -> None:
        super().__init__(name="vllm-guard-idle-release", daemon=True)
        self.after = after
        self.epoch = epoch
        self.busy = busy
        self.channel = channel
        self.role = role
        self.trim = trim
        self.on_change = on_change
        self.releases = 0
        self.released_bytes = 0
        self.last: dict[str, Any] = {}
        self._stop_evt = threading.Event()

    def run(self) -> None:
        seen: int | None = None
        since = time.monotonic()
        done = False
        while not self._stop_evt.wait(POLL_S):
            try:
                e, busy = self.epoch(), self.busy()
            except Exception:  # noqa: BLE001 - read racing the engine thread: try again next tick
                continue
            now = time.monotonic()
            if busy or e != seen:
                seen, since, done = (None if busy else e), now, False
                continue
            if not done and now - since >= self.after:
                done = True
                self._release(e)

    def _release(self, epoch: int) -> None:
        try:
            out = release(self.trim)
        except Exception:  # noqa: BLE001
            log.exception("vllm-guard idle-release failed")
            return
        self.releases += 1
        self.released_bytes += out["released_bytes"]
        self.last = {**out, "epoch": epoch}
        log.info("vllm-guard idle-release (%s): %d bytes released", self.role, out["released_bytes"])
        self.channel.event({"event": "idle_release", "role": self.role, "epoch": epoch, **out})
        self.on_change()

    def stop(self) -> None:
        self._stop_evt.set()

    def summary(self) -> dict[str, Any]:
        return {"after_s": self.after, "releases": self.releases, "released_bytes": self.released_bytes,
                "last": self.last}
