"""kv-block-audit: at idle, every KV block but the null block must be free again.

Runs on the engine thread when it is about to wait for work and a request finished since the
last audit, so it costs nothing per token. Orphans are found from vLLM's own bookkeeping, not from
the injector: (1) `req_to_blocks` entries for request ids the scheduler no longer knows, freed
through `KVCacheCoordinator.free`; (2) blocks still holding a ref count with no request at all,
returned through `BlockPool.free_blocks`. Each reclaim is an event with the block ids.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .engine import HOOKS, install_idle_hook, install_scheduler_hooks
from .report import Channel

log = logging.getLogger("vllm.vllm_guard.audit")


def _pools(kvm: Any) -> list[Any]:
    pools = [kvm.block_pool]
    for m in kvm.coordinator.single_type_managers:
        if all(m.block_pool is not p for p in pools):
            pools.append(m.block_pool)
    return pools


def find_orphan_requests(sched: Any) -> dict[str, list[int]]:
    """{request_id: block ids} held in req_to_blocks for requests the scheduler no longer has."""
    live = sched.requests
    out: dict[str, list[int]] = {}
    for m in sched.kv_cache_manager.coordinator.single_type_managers:
        for rid, blocks in list(m.req_to_blocks.items()):
            if rid not in live:
                out.setdefault(rid, []).extend(b.block_id for b in blocks if not b.is_null)
    return out


def free_and_expected(kvm: Any) -> tuple[int, int]:
    pools = _pools(kvm)
    return sum(p.get_num_free_blocks() for p in pools), sum(p.num_gpu_blocks - 1 for p in pools)


class Audit:
    """Counts and (unless `reclaim` is off) frees orphaned blocks; publishes through `channel`."""

    def __init__(self, channel: Channel, reclaim: bool, on_change: Callable[[], None]) -> None:
        self.channel = channel
        self.reclaim = reclaim
        self.on_change = on_change
        self.seen_finished = -1
        self.runs = 0
        self.reclaimed_blocks = 0
        self.orphan_events = 0
        self.seconds = 0.0  # time spent auditing (engine thread, at idle)
        self.last: dict[str, Any] = {}

    def install(self) -> None:
        install_scheduler_hooks()
        install_idle_hook()
        HOOKS.on_idle.append(self.on_idle)

    def on_idle(self, engine: Any) -> None:
        if HOOKS.finished == self.seen_finished:
            return
        sched = engine.scheduler
        if sched.requests or getattr(sched, "deferred_frees", None):
            return  # not idle yet: live requests or frees waiting on an in-flight step
        self.seen_finished = HOOKS.finished
        t0 = time.perf_counter()
        self.run(sched)
        self.seconds += time.perf_counter() - t0

    def run(self, sched: Any) -> dict[str, Any]:
        kvm = sched.kv_cache_manager
        self.runs += 1
        free_before, expected = free_and_expected(kvm)
        orphans = find_orphan_requests(sched)
        ids: list[int] = [i for v in orphans.values() for i in v]
        ref_ids: list[int] = []
        if self.reclaim:
            for rid in orphans:
                kvm.coordinator.free(rid)
            if sum(p.get_num_free_blocks() for p in _pools(kvm)) < expected and not sched.requests:
                ref_ids = self._free_dangling_refs(kvm)
        free_after, _ = free_and_expected(kvm)
        self.last = {"free_before": free_before, "free_after": free_after, "expected_free": expected,
                     "usage_after": round(kvm.usage, 6), "orphan_requests": len(orphans),
                     "orphan_blocks": len(ids) + len(ref_ids)}
        if orphans or ref_ids:
            self.orphan_events += 1
            if self.reclaim:
                self.reclaimed_blocks += len(ids) + len(ref_ids)
            event = "orphans_reclaimed" if self.reclaim else "orphans_found"
            log.warning("vllm-guard kv-block-audit: %s %d blocks of %d requests %s (free %d -> %d of %d)",
                        event, len(ids) + len(ref_ids), len(orphans), sorted(ids + ref_ids),
                        free_before, free_after, expected)
            self.channel.event({"event": event, "block_ids": sorted(ids + ref_ids),
                                "requests": sorted(orphans), "ref_only_block_ids": sorted(ref_ids), **self.last})
        if orphans or ref_ids or self.runs % 50 == 1:
            self.on_change()  # the report file: not rewritten on every idle entry
        return self.last

    def _free_dangling_refs(self, kvm: Any) -> list[int]:
        """Blocks with ref counts but no owner at all (no request is live, so nothing may hold one)."""
        out: list[int] = []
        for pool in _pools(kvm):
            for b in pool.blocks:
                if b.is_null or b.ref_cnt <= 0:
                    continue
                out.append(b.block_id)
                pool.free_blocks([b] * b.ref_cnt)
        return out

    def summary(self) -> dict[str, Any]:
        return {"runs": self.runs, "orphan_events": self.orphan_events, "seconds": round(self.seconds, 6),
                "reclaimed_blocks": self.reclaimed_blocks, "last": self.last}
