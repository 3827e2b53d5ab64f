"""The runtime's status, assembled from what the monitors cached: nothing here reads /proc, a
file or NVML, so `GET /status` (the watchdog asks every second) never blocks the loop. Bounded:
the last RECENT failures and recycles plus totals."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Literal, Mapping

from vllm_guard.core.gpu import visible_uuids
from vllm_guard.core.protocol import ReplicaStatus, RequestCounters, StatusSnapshot

from .machine import State

if TYPE_CHECKING:
    from vllm_guard.core.nvml import NvmlSession

    from .replica import Replica
    from .supervisor import Supervisor

_BACKEND_REACHABLE = (State.STARTING, State.SERVING, State.DRAINING)


def snapshot(sup: Supervisor) -> StatusSnapshot:
    gen = sup.gen
    t = gen.target if gen else None
    b = gen.backend if gen else None
    c = sup.proxy.counters
    requests = RequestCounters(
        total=c.requests_total, completed=c.completed, failed=c.failed_requests, rejected=c.rejected,
        retried=c.retried, client_disconnects=c.client_disconnects, in_flight=sup.proxy.in_flight,
        queued=sup.proxy.queued, generation=t.dispatched if t else 0, generation_limit=t.limit if t else None,
        generation_inherited=t.inherited if t else 0, not_forwarded=c.not_forwarded,
        connections=len(sup.proxy.gate.conns), connections_refused=sup.proxy.gate.refused + sup.proxy.gate.evicted,
    )
    children = [ch for r in sup.replicas if r.gen is not None and not r.gen.ended for ch in r.gen.listed_children]
    return StatusSnapshot(
        schema="vllm-guard-status/2",
        state=sup.state,
        state_for_s=round(sup.state_for_s, 1),
        generation=sup.generation,
        pid=os.getpid(),
        port=sup.cfg.server.port,
        model=sup.model,
        served_model=b.served_model if b else None,
        vllm_version=sup.vllm_version,
        gpu_name=sup.gpu_name or None,
        hold=sup.hold,
        backend_url=b.url if b is not None and sup.replicas[0].state in _BACKEND_REACHABLE else None,
        requests=requests,
        failures=sup.failures.total,
        recent_failures=[f.summary() for f in sup.failures],
        recycles=sup.recycles.total,
        recent_recycles=[r.summary() for r in sup.recycles],
        recycle_in_progress=sup.recycle_in_progress.summary() if sup.recycle_in_progress else None,
        children=children,
        memory=gen.memory if gen else None,
        ttft=sup.proxy.ttft_summary(),
        last_probe=sup.last_probe,
        patches=gen.patches if gen else {},
        ledger=sup.ledger.health(),
        recycle_strategy=sup.cfg.server.recycle_strategy,
        replicas=[replica_status(r) for r in sup.replicas],
    )


def replica_status(rep: Replica) -> ReplicaStatus:
    gen, nxt = rep.gen, rep.next
    t = gen.target if gen is not None else None
    phase: Literal["starting", "parked", "past_gate"] | None = None
    if nxt is not None:
        phase = "parked" if nxt.gate is not None and rep.state in (State.DRAINING, State.STOPPING) else "starting"
    elif gen is not None and gen.gate is not None and rep.state is State.STARTING:
        phase = "past_gate"
    return ReplicaStatus(
        index=rep.index, state=rep.state, generation=gen.number if gen is not None else 0, gpus=list(rep.plan.gpus),
        gpu_name=rep.gpu_name or None,
        backend_url=gen.backend.url if gen is not None and rep.state in _BACKEND_REACHABLE else None,
        in_flight=t.in_flight if t is not None else 0, served=t.dispatched if t is not None else 0,
        limit=t.limit if t is not None else None,
        next_generation=nxt.number if nxt is not None else (gen.number if phase == "past_gate" and gen else None),
        next_phase=phase, retiring=[lad.gen.number for lad in rep.retiring],
        recycle_strategy=rep.recycle.strategy if rep.recycle is not None else rep.last_strategy,
    )


def status_line(sup: Supervisor) -> str:
    """The one line systemd shows (`systemctl status`)."""
    t = sup.gen.target if sup.gen else None
    hold = f" HELD({sup.hold})" if sup.hold else ""
    reps = f" replicas={sum(r.state is State.SERVING for r in sup.replicas)}/{len(sup.replicas)}" \
        if len(sup.replicas) > 1 else ""
    return (f"{sup.state.value} gen={sup.generation} served={t.dispatched if t else 0} "
            f"in_flight={sup.proxy.in_flight} queued={sup.proxy.queued} failures={sup.failures.total}{reps}{hold}")


def visible_gpu_name(nvml: NvmlSession | None, env: Mapping[str, str]) -> str:
    """Name of the GPU(s) a child with `env` sees (the one GPU-index rule); '' on CPU."""
    if nvml is None or not nvml.available:
        return ""
    uuids = set(visible_uuids(nvml.static, env))
    names = [str(s["name"]) for s in nvml.static if s["uuid"] in uuids]
    return names[0] if len(set(names)) == 1 else ",".join(names)
