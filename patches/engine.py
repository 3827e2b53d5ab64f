"""Hooks inside vLLM's engine and worker classes, shared by the audit, idle-release and injector.

Each wrapper adds one Python call on the path it wraps and calls the original unchanged; a
failing listener is logged and never reaches vLLM, except an exception marked `FATAL` (the
injector's CUDA OOM), which must fail the engine the way a real leak's OOM does. Installed at most once per class (marker
attribute), because vLLM may load general plugins more than once in a process.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger("vllm.vllm_guard.patches")

MARK = "_vllm_guard_wrapped"
PROBE_MARK = "vllm-guard-probe"
PROBE_MAX_PROMPT_TOKENS = 8
FATAL = "vllm_guard_fatal"  # attribute on an exception that must reach vLLM (an injected fault)


def is_probe(request: Any) -> bool:
    """The runtime's liveness probe (1-token completion of a tiny prompt): never counted."""
    rid = str(getattr(request, "request_id", ""))
    if PROBE_MARK in rid:
        return True
    sp = getattr(request, "sampling_params", None)
    return (sp is not None and getattr(sp, "max_tokens", None) == 1
            and int(getattr(request, "num_prompt_tokens", 10**6)) <= PROBE_MAX_PROMPT_TOKENS)


class Activity:
    """Counters that change whenever the process works; read by the idle thread."""

    def __init__(self) -> None:
        self.epoch = 0
        self.ref: Callable[[], Any] = lambda: None  # weakref to the busy object (scheduler, ...)

    def touch(self, obj: Any = None) -> None:
        self.epoch += 1
        if obj is not None and self.ref() is None:
            self.ref = weakref.ref(obj)


class EngineHooks:
    """Listeners for the scheduler and engine loop (EngineCore process)."""

    def __init__(self) -> None:
        self.activity = Activity()
        self.finished = 0  # every finished request, probes included
        self.counted = 0  # finished requests that are not probes
        self.on_finish: list[Callable[[Any, Any, bool], None]] = []
        self.on_add: list[Callable[[Any, Any], None]] = []
        self.on_idle: list[Callable[[Any], None]] = []
        self.skip_free: set[str] = set()  # request ids whose block free the injector skips
        self.on_skipped_free: list[Callable[[Any, Any], None]] = []
        self.lock = threading.Lock()

    def _call(self, listeners: list[Callable[..., None]], *args: Any) -> None:
        for fn in listeners:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - a guard must never break serving
                if getattr(e, FATAL, False):
                    raise  # ... unless it is the fault the injector was asked to cause
                log.exception("vllm-guard listener %s failed", getattr(fn, "__name__", fn))

    def finished_request(self, sched: Any, request: Any) -> None:
        probe = is_probe(request)
        self.finished += 1
        if not probe:
            self.counted += 1
        self.activity.touch(sched)
        self._call(self.on_finish, sched, request, probe)

    def added_request(self, sched: Any, request: Any) -> None:
        self.activity.touch(sched)
        self._call(self.on_add, sched, request)

    def idle(self, engine: Any) -> None:
        self._call(self.on_idle, engine)


HOOKS = EngineHooks()


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig = getattr(cls, name)
    if getattr(orig, MARK, False):
        return
    new = make(orig)
    setattr(new, MARK, True)
    new.__wrapped__ = orig  # type: ignore[attr-defined]
    new.__name__ = getattr(orig, "__name__", name)
    setattr(cls, name, new)


def install_scheduler_hooks() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def free_request(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            HOOKS.finished_request(self, request)
            return orig(self, request, *args, **kwargs)
        return _free_request

    def free_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _free_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if HOOKS.skip_free and request.request_id in HOOKS.skip_free:
                HOOKS.skip_free.discard(request.request_id)
                HOOKS._call(HOOKS.on_skipped_free, self, request)
                del self.requests[request.request_id]  # forget the request, keep its blocks: a lost reference
                return None
            return orig(self, request, *args, **kwargs)
        return _free_blocks

    def add_request(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            HOOKS.added_request(self, request)
            return orig(self, request, *args, **kwargs)
        return _add_request

    _wrap(Scheduler, "_free_request", free_request)
    _wrap(Scheduler, "_free_blocks", free_blocks)
    _wrap(Scheduler, "add_request", add_request)


def install_idle_hook() -> None:
    """The engine thread calls `_notify_idle_state_callbacks` each time it is about to wait for work."""
    from vllm.v1.engine.core import EngineCoreProc

    def notify(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _notify_idle_state_callbacks(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, *args, **kwargs)
            HOOKS.idle(self)
            return out
        return _notify_idle_state_callbacks

    _wrap(EngineCoreProc, "_notify_idle_state_callbacks", notify)


API_ACTIVITY = Activity()
WORKER_ACTIVITY = Activity()


def install_api_hooks() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    def add(orig: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
            API_ACTIVITY.touch(self)
            return orig(self, *args, **kwargs)
        return add_request

    _wrap(OutputProcessor, "add_request", add)


def install_worker_hooks() -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def execute(orig: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            WORKER_ACTIVITY.epoch += 1
            return orig(self, *args, **kwargs)
        return execute_model

    _wrap(WorkerWrapperBase, "execute_model", execute)


def install_init_device_hook(after: Callable[[Any], None]) -> None:
    """Run `after(worker)` once the worker has picked its CUDA device (before memory profiling)."""
    from vllm.v1.worker.gpu_worker import Worker

    def init(orig: Callable[..., Any]) -> Callable[..., Any]:
        def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, *args, **kwargs)
            after(self)
            return out
        return init_device

    _wrap(Worker, "init_device", init)
