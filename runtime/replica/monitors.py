"""The background watchers of a generation: readiness, its startup gate, the probe (hang
detection), memory sampling, its way out (processes and GPU memory gone), and the status
collector. Each reads what it needs off the event loop (`asyncio.to_thread` for /proc, smaps,
files and NVML) and leaves its findings on the `Generation` through its `note_*` methods; the
replica's `decide` only looks at them, and `status()` only assembles them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from vllm_guard.core import hang, leak, plugin
from vllm_guard.core.config import GuardConfig, ProbeConfig
from vllm_guard.core.host import child_memory, cpu_seconds, host_memory
from vllm_guard.core.protocol import (
    ChildProcess, MemoryGrowth, MemoryReading, MemoryStatus, PatchProcessReport, ProbeSummary, ProcessMemory, Role,
)
from vllm_guard.core.timefmt import utcnow

from vllm_guard.core.stats import theil_sen, time_to_exhaust

from ..child import procs
from ..child.anatomy import Anatomy
from .generation import Generation
from .plan import memory_fit, prestage_mb, start_fits
from .ports import Ledger
from .triggers import Growth

if TYPE_CHECKING:
    import aiohttp

    from vllm_guard.core.nvml import NvmlSession

log = structlog.get_logger("vllm_guard.monitors")

STATUS_EVERY_S = 1.0


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
            answered = time.monotonic()
            gen.mark("health_ok", answered)
            res = await b.probe(http, cfg.prompt, cfg.timeout * 3)
            if res.ok:
                assert gen.anatomy is not None
                await asyncio.to_thread(catch_up, gen.anatomy, b.log_path, answered)
                on_version(await b.version(http))
                gen.note_ready(time.monotonic())
                wake()
                return
            log.info("ready_probe_failed", generation=b.generation, error=res.error)
        await until_health_due(gen.anatomy)


HEALTH_EVERY_S = 1.0  # while vLLM loads: its /health cannot answer yet
HEALTH_SOON_S = 0.05  # once its engine is up: the API server binds within about a second


def health_every_s(anatomy: Anatomy | None) -> float:
    """How long to wait before asking /health again. Once vLLM logged its engine up (or its API
    server started), every tenth of a second polled late is a tenth more without service in a
    recycle's gap: ask often; before that, once a second is plenty."""
    if anatomy is not None and ("engine_up" in anatomy.at or "api_up" in anatomy.at):
        return HEALTH_SOON_S
    return HEALTH_EVERY_S


async def until_health_due(anatomy: Anatomy | None) -> None:
    """Wait until /health should be asked again. A one-second wait that began just before vLLM
    logged its engine up would be slept out whole (the health phase took up to 0.7 s of a gated
    recycle's gap on the H100): look at the start's phases every HEALTH_SOON_S meanwhile."""
    end = time.monotonic() + health_every_s(anatomy)
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(HEALTH_SOON_S, left))
        if health_every_s(anatomy) == HEALTH_SOON_S:
            return


# -- the probe --------------------------------------------------------------------------------
async def _scrape(gen: Generation, http: aiohttp.ClientSession, window: hang.ProgressWindow) -> None:
    m = await gen.backend.metrics(http)
    cpu = await asyncio.to_thread(cpu_seconds, gen.backend.pid)
    window.add(time.monotonic(), None if m is None else m.tokens, cpu)


async def probe_loop(gen: Generation, http: aiohttp.ClientSession, cfg: ProbeConfig,
                     on_probe: Callable[[ProbeSummary], None], wake: Callable[[], None]) -> None:
    """A 1-token completion every `interval`, judged by the one hang rule (`core.hang`): a
    timed-out probe is a miss only if nothing progressed over the whole window; `failures`
    misses in a row make the generation hung (`gen.note_hang`)."""
    b = gen.backend
    window = hang.ProgressWindow(keep=hang.keep(cfg.progress_window, cfg.timeout, cfg.interval))
    rule = hang.HangRule(cfg.failures)
    step = max(0.5, min(cfg.interval, cfg.progress_window / 4, 5.0))
    while True:
        await asyncio.sleep(cfg.interval)
        await _scrape(gen, http, window)
        res = await b.probe(http, cfg.prompt, cfg.timeout)
        await _scrape(gen, http, window)
        if not hang.asks_window(res):
            rule.judge(res)
            on_probe(ProbeSummary(at=utcnow(), ok=res.ok, latency_s=round(res.latency_s, 3), error=res.error or None))
            if not res.ok:
                log.warning("probe_failed", generation=b.generation, error=res.error, engine_progress=None,
                            verdict="answered")
            continue
        span = hang.span(cfg.progress_window, res)
        verdict = window.verdict(time.monotonic(), span)
        while (judged := rule.judge(res, verdict)) is hang.Judgement.WAIT:  # a young generation
            await asyncio.sleep(step)
            await _scrape(gen, http, window)
            verdict = window.verdict(time.monotonic(), span)
        progress = hang.ENGINE_PROGRESS.get(verdict)
        on_probe(ProbeSummary(at=utcnow(), ok=False, latency_s=round(res.latency_s, 3), error=res.error or None,
                              engine_progress=progress))
        log.warning("probe_failed", generation=b.generation, error=res.error, engine_progress=progress,
                    verdict=verdict.value, window_s=round(span, 1), misses=rule.misses)
        if judged is hang.Judgement.HUNG:
            gen.note_hang(f"probe failed ({res.error}) and {hang.WHY[verdict]} in {span:.0f} s")
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


FORECAST_POINTS = 6  # readings after the baseline before a growth rate is trusted


def growth_rate(history: list[tuple[float, float]]) -> float | None:
    """The robust growth rate (MB/s, Theil-Sen) of `history` ((t, MB)); None while too few
    readings exist to trust one. Pure."""
    if len(history) < FORECAST_POINTS:
        return None
    slope = theil_sen([t for t, _ in history], [mb for _, mb in history])
    return None if slope is None else slope.slope


def forecast(history: list[tuple[float, float]], headroom_mb: float | None) -> float | None:
    """Seconds until `headroom_mb` is used up at the robust growth rate of `history` ((t, MB));
    None while it does not grow or too few readings exist. Pure."""
    rate = growth_rate(history)
    return None if headroom_mb is None or rate is None else time_to_exhaust(headroom_mb, rate)


MemoryRead = tuple[MemoryReading, list[ChildProcess], dict[str, tuple[float, float]], float]
WARM_POLL_S = 0.05  # how soon the baseline follows the end of warm-up


def _read_all(pid: int, requests: int, nvml: NvmlSession | None) -> MemoryRead:
    """One memory reading, the devices' memory and the host's MemAvailable (blocking)."""
    cur, found = read_memory(pid, requests, nvml)
    devices = nvml.device_memory_mb() if nvml is not None and nvml.available else {}
    return cur, found, devices, float(host_memory()["mem_available_mb"])


@dataclass(frozen=True)
class MemoryIO:
    """What `memory_loop` reads and how it waits: the machine by default; tests pass fakes (a
    reader of made-up trees, a clock and a sleep of their own) and run it in milliseconds."""

    read: Callable[[int, int, NvmlSession | None], MemoryRead] = _read_all  # blocking: run in a thread
    prestaged: Callable[[GuardConfig, str], float] = prestage_mb
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


async def memory_loop(gen: Generation, cfg: GuardConfig, nvml: NvmlSession | None, ledger: Ledger,
                      gpus: list[str], wake: Callable[[], None], io: MemoryIO = MemoryIO()) -> None:
    """Read the tree's memory every `memory_interval`; the growth baseline is taken as warm-up
    ends (`core.leak.warmed_up`, checked every 50 ms, so a fast leak does not hide in a late
    baseline). Each reading also gives the strategy readings for a recycle (host RAM, the
    replica's GPUs), the forecast time to the memory limit and the GPU memory's growth rate (the
    next generation's prior, `steps.late_room`), and writes the served count to the
    ledger, so a killed runtime's generation keeps it, and the reading itself (the report's
    memory per process)."""
    t, warm, interval = gen.target, cfg.recycle.memory_warmup_requests, cfg.recycle.memory_interval
    baseline: MemoryReading | None = None
    host_hist: list[tuple[float, float]] = []
    gpu_hist: list[tuple[float, float]] = []
    staged = await asyncio.to_thread(io.prestaged, cfg, gen.backend.model)
    while True:
        warmed = leak.warmed_up(t.dispatched, warm)
        cur, found, devices, avail = await asyncio.to_thread(io.read, gen.backend.pid, t.dispatched, nvml)
        gen.backend.remember(found)
        if baseline is None and warmed:
            baseline = cur  # allocator pools and caches have settled
        growth = _growth(baseline, cur) if baseline is not None else None
        now = io.clock()
        if baseline is not None:
            host_hist = (host_hist + [(now, cur.rss_mb)])[-60:]
            if cur.gpu_mb is not None:
                gpu_hist = (gpu_hist + [(now, cur.gpu_mb)])[-60:]
        fit = memory_fit(cfg, cur, devices, gpus, None, avail, staged)
        limits = [x for x in (forecast(host_hist, avail),
                              forecast(gpu_hist, fit.gpu_free_mb)) if x is not None]
        gen.note_memory(MemoryStatus(warmup_requests=warm, baseline=baseline, current=cur, growth=growth),
                        None if growth is None else Growth(rss_mb=growth.rss_mb, gpu_mb=growth.gpu_mb), fit,
                        min(limits) if limits else None, gpu_mb_s=growth_rate(gpu_hist))
        ledger.generation_progress(gen.row, t.completed)
        ledger.process_memory(gen.number, gen.replica, cur, avail, fit.gpu_free_mb)  # the report's memory per process
        wake()
        end_at = io.clock() + interval
        while (left := end_at - io.clock()) > 0:
            if baseline is None and leak.warmed_up(t.dispatched, warm):
                break
            await io.sleep(min(WARM_POLL_S, left))


# -- the gate, and the way out -------------------------------------------------------------------
GATE_EVERY_S = 0.1
STOP_EVERY_S = 0.1


async def gate_loop(gen: Generation, wake: Callable[[], None]) -> None:
    """A gated generation's startup gate, as its EngineCore reports it (parked, skipped...)."""
    gate = gen.gate
    if gate is None:
        return
    last = None
    while gen.backend.returncode is None:
        report = await asyncio.to_thread(plugin.read_gate, gate)
        if report != last:
            gen.note_gate(report, time.monotonic())
            last = report
            wake()
        if plugin.gate_settled(report):
            return
        await asyncio.sleep(GATE_EVERY_S)
    gen.note_gate(await asyncio.to_thread(plugin.read_gate, gate))
    wake()


async def stop_loop(gen: Generation, nvml: NvmlSession | None, wake: Callable[[], None]) -> None:
    """A signalled generation: which of its pids are still alive, then whether NVML still shows
    their GPU memory (vLLM's start check fails while another process frees memory)."""
    b = gen.backend
    while True:
        alive = await b.alive_pids()
        gpu_free = True
        if not alive and nvml is not None and nvml.available:
            used = await asyncio.to_thread(nvml.process_memory_mb)
            gpu_free = not any(pid in used for pid in b.known_pids)
        gen.note_stop(alive, gpu_free)
        if not alive:
            wake()
            if gpu_free:
                return
        await asyncio.sleep(STOP_EVERY_S)


LOG_EVERY_S = 0.2


async def log_loop(gen: Generation) -> None:
    """Tail the generation's log while it starts and note vLLM's phases as their lines appear."""
    path, pos = gen.backend.log_path, 0
    assert gen.anatomy is not None
    while gen.backend.returncode is None:
        chunk, pos = await asyncio.to_thread(_read_from, path, pos)
        if chunk:
            gen.anatomy.feed(chunk, time.monotonic())
        if "api_up" in gen.anatomy.at and gen.ready_mono is not None:
            return
        await asyncio.sleep(LOG_EVERY_S)


CATCH_UP_BYTES = 1 << 18


def catch_up(anatomy: Anatomy, log_path: Path, answered: float) -> None:
    """Note the phases whose lines the log tail has not read yet once the generation is ready:
    the tail looks every LOG_EVERY_S and ends at ready, and `/health` asked often can answer
    first. vLLM wrote those lines before it answered, so `answered` bounds their time."""
    try:
        start = max(0, log_path.stat().st_size - CATCH_UP_BYTES)
    except OSError:
        return
    text, _ = _read_from(log_path, start, CATCH_UP_BYTES)
    anatomy.feed(text, answered)


def _read_from(path: Path, pos: int, limit: int = 1 << 20) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read(limit)
    except OSError:
        return "", pos
    cut = data.rfind(b"\n") + 1  # whole lines only
    return data[:cut].decode(errors="replace"), pos + cut


async def held_loop(gen: Generation, nvml: NvmlSession | None, every_s: float) -> None:
    """What a standby holds while it waits (host RSS of its tree, GPU memory): its cost."""
    while True:
        cur, found = await asyncio.to_thread(read_memory, gen.backend.pid, 0, nvml)
        gen.backend.remember(found)
        gen.note_held(cur.rss_mb, cur.gpu_mb)
        await asyncio.sleep(every_s)


async def room_loop(cfg: GuardConfig, nvml: NvmlSession | None, gpus: list[str],
                    note: Callable[[bool], None], wake: Callable[[], None]) -> None:
    """While a parked generation waits for its gate: whether vLLM's start check would pass on
    the replica's GPUs now (free >= gpu_memory_utilization x total)."""
    while nvml is not None and nvml.available:
        devices = await asyncio.to_thread(nvml.device_memory_mb)
        room = start_fits(cfg, devices, gpus)
        note(room)
        if room:
            wake()
        await asyncio.sleep(0.05)


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
            known = gen.dead_engine
            gen.note_tree(found, dead, patches)
            if dead is not None and known is None:
                wake()
        await asyncio.sleep(STATUS_EVERY_S)




class MonitorKit:
    """The `Watchers` of `replica.ports`: starts a generation's monitors for each part of its
    life, each a task that notes what it sees on the generation and wakes the loop."""

    def __init__(self, cfg: GuardConfig, http: aiohttp.ClientSession, nvml: NvmlSession | None,
                 ledger: Ledger, state_dir: Path, gpus_of: Callable[[int], list[str]],
                 on_probe: Callable[[ProbeSummary], None], on_version: Callable[[str], None],
                 wake: Callable[[], None]) -> None:
        self.cfg, self.http, self.nvml, self.ledger, self.state_dir = cfg, http, nvml, ledger, state_dir
        self.gpus_of, self.on_probe, self.on_version, self.wake = gpus_of, on_probe, on_version, wake

    def booting(self, gen: Generation) -> None:
        n = gen.number
        gen.add_task(asyncio.create_task(guarded("log", n, lambda: log_loop(gen))))
        gen.add_task(asyncio.create_task(guarded("ready", n, lambda: wait_ready(
            gen, self.http, self.cfg.probe, self.on_version, self.wake))))
        if gen.gate is not None:
            gen.add_task(asyncio.create_task(guarded("gate", n, lambda: gate_loop(gen, self.wake))))
        if gen.standby:
            gen.add_task(asyncio.create_task(guarded("standby", n, lambda: held_loop(
                gen, self.nvml, self.cfg.recycle.memory_interval))))

    def serving(self, gen: Generation) -> None:
        n, gpus = gen.number, self.gpus_of(gen.replica)
        gen.add_task(asyncio.create_task(guarded("probe", n, lambda: probe_loop(
            gen, self.http, self.cfg.probe, self.on_probe, self.wake))))
        gen.add_task(asyncio.create_task(guarded("memory", n, lambda: memory_loop(
            gen, self.cfg, self.nvml, self.ledger, gpus, self.wake))))

    def stopping(self, gen: Generation) -> None:
        gen.watch_stop(asyncio.create_task(guarded("stop", gen.number, lambda: stop_loop(gen, self.nvml, self.wake))))

    def room(self, replica: int, note: Callable[[bool], None]) -> Callable[[], None]:
        task = asyncio.create_task(guarded("room", replica, lambda: room_loop(
            self.cfg, self.nvml, self.gpus_of(replica), note, self.wake)))

        def stop() -> None:
            task.cancel()

        return stop
