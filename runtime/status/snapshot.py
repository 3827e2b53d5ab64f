"""The runtime's status, assembled from what the monitors cached and what the replicas' machines
say: nothing here reads /proc, a file or NVML, so `GET /status` (the watchdog asks every second)
never blocks the loop. Bounded: the last RECENT failures and recycles plus totals.

Each replica's `phase` is its machine's state as it is (`replica.machine.State`); `state` is the
coarse one every reader knows (`machine.COARSE`). Nothing is rebuilt from combinations of fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from vllm_guard.core.config import GuardConfig
from vllm_guard.core.gpu import visible_uuids
from vllm_guard.core.nvml import NvmlSession
from vllm_guard.core.protocol import (
    ConfigStatus, LedgerHealth, ProbeSummary, ReplicaStatus, RequestCounters, RuntimeState, StandbyStatus, StartPhase,
    StatusSnapshot,
)

from ..frontdoor.proxy import Proxy
from ..replica.driver import ReplicaDriver
from ..replica.generation import Generation
from ..replica.machine import COARSE, TAKING_OVER_STATES
from ..records.books import RuntimeBooks

_REACHABLE = frozenset({RuntimeState.STARTING, RuntimeState.SERVING, RuntimeState.DRAINING})
_PARKED = "parked"


@dataclass(frozen=True)
class StatusInputs:
    cfg: GuardConfig
    model: str
    state: RuntimeState
    state_for_s: float
    generation: int
    vllm_version: str
    gpu_name: str
    hold: str | None
    drivers: Sequence[ReplicaDriver]
    books: RuntimeBooks
    proxy: Proxy
    last_probe: ProbeSummary | None
    ledger: LedgerHealth
    config: ConfigStatus | None = None


def snapshot(x: StatusInputs) -> StatusSnapshot:
    first = x.drivers[0] if x.drivers else None
    gen = first.current if first is not None else None
    t = gen.target if gen else None
    b = gen.backend if gen else None
    c, p = x.proxy.counters, x.proxy
    requests = RequestCounters(
        total=c.requests_total, completed=c.completed, failed=c.failed_requests, rejected=c.rejected,
        retried=c.retried, resumed=c.resumed, resumes=c.resumes, unresumable=c.unresumable, handed_over=c.handed_over,
        client_disconnects=c.client_disconnects, rejected_by=dict(c.rejected_by),
        failed_by=dict(c.failed_by), connections_lost=c.connections_lost, in_flight=p.in_flight,
        queued=p.queued, generation=t.dispatched if t else 0, generation_limit=t.limit if t else None,
        generation_inherited=t.inherited if t else 0, not_forwarded=c.not_forwarded,
        connections=len(p.gate.conns), connections_refused=p.gate.refused + p.gate.evicted,
    )
    children = [ch for d in x.drivers if d.current is not None and not d.current.ended
                for ch in d.current.listed_children]
    in_progress = next((r for d in x.drivers if (r := x.books.recycle_of(d.index)) is not None), None)
    reachable = first is not None and COARSE[first.state] in _REACHABLE
    return StatusSnapshot(
        schema="vllm-guard-status/5",
        state=x.state,
        state_for_s=round(x.state_for_s, 1),
        generation=x.generation,
        pid=os.getpid(),
        port=x.cfg.server.port,
        model=x.model,
        served_model=b.served_model if b else None,
        vllm_version=x.vllm_version,
        gpu_name=x.gpu_name or None,
        hold=x.hold,
        backend_url=b.url if b is not None and reachable else None,
        requests=requests,
        failures=x.books.failures.total,
        recent_failures=[f.summary() for f in x.books.failures],
        recycles=x.books.recycles.total,
        recent_recycles=[r.summary() for r in x.books.recycles],
        recycle_in_progress=in_progress.summary() if in_progress is not None else None,
        children=children,
        memory=gen.memory if gen else None,
        ttft=p.ttft_summary(),
        last_probe=x.last_probe,
        patches=gen.patches if gen else {},
        ledger=x.ledger,
        recycle_strategy=x.cfg.server.recycle_strategy,
        replicas=[replica_status(d, x.books) for d in x.drivers],
        config=x.config,
    )


def replica_status(d: ReplicaDriver, books: RuntimeBooks) -> ReplicaStatus:
    gen, nxt, st = d.current, d.successor, d.state
    t = gen.target if gen is not None else None
    phase: Literal["starting", "parked", "past_gate"] | None = None
    nxt_number = None
    if nxt is not None:
        parked = nxt.gate_report is not None and nxt.gate_report.state == _PARKED
        phase = "parked" if parked else "starting"
        nxt_number = nxt.number
    elif gen is not None and st in TAKING_OVER_STATES:
        phase, nxt_number = "past_gate", gen.number
    rec = books.recycle_of(d.index)
    last = next((r for r in reversed(list(books.recycles)) if r.replica == d.index), None)
    return ReplicaStatus(
        index=d.index, state=COARSE[st], phase=st.value, generation=gen.number if gen is not None else 0,
        gpus=list(d.plan.gpus), gpu_name=d.gpu_name or None,
        backend_url=gen.backend.url if gen is not None and COARSE[st] in _REACHABLE else None,
        pid=gen.backend.pid or None if gen is not None else None,
        in_flight=t.in_flight if t is not None else 0, served=t.dispatched if t is not None else 0,
        limit=t.limit if t is not None else None,
        next_generation=nxt_number, next_phase=phase,
        retiring=[g.number for g in d.retiring if not g.ended],
        recycle_strategy=rec.strategy if rec is not None else (last.strategy if last is not None else None),
        standby=standby_status(nxt) if nxt is not None and nxt.standby else None,
        start_phases=[StartPhase(phase=p, s=t) for p, t in gen.start_phases()] if gen is not None else [],
        config=gen.config or None if gen is not None else None,
        weights_source=gen.weights.source if gen is not None and gen.weights is not None else None,
        weights_note=gen.weights.reason if gen is not None and gen.weights is not None else "",
        holder=d.holder_status(),
        kv_source=kv.source if (kv := gen.kv_report if gen is not None else None) is not None else None,
        kv_note=kv.reason if kv is not None else "",
    )


def standby_status(g: Generation) -> StandbyStatus:
    state = g.gate_report.state if g.gate_report is not None else "starting"
    rss, gpu = g.held_mb if g.held_mb is not None else (None, None)
    return StandbyStatus(generation=g.number, phase="parked" if state == _PARKED else
                         "opened" if state == "opened" else "starting", rss_mb=rss, gpu_mb=gpu, ready=g.late)


def status_line(s: StatusSnapshot) -> str:
    """The one line systemd shows (`systemctl status`)."""
    r = s.requests
    hold = f" HELD({s.hold})" if s.hold else ""
    reps = f" replicas={sum(x.state is RuntimeState.SERVING for x in s.replicas)}/{len(s.replicas)}" \
        if len(s.replicas) > 1 else ""
    return (f"{s.state.value} gen={s.generation} served={r.generation} in_flight={r.in_flight} queued={r.queued} "
            f"failures={s.failures}{reps}{hold}")


def visible_gpu_name(nvml: NvmlSession | None, env: Mapping[str, str]) -> str:
    """Name of the GPU(s) a child with `env` sees (the one GPU-index rule); '' on CPU."""
    if nvml is None or not nvml.available:
        return ""
    uuids = set(visible_uuids(nvml.static, env))
    names = [str(s["name"]) for s in nvml.static if s["uuid"] in uuids]
    return names[0] if len(set(names)) == 1 else ",".join(names)
