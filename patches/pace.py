"""pace-beside: an engine that starts beside a serving generation leaves the device to it.

An overlap's successor and a standby that parks once ready run their engine start (vLLM's profile
run, one dummy batch of `max_num_batched_tokens`, and its warm-up: the graph captures' dummy
batches) while another generation serves on the same GPU. The GPU time-slices between the two
processes, so a request that arrives during the profile run waits about twice its time for its
first token: on an H100 with a 7B model, 5 of a run's 9 slowest first tokens fell in the 0.12 s of
one standby's profile run (`vllm-guard report`, TTFT TAIL).

Paced, those two worker calls (`determine_available_memory`, `compile_or_warm_up_model`; nothing
else, never a served request) stop at each attention call (one or two a layer): the work queued so
far is waited for (`torch.cuda.synchronize`: at most a layer of it ahead of the serving engine),
then the engine sleeps `ratio` times as long as that wait. The wait includes the time the GPU gave
the serving engine meanwhile, so a start beside a busy engine is slowed the most: on an H100 with a
7B model beside 10 req/s, the profile run's 0.3 s of device work left 0.6 s to the serving engine,
and the warm-up (graph captures) took 45 s instead of 8. Never while a CUDA graph is being captured
(a synchronize there is illegal). On vLLM-CPU the work is synchronous: the time since the last point
is what it used of the cores both engines share.

The runtime asks for it (VLLM_GUARD_PACE = the ratio) only for a start whose engine work runs while
another generation of its replica serves (`core.plugin.pace_wanted`), and says when that is over
(the old generation died, or was stopped for a gated recycle): an `unpace` file in the generation's
report dir, looked at each point; from then on the start goes at full speed.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from vllm_guard.core import plugin as contract


ATTN_MODULE = "vllm.model_executor.layers.attention.attention"
PHASES = {"determine_available_memory": "profile", "compile_or_warm_up_model": "warmup"}
LAST_PHASE = "warmup"
MIN_SLEEP_S = 0.001  # shorter sleeps are owed and taken together (a sleep's own cost is ~0.1 ms)
MAX_SLEEP_S = 0.25  # one point never sleeps longer (a wait that long was not one layer's work)


class NotAsked(Exception):
    """No pacing for this process; the reason."""


def requested(env: Mapping[str, str] = os.environ) -> float | None:
    """The ratio the runtime asked for, or None (not asked, or not a positive number)."""
    text = env.get(contract.PACE_VAR, "").strip()
    try:
        ratio = float(text)
    except ValueError:
        return None
    return ratio if ratio > 0 else None


@dataclass
class PhaseFigures:
    """What pacing did in one phase of the start."""

    phase: str
    points: int = 0  # attention calls paced
    waited_s: float = 0.0  # time the device spent on the work queued at the points (the GPU's share)
    slept_s: float = 0.0  # time left to the serving generation
    wall_s: float = 0.0  # the phase's whole length
    unpaced: bool = False  # the runtime said nothing serves beside it any more: the rest went at full speed


class Pacer:
    """Counts the device's time on this engine's work inside the paced phases, and gives it back."""

    def __init__(self, ratio: float, said: Callable[[PhaseFigures], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 unpaced: Callable[[], bool] = lambda: False) -> None:
        self.ratio = ratio
        self.unpaced = unpaced  # asked at each point: once true, nothing in this process is paced again
        self.off = False
        self.said = said
        self.clock, self.sleep = clock, sleep
        self.current: PhaseFigures | None = None
        self.done: list[PhaseFigures] = []
        self._thread: int | None = None
        self._woke: float | None = None  # the last point; None: none yet in this phase
        self._owed = 0.0
        self.cuda: Any = None  # torch.cuda where this process has a CUDA context (looked up at each point)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Pace the calls in this block (this thread only); nested blocks are the outer one's."""
        if self.current is not None:
            yield
            return
        fig = PhaseFigures(name)
        self.current, self._thread, self._owed, self._woke = fig, threading.get_ident(), 0.0, None
        fig.unpaced = self.off
        start = self.clock()
        try:
            yield
        finally:
            fig.wall_s = self.clock() - start
            self.current, self._thread = None, None
            self.done.append(fig)
            self.said(fig)

    def point(self) -> None:
        """One attention call: wait for the queued work, then leave the device `ratio` times as long.
        At every layer, in the warm-up's small forwards too: paced once a forward instead, the
        warm-up took 2 s longer rather than 35 (H100, 7B, beside 10 req/s), but the requests served
        beside it waited as long as unpaced (p90 37 ms against 25 paced at every layer)."""
        fig = self.current
        if fig is None or self.off or threading.get_ident() != self._thread:
            return
        if self.unpaced():
            self.off = fig.unpaced = True
            return
        waited = self._wait()
        if waited is None:  # a CUDA graph is being captured: nothing runs now, nothing to give back
            self._woke = self.clock()
            return
        fig.points += 1
        fig.waited_s += waited
        self._owed += min(self.ratio * waited, MAX_SLEEP_S)
        if self._owed >= MIN_SLEEP_S:
            owed, self._owed = self._owed, 0.0
            t0 = self.clock()
            self.sleep(owed)
            fig.slept_s += self.clock() - t0
        self._woke = self.clock()

    def _wait(self) -> float | None:
        """Seconds the device was still busy with this engine's work; None while capturing (or,
        on a CPU, at a phase's first point: what came before it was not this forward's work)."""
        cuda = self.cuda = self.cuda if self.cuda is not None else gpu()
        if cuda is None:  # synchronous work: what it took since the last point
            return None if self._woke is None else self.clock() - self._woke
        if cuda.is_current_stream_capturing():
            return None
        t0 = self.clock()
        cuda.synchronize()
        return self.clock() - t0


def gpu() -> Any:
    """torch.cuda where this process has a CUDA context, else None (vLLM-CPU, or not yet)."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_available() and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a CPU build may lack the calls: synchronous work then
        return None


def worker_classes() -> list[type]:
    """The worker classes whose start this platform runs (vLLM-CPU's overrides both calls)."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_worker

    if current_platform.is_cuda():
        return [gpu_worker.Worker]
    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_worker

        return [cpu_worker.CPUWorker]
    raise NotAsked(f"not verified on this platform ({type(current_platform).__name__})")


class PaceBeside:
    """The installed patch: the attention context lookup is the pace point, the two worker
    calls are the scope."""

    def __init__(self, ratio: float, said: Callable[[PhaseFigures], None], marker: Path | None = None) -> None:
        self.pacer = Pacer(ratio, said, unpaced=marker.exists if marker is not None else lambda: False)
        self._restore: Callable[[], None] = lambda: None

    def install(self) -> str:
        import importlib

        attn = importlib.import_module(ATTN_MODULE)
        classes = worker_classes()
        for cls in classes:
            for method in PHASES:
                if not callable(getattr(cls, method, None)):
                    raise NotAsked(f"{cls.__name__}.{method} not found")
        original = attn.get_attention_context
        pacer = self.pacer

        @functools.wraps(original)
        def get_attention_context(*args: Any, **kwargs: Any) -> Any:
            pacer.point()
            return original(*args, **kwargs)

        setattr(attn, "get_attention_context", get_attention_context)  # noqa: B010 - a module global
        # the warm-up is a start's last paced call: after it the lookup is vLLM's own again, off the hot path
        self._restore = lambda: setattr(attn, "get_attention_context", original)
        for cls in classes:
            for method, phase in PHASES.items():
                setattr(cls, method, self._scoped(getattr(cls, method), phase))
        names = ", ".join(f"{c.__name__}.{m}" for c in classes for m in PHASES)
        return (f"{names} paced at each attention call: {pacer.ratio:g} s left to the serving generation "
                f"for each second of device work")

    def summary(self) -> dict[str, Any]:
        """The process report's details: the ratio and each paced phase's figures."""
        return {"ratio": self.pacer.ratio, "phases": [record(f) for f in self.pacer.done]}

    def _scoped(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        pacer = self.pacer

        @functools.wraps(fn)
        def paced(*args: Any, **kwargs: Any) -> Any:
            try:
                with pacer.phase(phase):
                    return fn(*args, **kwargs)
            finally:
                if phase == LAST_PHASE:
                    self._restore()

        return paced


def record(fig: PhaseFigures) -> dict[str, Any]:
    """One phase's figures as an event record (floats to the millisecond)."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(fig).items()}
