"""block-ids-drain: empty the scheduler's list of newly allocated block ids when nothing reads it.

In vLLM releases between the KV-zeroing change and the upstream fix for vLLM #44175, every
full-attention KV cache manager appends the id of each block it allocates to `new_block_ids`, and
the scheduler drains that list only when the model needs KV zeroing (hybrid models with Mamba
layers). For every other model the list grows by one entry per allocated block, for the life of
EngineCore: host memory that `gc.collect()` and `malloc_trim` cannot give back, because the list
is alive. After each `Scheduler.schedule()` that did not drain it, we drain it and drop the ids:
no one else reads them. Versions that carry the fix (they record the ids only when zeroing is on)
are recognised by their shape and the patch is skipped there.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .engine import _wrap

log = logging.getLogger("vllm.vllm_guard.block_ids")


class BlockIdsDrain:
    """Wraps `Scheduler.schedule`; counts the ids it dropped."""

    def __init__(self) -> None:
        self.steps = 0
        self.drained = 0
        self.errors = 0

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        _wrap(Scheduler, "schedule", self._make)

    def _make(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        drain = self

        def schedule(sched: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(sched, *args, **kwargs)
            if not sched.needs_kv_cache_zeroing:  # vLLM drains (and uses) the ids itself otherwise
                drain.after_step(sched)
            return out
        return schedule

    def after_step(self, sched: Any) -> None:
        self.steps += 1
        try:
            self.drained += len(sched.kv_cache_manager.take_new_block_ids())
        except Exception:  # noqa: BLE001 - never break the engine loop; say so once
            self.errors += 1
            if self.errors == 1:
                log.exception("vllm-guard block-ids-drain failed; the list is left to vLLM")

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "drained_block_ids": self.drained, "errors": self.errors}
