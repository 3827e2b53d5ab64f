"""add-request-abort: what `AsyncLLM.add_request` registered is aborted when the call does not return.

vLLM's API server registers a request with its `OutputProcessor` (the `RequestState`: prompt token
ids, prompt text, params, detokenizer state: hundreds of KB for a long prompt) before it sends the
request to EngineCore, and only a caller that got the output collector back can abort it later.
When `add_request` raises or is cancelled after that registration (an error while the request is
encoded for EngineCore; a cancellation at an await after it, vLLM #57061), the caller has nothing
to abort with, and the state stays in the API server for good.

The wrapper notes which internal ids were registered under the call's external request id before
the call; when the call does not return, it aborts the ones the call added: at once in this
process (that is the memory), and in EngineCore (so the engine does not generate for nobody; an
id EngineCore never got is ignored there). The original exception always propagates unchanged;
a failure of the clean-up itself is logged, never raised.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Callable

from .engine import _wrap
from .report import Channel

log = logging.getLogger("vllm.vllm_guard.cancel_leak")

EXPECTED_PARAMS = ("request_id", "prompt")  # positions 1 and 2 after self, as vLLM calls it


class ShapeMismatch(Exception):
    """`AsyncLLM.add_request` does not take the arguments where this wrapper looks for them."""


def _log_spaced(n: int) -> bool:
    """1, 2, 4, 8, ...: a storm of failures writes a bounded number of events."""
    return n > 0 and n & (n - 1) == 0


class AddRequestAbort:
    """The wrapper's state: counters for the report, the engine aborts still in flight."""

    def __init__(self, channel: Channel, on_change: Callable[[], None]) -> None:
        self.channel = channel
        self.on_change = on_change
        self.calls = 0
        self.failed_calls = 0  # add_request raised or was cancelled
        self.cancelled_calls = 0
        self.released = 0  # calls whose registered state was aborted here
        self.released_states = 0
        self.released_prompt_tokens = 0
        self.engine_aborts = 0
        self.last: dict[str, Any] = {}
        self._written = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._core_request: type | None = None

    def install(self) -> None:
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.async_llm import AsyncLLM

        names = [p for p in inspect.signature(AsyncLLM.add_request).parameters if p != "self"]
        if tuple(names[:2]) != EXPECTED_PARAMS:
            raise ShapeMismatch(f"AsyncLLM.add_request({', '.join(names)}): expected "
                                f"({', '.join(EXPECTED_PARAMS)}, ...) first")
        self._core_request = EngineCoreRequest
        _wrap(AsyncLLM, "add_request", self._make)

    def _make(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        guard = self

        async def add_request(llm: Any, *args: Any, **kwargs: Any) -> Any:
            guard.calls += 1
            ext = guard._external_id(args, kwargs)
            if ext is None:
                return await orig(llm, *args, **kwargs)
            before = tuple(llm.output_processor.external_req_ids.get(ext, ()))
            try:
                return await orig(llm, *args, **kwargs)
            except BaseException as e:
                guard._failed(llm, ext, before, e)
                raise
        return add_request

    def _external_id(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The id vLLM registers the request under; None for streaming input (not registered here)."""
        rid = args[0] if args else kwargs.get("request_id")
        prompt = args[1] if len(args) > 1 else kwargs.get("prompt")
        if self._core_request is not None and isinstance(prompt, self._core_request):
            rid = getattr(prompt, "request_id", None)  # vLLM uses the request's own id in this (deprecated) form
        elif inspect.isasyncgen(prompt):
            return None  # streaming input: registered later by a task the caller's abort covers
        return rid if isinstance(rid, str) else None

    def _failed(self, llm: Any, ext: str, before: tuple[str, ...], exc: BaseException) -> None:
        self.failed_calls += 1
        if isinstance(exc, asyncio.CancelledError):
            self.cancelled_calls += 1
        try:
            self._release(llm, ext, before, exc)
        except Exception:  # noqa: BLE001 - the clean-up must never replace vLLM's own error
            log.exception("vllm-guard add-request-abort could not release request %s", ext)

    def _release(self, llm: Any, ext: str, before: tuple[str, ...], exc: BaseException) -> None:
        op = llm.output_processor
        new = [rid for rid in op.external_req_ids.get(ext, ()) if rid not in before]
        if not new:
            return  # nothing registered by this call (it failed earlier): nothing leaks
        states = [op.request_states.get(rid) for rid in new]
        tokens = sum(len(getattr(s, "prompt_token_ids", None) or ()) for s in states if s is not None)
        parents = list(dict.fromkeys(p.request_id for s in states
                                     if (p := getattr(s, "parent_req", None)) is not None))
        freed = list(op.abort_requests(new, internal=True))
        if parents:  # n > 1: the parent entry goes too, once its children are gone
            freed += [r for r in op.abort_requests(parents, internal=True) if r not in freed]
        if freed and not llm.errored:
            self._abort_in_engine(llm, freed)
        self.released += 1
        self.released_states += len(new)
        self.released_prompt_tokens += tokens
        self.last = {"request_id": ext, "internal_ids": new, "cause": type(exc).__name__,
                     "prompt_tokens": tokens, "ts": time.time()}
        if _log_spaced(self.released):
            log.warning("vllm-guard add-request-abort: request %s failed in add_request (%s) after "
                        "registration; released its state (%d prompt tokens); %d so far",
                        ext, type(exc).__name__, tokens, self.released)
            self.channel.event({"event": "request_state_released", "count": self.released, **self.last})
        now = time.monotonic()
        if _log_spaced(self.released) or now - self._written >= 1.0:
            self._written = now
            self.on_change()

    def _abort_in_engine(self, llm: Any, ids: list[str]) -> None:
        """Send the abort from a task of its own: the caller is being cancelled or failing."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # closed outside the loop (process teardown): nothing left to stop
            return
        task = loop.create_task(llm.engine_core.abort_requests_async(ids))
        self._tasks.add(task)
        task.add_done_callback(self._aborted)
        self.engine_aborts += len(ids)

    def _aborted(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("vllm-guard add-request-abort: engine abort failed: %r", task.exception())

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "failed_calls": self.failed_calls, "cancelled_calls": self.cancelled_calls,
                "released": self.released, "released_states": self.released_states,
                "released_prompt_tokens": self.released_prompt_tokens, "engine_aborts": self.engine_aborts,
                "last": self.last}
