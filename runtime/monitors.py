"""The background watchers of a generation: the probe (hang detection), memory sampling, and
the status collector. Each reads what it needs off the event loop (`asyncio.to_thread` for
/proc, smaps and NVML) and leaves its findings on the `Generation`; the supervisor's loop only
looks at them, and `status()` only assembles them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from vllm_guard.core import plugin
from vllm_guard.core.config import ProbeConfig, RecycleConfig
from vllm_guard.core.host import child_memory
from vllm_guard.core.protocol import (
    ChildProcess, MemoryGrowth, MemoryReading, MemoryStatus, PatchProcessReport, ProbeSummary, ProcessMemory, Role,
)
from vllm_guard.core.timefmt import utcnow

from . import procs
from .generation import Generation
from .hang import ENGINE_PROGRESS, ProgressWindow, Verdict, miss_counts
from .ledger import RuntimeLedger
from .triggers import Growth

if TYPE_CHECKING:
    import aiohttp

    from vllm_guard.core.nvml import NvmlSession

log = structlog.get_logger("vllm_guard.monitors")

STATUS_EVERY_S = 1.0
_WHY = {Verdict.STALLED: "no token moved", Verdict.SILENT: "neither /metrics answered nor the API server used CPU"}


async def guarded(name: str, generation: int, run: Callable[[], Awaitable[None]], retry_s: float = 1.0) -> None:
    """Run a monitor; if it fails (a bug, an unexpected /proc or psutil error), log it and run it
    again: a monitor that died silently would turn hang or engine-death detection off."""
    while True:
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - logged with its traceback, then restarted
            log.exception("monitor_failed", monitor=name, generation=generation, error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(retry_s)


# -- ready ------------------------------------------------------------------------------------
async def wait_ready(gen: Generation, http: aiohttp.ClientSession, cfg: ProbeConfig,
                     on_version: Callable[[str], None], wake: Callable[[], None]) -> None:
    """Ready means /health 200 *and* a real 1-token completion (`gen.ready_mono` set)."""
    b = gen.backend
    while b.returncode is None:
        if await b.health(http):
            res = await b.probe(http, cfg.prompt, cfg.timeout * 3)
            if res.ok:
                on_version(await b.version(http))
                gen.ready_mono = time.monotonic()
                wake()
                return
            log.info("ready_probe_failed", generation=b.generation, error=res.error)
        await asyncio.sleep(1.0)


# -- the probe --------------------------------------------------------------------------------
async def _scrape(gen: Generation, http: aiohttp.ClientSession, window: ProgressWindow) -> None:
    m = await gen.backend.metrics(http)
    cpu = await asyncio.to_thread(procs.cpu_seconds, gen.backend.pid)
    window.add(time.monotonic(), None if m is None else m.tokens, cpu)


async def probe_loop(gen: Generation, http: aiohttp.ClientSession, cfg: ProbeConfig,
                     on_probe: Callable[[ProbeSummary], None], wake: Callable[[], None]) -> None:
    """A 1-token completion every `interval`. A failed one counts toward a hang only if nothing
    progressed over the whole window (see `hang`); `failures` such misses in a row make the
    generation hung (`gen.hang`)."""
    b = gen.backend
    window = ProgressWindow(keep=max(cfg.progress_window, cfg.timeout) + cfg.interval)
    step = max(0.5, min(cfg.interval, cfg.progress_window / 4, 5.0))
    misses = 0
    while True:
        await asyncio.sleep(cfg.interval)
        await _scrape(gen, http, window)
        res = await b.probe(http, cfg.prompt, cfg.timeout)
        await _scrape(gen, http, window)
        if res.ok:
            misses = 0
            on_probe(ProbeSummary(at=utcnow(), ok=True, latency_s=round(res.latency_s, 3)))
            continue
        span = max(cfg.progress_window, res.latency_s)
        verdict = window.verdict(time.monotonic(), span)
        while verdict is Verdict.TOO_SHORT:  # a young generation: watch until a window is covered
            await asyncio.sleep(step)
            await _scrape(gen, http, window)
            verdict = window.verdict(time.monotonic(), span)
        progress = ENGINE_PROGRESS.get(verdict)
        on_probe(ProbeSummary(at=utcnow(), ok=False, latency_s=round(res.latency_s, 3), error=res.error or None,
                              engine_progress=progress))
        log.warning("probe_failed", generation=b.generation, error=res.error, engine_progress=progress,
                    verdict=verdict.value, window_s=round(span, 1))
        if not miss_counts(verdict):
            misses = 0  # starved, not hung
            continue
        misses += 1
        if misses >= cfg.failures:
            gen.hang = f"probe failed ({res.error}) and {_WHY[verdict]} in {span:.0f} s"
            wake()
            return


# -- memory -----------------------------------------------------------------------------------
def read_memory(root_pid: int, requests: int, nvml: NvmlSession | None) -> tuple[MemoryReading, list[ChildProcess]]:
    """One reading of the generation's process tree (blocking: smaps and NVML)."""
    found = procs.tree(root_pid)
    per = child_memory([{"pid": c.pid, "role": c.role.value} for c in found], full=True)
    gpu = nvml.process_memory_mb() if nvml is not None and nvml.available else None
    rows = []
    for c in found:
        m = per.get(str(c.pid))
        if m is None:
            continue
        rows.append(ProcessMemory(pid=c.pid, role=c.role, rss_mb=round(m["rss_mb"], 1),
                                  uss_mb=round(m["uss_mb"], 1), swap_mb=m.get("swap_mb"),
                                  gpu_mb=None if gpu is None else round(gpu.get(c.pid, 0.0), 1)))
    reading = MemoryReading(
        at=utcnow(), requests=requests,
        rss_mb=round(sum(r.rss_mb for r in rows), 1),
        uss_mb=round(sum(r.uss_mb or 0.0 for r in rows), 1),
        gpu_mb=None if gpu is None else round(sum(r.gpu_mb or 0.0 for r in rows), 1),
        per_process=rows,
    )
    return reading, found


def _growth(base: MemoryReading, cur: MemoryReading) -> MemoryGrowth:
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 1)

    return MemoryGrowth(rss_mb=round(cur.rss_mb - base.rss_mb, 1), uss_mb=diff(base.uss_mb, cur.uss_mb),
                        gpu_mb=diff(base.gpu_mb, cur.gpu_mb))


async def memory_loop(gen: Generation, cfg: RecycleConfig, nvml: NvmlSession | None, ledger: RuntimeLedger,
                      wake: Callable[[], None]) -> None:
    """Read the tree's memory every `memory_interval`; the growth baseline is taken as warm-up
    ends (checked every 50 ms, so a fast leak does not hide in a late baseline). Each reading
    also writes the served count to the ledger, so a killed runtime's generation keeps it."""
    t, warm = gen.target, cfg.memory_warmup_requests
    baseline: MemoryReading | None = None
    while True:
        warmed = t.dispatched >= warm
        cur, found = await asyncio.to_thread(read_memory, gen.backend.pid, t.dispatched, nvml)
        gen.backend.remember(found)
        if baseline is None and warmed:
            baseline = cur  # allocator pools and caches have settled
        growth = _growth(baseline, cur) if baseline is not None else None
        gen.memory = MemoryStatus(warmup_requests=warm, baseline=baseline, current=cur, growth=growth)
        gen.growth = None if growth is None else Growth(rss_mb=growth.rss_mb, gpu_mb=growth.gpu_mb)
        ledger.generation_progress(gen.row, t.completed)
        wake()
        end = time.monotonic() + cfg.memory_interval
        while (left := end - time.monotonic()) > 0:
            if baseline is None and t.dispatched >= warm:
                break
            await asyncio.sleep(min(0.05, left))


# -- status -----------------------------------------------------------------------------------
def _collect(gen: Generation, state_dir: Path) -> tuple[list[ChildProcess], int | None, dict[str, PatchProcessReport]]:
    found = procs.tree(gen.backend.pid) if gen.backend.returncode is None else []
    dead = procs.dead(gen.engine_pids) if gen.engine_pids else None
    return found, dead, plugin.read_states(state_dir, gen.number)


async def status_loop(live: Callable[[], list[Generation]], state_dir: Path, wake: Callable[[], None]) -> None:
    """For the runtime's whole life: each live generation's process tree (every replica's, a
    successor's, a draining one's), whether an engine process died, and the plugin's patch
    reports, cached on the generation."""
    while True:
        for gen in live():
            if gen.backend.proc is None or gen.ended:
                continue
            found, dead, patches = await asyncio.to_thread(_collect, gen, state_dir)
            gen.backend.remember(found)
            gen.children = found
            gen.patches = patches
            if dead is not None and gen.dead_engine is None:
                gen.dead_engine = dead
                wake()
        await asyncio.sleep(STATUS_EVERY_S)


def engine_pids(found: list[ChildProcess]) -> list[int]:
    return [c.pid for c in found if c.role in (Role.ENGINE_CORE, Role.WORKER)]
