"""The next generation while it starts beside the serving one (overlap and gated recycles).

overlap: spawn it; when it is ready, it takes new requests and the old one drains in the
background. gated: spawn it with a startup gate; when its EngineCore says it is parked, the old
one drains and stops (the replica's DRAINING, STOPPING); once the old one's GPU memory is free,
open the gate and the parked generation goes on (the replica's STARTING).

What can go wrong is a fact of its own, never a stall: the successor exits, does not get ready
(or to its gate) in time, or its vLLM cannot park. The first two are recorded as failures of
that generation (start_failed / start_timeout, with the reason); in every case the successor is
killed and the recycle goes on cold, so the serving generation is never left without a next one.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from vllm_guard.core import plugin
from vllm_guard.core.config import ServerConfig
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.protocol import GateReport

from . import monitors, replicas
from .generation import Generation
from .ladder import Ladder
from .machine import After, State
from .strategy import Choice, Strategy, choose

if TYPE_CHECKING:
    from .replica import Replica

log = structlog.get_logger("vllm_guard.supervisor")

PARK_SLACK_S = 120.0


def park_limit(s: ServerConfig) -> float:
    """How long a parked engine waits for its gate before it gives up and exits: the old
    generation's whole way out (drain, stop, memory release) plus slack."""
    return s.drain_timeout + s.stop_timeout + s.memory_release_timeout + PARK_SLACK_S


async def choose_strategy(rep: Replica, gen: Generation) -> Choice:
    """Measure the serving generation and the machine now, then choose."""
    sup = rep.sup
    reading = None
    if gen.backend.returncode is None:
        reading, _ = await asyncio.to_thread(monitors.read_memory, gen.backend.pid, gen.target.dispatched, sup.nvml)
    nv = sup.nvml
    devices = await asyncio.to_thread(nv.device_memory_mb) if nv is not None and nv.available else {}
    fit = replicas.memory_fit(sup.cfg, reading, devices, sup.replica_gpus(rep), sup.gate_unavailable)
    return choose(sup.cfg.server.recycle_strategy, fit)


async def begin(rep: Replica, strategy: Strategy) -> None:
    """Start the successor beside the serving generation, which keeps serving meanwhile."""
    gen = rep.gen
    assert gen is not None and rep.recycle is not None
    rep.sup.proxy.router.allow_past_limit(gen.target)
    await rep.sup.proxy.wake_waiters()
    nxt = await rep.spawn(strategy.value, gated=strategy is Strategy.GATED)
    if nxt is None:
        return
    rep.next = nxt
    rep.recycle.next_generation = nxt.number


async def step(rep: Replica) -> None:
    """One look at the successor while the old generation serves (the replica is SERVING)."""
    nxt, rec, s = rep.next, rep.recycle, rep.sup.cfg.server
    assert nxt is not None
    now = time.monotonic()
    if rec is None or rec.strategy == Strategy.OVERLAP.value:
        if nxt.ready_mono is not None:
            await _switch(rep, nxt)
        elif nxt.backend.returncode is not None:
            await _failed(rep, FailureKind.START_FAILED, nxt.backend.returncode,
                          f"exited with {nxt.backend.returncode} while starting beside generation {_number(rep.gen)}")
        elif now - nxt.spawned_mono > s.startup_timeout:
            await _failed(rep, FailureKind.START_TIMEOUT, None,
                          f"not ready after {s.startup_timeout:.0f}s while starting beside generation {_number(rep.gen)}")
        return
    report = await _gate(nxt)
    if report is not None and report.state == "parked":
        log.info("generation_parked", generation=nxt.number, replica=rep.index, where=report.where,
                 parked_after_s=round(now - nxt.spawned_mono, 1))
        rep.after = After.PROMOTE
        await rep.begin_drain()
    elif report is not None and report.state == "skipped":
        rep.sup.gate_unavailable = report.reason
        log.warning("gate_unavailable", generation=nxt.number, replica=rep.index, reason=report.reason)
        await _fallback(rep, f"gated pre-start unavailable: {report.reason}")
    elif nxt.backend.returncode is not None:
        await _failed(rep, FailureKind.START_FAILED, nxt.backend.returncode,
                      f"exited with {nxt.backend.returncode} before reaching its startup gate"
                      + (f" ({report.state}: {report.reason})" if report is not None else ""))
    elif now - nxt.spawned_mono > s.gate_timeout:
        await _failed(rep, FailureKind.START_FAILED, None,
                      f"did not reach its startup gate within {s.gate_timeout:.0f}s")


async def _gate(gen: Generation) -> GateReport | None:
    return await asyncio.to_thread(plugin.read_gate, gen.gate) if gen.gate is not None else None


async def _switch(rep: Replica, nxt: Generation) -> None:
    """Overlap: the successor is ready. It takes new requests first, then the old one drains."""
    old = rep.gen
    assert old is not None
    rec = rep.recycle
    rep.next = None
    await rep.go_live(nxt)
    rep.gen = nxt
    reason, cls = rep.end_reason
    lad = Ladder(old, reason, cls, rec.ledger_id if rec is not None else None)
    await lad.begin_drain(rep.sup)
    rep.retiring.append(lad)
    log.info("generation_switched", replica=rep.index, old=old.number, new=nxt.number,
             old_in_flight=old.target.in_flight)


async def watch_parked(rep: Replica) -> None:
    """While the old generation drains and stops: a parked successor that died is a failure, and
    the recycle goes on cold once the old one is gone."""
    nxt = rep.next
    if nxt is None or rep.after is not After.PROMOTE or nxt.backend.returncode is None:
        return
    report = await _gate(nxt)
    detail = f"exited with {nxt.backend.returncode} while parked at its startup gate" + (
        f" ({report.state}: {report.reason})" if report is not None and report.state != "parked" else "")
    rep.sup.record_failure(nxt, FailureKind.START_FAILED.value, nxt.backend.returncode, detail)
    await abandon(rep, detail)
    rep.after = After.START
    _note_fallback(rep, detail)
    if rep.sup.failure_limit_reached():
        await rep.sup.give_up(None)


async def promote(rep: Replica, lad: Ladder) -> bool:
    """Gated: the old generation is gone. Open the gate once vLLM's start check would pass
    (NVML shows the memory free), or `memory_release_timeout` after the stop, whichever first."""
    sup, nxt = rep.sup, rep.next
    assert nxt is not None and nxt.gate is not None
    nv = sup.nvml
    if nv is not None and nv.available:
        devices = await asyncio.to_thread(nv.device_memory_mb)
        waited = time.monotonic() - lad.stop_mark
        if not replicas.start_fits(sup.cfg, devices, sup.replica_gpus(rep)):
            if waited < sup.cfg.server.memory_release_timeout:
                return False
            log.error("gpu_memory_not_free_for_gate", replica=rep.index, generation=nxt.number,
                      waited_s=round(waited, 1))
    await asyncio.to_thread(plugin.open_gate, nxt.gate)
    log.info("gate_opened", generation=nxt.number, replica=rep.index,
             after_stop_s=round(time.monotonic() - lad.stop_mark, 2))
    rep.gen, rep.next, rep.ladder = nxt, None, None
    rep.enter(State.STARTING, sup.cfg.server.startup_timeout)
    return True


async def abandon(rep: Replica, why: str) -> None:
    """Kill the successor (if any): it stops in the background; the replica goes on without it."""
    nxt = rep.next
    if nxt is None:
        return
    rep.next = None
    log.warning("successor_abandoned", generation=nxt.number, replica=rep.index, why=why)
    lad = Ladder(nxt, f"abandoned: {why}"[:200], EndClass.SCHEDULED)
    await lad.begin_stop(rep.sup, kill=True)
    rep.retiring.append(lad)


def _number(gen: Generation | None) -> str:
    return str(gen.number) if gen is not None else "-"


async def _failed(rep: Replica, kind: FailureKind, exit_code: int | None, detail: str) -> None:
    nxt = rep.next
    assert nxt is not None
    rep.sup.record_failure(nxt, kind.value, exit_code, detail)
    await _fallback(rep, f"generation {nxt.number} {detail}")
    if rep.sup.failure_limit_reached():
        await rep.sup.give_up(None)


async def _fallback(rep: Replica, why: str) -> None:
    """The successor cannot take over: kill it and recycle cold."""
    await abandon(rep, why)
    _note_fallback(rep, why)
    rep.after = After.START
    await rep.begin_drain()


def _note_fallback(rep: Replica, why: str) -> None:
    rec = rep.recycle
    if rec is None:
        return
    rec.strategy, rec.strategy_reason = Strategy.COLD.value, f"fell back to cold: {why}"[:500]
    rec.next_generation = None
    rep.last_strategy = rec.strategy
    rep.sup.ledger.recycle_update(rec.ledger_id, strategy=rec.strategy)
    log.warning("recycle_fallback", replica=rep.index, generation=rec.generation, why=why)
