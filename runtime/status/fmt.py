"""`vllm-guard status` for people: the snapshot in lines a reader takes in at a glance.

Durations as `4 m 05 s`, latencies as `352 ms` (core.timefmt); a value the runtime does not
know yet is `-`, never `None`. `--json` prints the snapshot itself instead.
"""

from __future__ import annotations

from typing import Any, Mapping

from vllm_guard.core.protocol import ConfigStatus, FailureSummary, RecycleSummary, ReplicaStatus, StatusSnapshot
from vllm_guard.core.timefmt import human_duration, human_latency


def _mb(v: float | None, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1f} MB" if sign else f"{v:.1f} MB"


def _recycle(r: RecycleSummary, in_progress: bool = False) -> str:
    took = "in progress" if in_progress or r.duration_s is None else f"took {human_duration(r.duration_s)}"
    if not in_progress and r.downtime_s is not None:
        took += f", {human_duration(r.downtime_s)} without a serving generation"
    how = f", {r.strategy}" if r.strategy else ""
    return (f"{r.reason} ({r.cls.value}{how}) of generation {r.generation} at {r.started}: {r.in_flight} in flight, "
            f"{r.queued} queued, {took}")


def _replica(r: ReplicaStatus) -> str:
    nxt = ""
    if r.next_generation is not None and r.next_phase is not None:
        nxt = f"; next generation {r.next_generation} {r.next_phase.replace('_', ' ')}"
    retiring = f"; draining {', '.join(map(str, r.retiring))}" if r.retiring else ""
    gpus = f" on {','.join(g[:12] for g in r.gpus)}" if r.gpus else ""
    limit = "" if r.limit is None else f"/{r.limit}"
    last = f", last recycle {r.recycle_strategy}" if r.recycle_strategy else ""
    phase = f" ({r.phase.replace('_', ' ')})" if r.phase and r.phase != r.state.value else ""
    sb = r.standby
    standby = "" if sb is None else (f"; standby generation {sb.generation} {sb.phase}, holding RSS {_mb(sb.rss_mb)}"
                                     + (f", GPU {_mb(sb.gpu_mb)}" if sb.gpu_mb is not None else ""))
    if sb is not None:
        nxt = ""
    return (f"{r.index}: {r.state.value}{phase}, generation {r.generation}{gpus}, {r.in_flight} in flight, "
            f"{r.served}{limit} served{last}{nxt}{standby}{retiring}")


def _config(c: ConfigStatus) -> list[str]:
    """The configuration's hash and file, what the last applied reload changed, and the last
    reload when it did not apply (refused: why, the key named)."""
    where = f" from {c.source}" if c.source else " (flags and defaults)"
    when = f", reloaded {c.applied_at}: {', '.join(c.changed)}" if c.applied_at else ""
    out = [f"config      {c.hash}{where}{when}"]
    last = c.last_reload
    if last is not None and last.outcome != "applied":
        out.append(f"            last reload ({last.reason}) {last.outcome} at {last.at}: {last.detail}")
    return out


def _failure(f: FailureSummary) -> str:
    restored = f"restored {f.restored_at}" if f.restored_at else "not restored yet"
    code = "" if f.exit_code is None else f", exit {f.exit_code}"
    detail = f": {f.detail}" if f.detail else ""
    return f"{f.kind} of generation {f.generation} at {f.at}{code}{detail}; {restored}"


def _by(counts: Mapping[Any, int]) -> str:
    """`{reason: n}` as `n reason, ...`, most first."""
    return ", ".join(f"{n} {getattr(k, 'value', k)}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def format_status(s: StatusSnapshot) -> str:
    r = s.requests
    limit = "" if r.generation_limit is None else f" (limit {r.generation_limit})"
    inherited = f", {r.generation_inherited} of them inherited backlog" if r.generation_inherited else ""
    lines = [
        f"state       {s.state.value} for {human_duration(s.state_for_s)}, generation {s.generation}, pid {s.pid}"
        + (f"   HOLD: {s.hold}" if s.hold else ""),
        f"model       {s.model}" + (f" (served as {s.served_model})" if s.served_model and s.served_model != s.model
                                    else "") + f", vLLM {s.vllm_version or '-'}, GPU {s.gpu_name or 'none'}",
        f"requests    {r.total} in all: {r.completed} completed, {r.rejected} rejected, {r.failed} failed, "
        f"{r.client_disconnects} client disconnects; {r.retried} retried, {r.resumed} resumed "
        f"({r.resumes} continuations, {r.unresumable} could not), {r.handed_over} handed over at a switch",
        *([f"            rejected: {_by(r.rejected_by)}"] if r.rejected_by else []),
        *([f"            failed: {_by(r.failed_by)}"] if r.failed_by else []),
        f"            now {r.in_flight} in flight, {r.queued} queued; this generation {r.generation}{limit}{inherited}",
    ]
    if len(s.replicas) > 1 or any(r.next_generation is not None or r.retiring or r.standby for r in s.replicas):
        lines.append(f"replicas    {len(s.replicas)}, recycle strategy {s.recycle_strategy}")
        lines += [f"  - {_replica(r)}" for r in s.replicas]
    if s.recycle_in_progress is not None:
        lines.append(f"recycling   {_recycle(s.recycle_in_progress, in_progress=True)}")
    lines.append(f"failures    {s.failures}" + (f" (last {len(s.recent_failures)})" if s.failures > len(s.recent_failures)
                                                 else ""))
    lines += [f"  - {_failure(f)}" for f in s.recent_failures]
    lines.append(f"recycles    {s.recycles}" + (f" (last {len(s.recent_recycles)})" if s.recycles > len(s.recent_recycles)
                                                 else ""))
    in_progress = s.recycle_in_progress
    lines += [f"  - {_recycle(x, in_progress=in_progress is not None and x == in_progress)}" for x in s.recent_recycles]
    children = ", ".join(f"{c.role.value}={c.pid}" for c in s.children) or "-"
    lines.append(f"backend     {s.backend_url or '-'}; processes {children}")
    t = s.ttft
    lines.append(f"ttft        p50 {human_latency(t.p50_s)}, p99 {human_latency(t.p99_s)} ({t.samples} recent requests)")
    p = s.last_probe
    if p is not None:
        verdict = "" if p.ok else ": " + (p.error or "failed") + {True: " (engine moving: starved, not hung)",
                                                                   False: " (no token moved)", None: ""}[p.engine_progress]
        lines.append(f"probe       {'ok' if p.ok else 'FAILED'} in {human_latency(p.latency_s)} at {p.at}{verdict}")
    m = s.memory
    if m is not None and m.current is not None:
        growth = (f"growth since warm-up RSS {_mb(m.growth.rss_mb, True)}, GPU {_mb(m.growth.gpu_mb, True)}"
                  if m.growth is not None else f"warming up ({m.warmup_requests} requests)")
        lines.append(f"memory      RSS {_mb(m.current.rss_mb)}, GPU {_mb(m.current.gpu_mb)}; {growth}")
    if s.config is not None:
        lines += _config(s.config)
    lg = s.ledger
    if lg.ok and not lg.pending_writes and not lg.failed_writes:
        lines.append("ledger      ok")
    else:
        lines.append(f"ledger      {'ok' if lg.ok else 'FAILING'}: {lg.pending_writes} writes pending, "
                     f"{lg.failed_writes} lost" + (f"; last error: {lg.last_error}" if lg.last_error else ""))
    return "\n".join(lines)
