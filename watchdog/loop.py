"""The watchdog's runbook: collect every source (each with its own timeout), run every
detector, let the policy decide, act through the admin socket, record, export. Repeat.

One failing collector never stops the others: its value is None for that tick, its error is
in `collectors`, and the exporter shows it. NVML that is absent or broken is a failed
collector with its error, never "ok". Every replica the runtime's status lists is watched on
its own: its /metrics (collector `metrics:N`), its API server's CPU time, and its own probe, a
background task (it can take the probe timeout) that lands in the tick it finishes in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
import urllib.parse
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import aiohttp
import structlog

from vllm_guard.core import admin, gpu, host, vllm_api
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.nvml import NvmlSession
from vllm_guard.core.protocol import ChildProcess, ReplicaStatus, Role, RuntimeState, StatusSnapshot
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading, ReplicaBrief, StatusBrief
from vllm_guard.core.timefmt import iso
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult

from . import actions, kernel
from .base import Action, CgroupReading, CheckResult, Collected, Detector, Finding, Health, ReplicaReading, Sample
from .drift import DriftDetector
from .exporter import Exporter
from .hang import HangDetector
from .oom import OomDetector
from .policy import Policy
from .reboot import RebootDetector
from .store import WatchdogLedger
from .thermal import ThermalDetector
from .trace import NvmlSource, ReplayNvml
from .xid import XidDetector

log = structlog.get_logger("vllm_guard.watchdog")
MAX_LOG_LINES = 2000
USS_EVERY_S = 60.0
RELIABILITY_EVERY_TICKS = 60
T = TypeVar("T")


def open_nvml(cfg: WatchdogConfig) -> NvmlSource:
    """The GPU readings: the configured trace replayed, else the live GPU."""
    return ReplayNvml(cfg.nvml_trace) if cfg.nvml_trace else NvmlSession(cfg.nvml_timeout)


class Watchdog:
    """`env` is the service's environment (the GPUs it sees) and `gpus` its `[server] gpus`;
    `api_key` what its vLLM demands; `nvml` a source to use instead of the live session or the
    configured trace."""

    def __init__(self, cfg: WatchdogConfig, state_dir: str | Path, exporter: bool = True,
                 env: Mapping[str, str] | None = None, api_key: str | None = None,
                 nvml: NvmlSource | None = None, gpus: Sequence[str] = (), gpu_cap_mb: float = 0.0) -> None:
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.api_key = api_key
        self.nvml: NvmlSource = nvml if nvml is not None else open_nvml(cfg)
        if not self.nvml.available:
            log.warning("nvml_unavailable", error=self.nvml.error)
        try:  # the GPUs the service's replicas use (the runtime's rule)
            self.visible = set(gpu.service_gpus(self.nvml.static, gpus, env))
        except ValueError as e:  # the runtime refuses this [server] gpus too; watch what it could see
            log.warning("service_gpus_unknown", gpus=list(gpus), error=str(e))
            self.visible = set(gpu.visible_uuids(self.nvml.static, env))
        self.kernel = kernel.open_source(cfg.kernel)
        if self.kernel.error:
            log.warning("kernel_unavailable", error=self.kernel.error)
        self.ledger = WatchdogLedger(self.state_dir)
        boot, seen = self.ledger.last_host()
        self.hang = HangDetector(cfg)
        self.detectors: list[Detector] = [
            DriftDetector(cfg, gpu_cap_mb), ThermalDetector(cfg), OomDetector(), self.hang, XidDetector(),
            RebootDetector(boot, seen),
        ]
        self.policy = Policy(cfg)
        self.exporter = Exporter() if exporter else None
        self.open: dict[tuple[str, str], tuple[int, int | None]] = {}  # (kind, key) -> (row, replica)
        self.http: aiohttp.ClientSession | None = None
        self._probes: dict[int, tuple[asyncio.Task[ProbeResult], int]] = {}  # replica -> (probe, its generation)
        self._probe_at: dict[int, float] = {}
        self._api_pids: dict[tuple[int, int], int] = {}  # (replica, generation) -> its API server
        self._log_pos: dict[str, int] = {}
        self._last_sample = float("-inf")
        self._uss_at = float("-inf")
        self._uss: dict[int, float | None] = {}
        self.ticks = 0

    # -- collection ------------------------------------------------------------------------------
    async def _run(self, done: dict[str, Collected], name: str, work: Awaitable[T], timeout: float) -> T | None:
        t0 = time.monotonic()
        try:
            value = await asyncio.wait_for(work, timeout)
            done[name] = Collected(True, round(time.monotonic() - t0, 4))
            return value
        except asyncio.TimeoutError:
            done[name] = Collected(False, round(time.monotonic() - t0, 4), f"no answer in {timeout:g}s")
            return None
        except Exception as e:  # one collector's failure is data, not a crash: recorded, exported
            done[name] = Collected(False, round(time.monotonic() - t0, 4), f"{type(e).__name__}: {e}")
            return None

    async def collect(self) -> Sample:
        assert self.http is not None
        done: dict[str, Collected] = {}
        to = self.cfg.metrics_timeout
        status, rec, hostr, lines = await asyncio.gather(
            self._run(done, "status", admin.fetch_status(self.state_dir, to), to + 1),
            self._run(done, "nvml", asyncio.to_thread(self._nvml), self.cfg.nvml_timeout * 4),
            self._run(done, "host", asyncio.to_thread(lambda: HostReading.model_validate(host.host_memory())), to),
            self._run(done, "kernel", asyncio.to_thread(self.kernel.poll), to),
        )
        if rec is not None and rec.error:  # absent, lost or exhausted: say so, keep what it has
            done["nvml"] = Collected(False, done["nvml"].seconds, rec.error)
        t = rec.at_s if rec is not None and self.cfg.nvml_trace else time.time()
        s = Sample(at=iso(dt.datetime.fromtimestamp(t, dt.timezone.utc)), t=t, status=status, nvml=rec,
                   host=hostr, collectors=done, nvml_mismatch=self.nvml.mismatch,
                   kernel_source=self.kernel.name if self.kernel.active else "",
                   kernel_events=[e for e in (kernel.parse(x) for x in lines or []) if e is not None])
        if status is not None:
            s.procs, s.cgroup, s.replicas = await asyncio.gather(
                self._run(done, "procs", asyncio.to_thread(self._procs, status), to),
                self._run(done, "cgroup", asyncio.to_thread(self._cgroup, status.pid), to),
                self._replicas(done, status),
            )
            s.child_log = await asyncio.to_thread(self._child_logs, status)
        s.service_cgroup = self.cfg.service_cgroup or (host.service_path(status.pid) if status is not None else None)
        return s

    def _nvml(self) -> NvmlRecord:
        rec = NvmlRecord.model_validate(self.nvml.sample())
        if rec.gpus and any(g.uuid not in self.visible for g in rec.gpus):
            rec = rec.model_copy(update={"gpus": [g for g in rec.gpus if g.uuid in self.visible]})
        return rec

    async def _replicas(self, done: dict[str, Collected], st: StatusSnapshot) -> list[ReplicaReading]:
        reps = replicas_of(st)
        for gone in self._probes.keys() - {r.index for r in reps}:
            self._probes.pop(gone)[0].cancel()
        return list(await asyncio.gather(*(self._replica(done, st, r) for r in reps)))

    async def _replica(self, done: dict[str, Collected], st: StatusSnapshot, r: ReplicaStatus) -> ReplicaReading:
        """One replica's readings this tick: its /metrics, its API server's CPU time, its probe."""
        url, to = r.backend_url, self.cfg.metrics_timeout
        pid = self._api_pid(st, r) if url else None
        metrics, cpu = await asyncio.gather(
            self._run(done, f"metrics:{r.index}", self._metrics(url), to + 1) if url else _none(),
            asyncio.to_thread(host.cpu_seconds, pid) if pid else _none(),
        )
        return ReplicaReading(r.index, r.state, r.generation, url, time.monotonic(), metrics, cpu,
                              self._probe_result(st, r))

    def _api_pid(self, st: StatusSnapshot, r: ReplicaStatus) -> int | None:
        """The replica's API server: as the status says, else found among the children by the
        address its command line serves (cached per generation)."""
        if r.pid:
            return r.pid
        key = (r.index, r.generation)
        if key not in self._api_pids and r.backend_url:
            found = api_server_of(r.backend_url, st.children, host.cmdline)
            if found is None:
                return None
            self._api_pids = {k: v for k, v in self._api_pids.items() if k[0] != r.index}
            self._api_pids[key] = found
        return self._api_pids.get(key)

    async def _metrics(self, url: str) -> EngineMetrics:
        assert self.http is not None
        m = await vllm_api.metrics(self.http, url, self.cfg.metrics_timeout)
        if m is None:
            raise ConnectionError(f"no /metrics answer from {url}")
        return m

    def _procs(self, st: StatusSnapshot) -> dict[int, ProcReading]:
        """RSS every tick; USS (smaps, slow) every USS_EVERY_S, carried in between."""
        full = time.monotonic() - self._uss_at >= USS_EVERY_S
        raw = host.child_memory([{"pid": c.pid, "role": c.role.value} for c in st.children], full=full)
        procs = {int(pid): ProcReading.model_validate(m) for pid, m in raw.items()}
        if full:
            self._uss_at = time.monotonic()
            self._uss = {pid: p.uss_mb for pid, p in procs.items()}
        return {pid: p if p.uss_mb is not None or pid not in self._uss else
                p.model_copy(update={"uss_mb": self._uss[pid]}) for pid, p in procs.items()}

    def _cgroup(self, pid: int) -> CgroupReading | None:
        path = self.cfg.service_cgroup or host.service_path(pid)
        return CgroupReading.from_host(host.oom_kills(path, self.cfg.cgroup_root)) if path else None

    def _child_logs(self, st: StatusSnapshot) -> list[str]:
        """New lines of each replica's current generation log (the runtime writes them; we only read)."""
        gens = sorted({r.generation for r in replicas_of(st)} | ({st.generation} if st.generation else set()))
        return [line for g in gens if g for line in self._child_log(g)][-MAX_LOG_LINES:]

    def _child_log(self, generation: int) -> list[str]:
        p = self.state_dir / "logs" / f"generation-{generation}.log"
        try:
            size = p.stat().st_size
            pos = self._log_pos.setdefault(str(p), size if self.ticks == 0 else 0)
            if size <= pos:
                return []
            with open(p, "rb") as fh:
                fh.seek(pos)
                data = fh.read(1 << 20)
            self._log_pos[str(p)] = pos + len(data)
            return data.decode(errors="replace").splitlines()[-MAX_LOG_LINES:]
        except OSError:
            return []

    def _probe_result(self, st: StatusSnapshot, r: ReplicaStatus) -> ProbeResult | None:
        """The replica's probe that finished since the last tick (None if it probed an older
        generation); starts its next one when due. The model is the one the runtime serves; the
        key is the server's API key."""
        assert self.http is not None
        out = None
        held = self._probes.get(r.index)
        if held is not None and held[0].done():
            task, generation = self._probes.pop(r.index)
            if not task.cancelled() and generation == r.generation:
                out = task.result()
        due = time.monotonic() - self._probe_at.get(r.index, float("-inf")) >= self.cfg.probe_interval
        if r.backend_url and r.index not in self._probes and due:
            self._probe_at[r.index] = time.monotonic()
            task = asyncio.create_task(vllm_api.probe(self.http, r.backend_url, st.served_model or st.model,
                                                      self.api_key, timeout=self.cfg.probe_timeout))
            self._probes[r.index] = (task, r.generation)
        return out

    async def finish_probe(self, s: Sample) -> None:
        """Wait for every replica's probe in flight and put it in `s` (`--once`: a complete verdict)."""
        out = []
        for r in s.replicas:
            held = self._probes.pop(r.index, None)
            if held is not None and r.probe is None:
                result = await held[0]
                if held[1] == r.generation:
                    r = dataclasses.replace(r, probe=result)
            out.append(r)
        s.replicas = out

    # -- one tick --------------------------------------------------------------------------------
    async def tick(self) -> tuple[Sample, list[CheckResult]]:
        s = await self.collect()
        return s, await self.judge(s)

    async def judge(self, s: Sample) -> list[CheckResult]:
        """Detectors, policy, actions, ledger, exporter for one collected sample."""
        results = [d.check(s) for d in self.detectors]
        st = s.status
        present: set[tuple[str, str]] = set()
        opened = False
        for res in results:
            for f in res.findings:
                present.add((f.kind, f.key))
                if (f.kind, f.key) not in self.open:
                    await self._incident(f, s)
                    opened = True
        if st is not None and st.state is RuntimeState.SERVING and not st.hold:
            states: dict[int | None, RuntimeState] = {r.index: r.state for r in s.replicas}
            for k, (row, replica) in list(self.open.items()):  # gone, and its replica serves again
                if k not in present and states.get(replica, RuntimeState.SERVING) is RuntimeState.SERVING:
                    self.ledger.restored(row)
                    del self.open[k]
        if opened or time.monotonic() - self._last_sample >= self.cfg.sample_every:  # an incident's tick is kept
            self._last_sample = time.monotonic()
            self._record(s, results)
        if self.exporter is not None:
            self.exporter.update(results, s)
            self.exporter.escalated.set(1 if self.policy.escalated else 0)
            if self.ticks % RELIABILITY_EVERY_TICKS == 0:
                self.exporter.update_reliability(self.ledger.conn, time.time())
        self.ticks += 1
        return results

    async def _incident(self, f: Finding, s: Sample) -> None:
        st = s.status
        held = st is not None and (st.hold is not None or st.state is RuntimeState.HELD)
        state = st.state if st is not None else None
        if st is not None and f.replica is not None:  # judged by the state of the replica it is about
            state = next((r.state for r in s.replicas if r.index == f.replica), state)
        d = self.policy.decide(f, time.monotonic(), state, held)
        action = d.action.value if d.why in ("act", "record") else f"{d.why}:{f.action.value}"
        row = self.ledger.incident(f.kind, f.cause, f.cls, action, {**f.data, "key": f.key, "policy": d.why},
                                   replica=f.replica)
        self.open[(f.kind, f.key)] = (row, f.replica)
        log.warning("incident", id=row, kind=f.kind, cause=f.cause, cls=f.cls.value, action=action, replica=f.replica)
        if self.exporter is not None:
            self.exporter.incidents.labels(f.kind).inc()
        if d.why == "act" and d.action in (Action.RECYCLE, Action.RESTART, Action.HOLD):
            outcome = await actions.act(self.state_dir, d.action, f)
            self.ledger.set_action(row, f"{d.action.value}:{outcome}")
            log.warning("action", id=row, action=d.action.value, reason=actions.reason_of(f), outcome=str(outcome),
                        replica=f.replica)
            if self.exporter is not None:
                self.exporter.actions.labels(d.action.value, outcome.result).inc()
        if d.action in (Action.ALERT, Action.HOLD) or d.why.startswith("escalated"):
            payload = {"id": row, "kind": f.kind, "cause": f.cause, "class": f.cls.value, "action": action,
                       "at": s.at, "data": f.data}
            await actions.alert(self.cfg.alert_command, self.cfg.alert_webhook, payload)

    def _record(self, s: Sample, results: list[CheckResult]) -> None:
        st = s.status
        brief = None if st is None else StatusBrief.from_snapshot(st)
        hung: dict[str, dict[str, Any]] = next(
            (r.data.get("replicas", {}) for r in results if r.name == self.hang.name), {})
        replicas = {}
        for r in s.replicas:
            h = hung.get(str(r.index), {})
            replicas[r.index] = (r.metrics, ReplicaBrief(
                state=r.state.value, generation=r.generation, backend_url=r.url, hang=h.get("health", "unknown"),
                probe_misses=self.hang.misses(r.index), reason=h.get("reason", "")))
        self.ledger.sample(nvml=s.nvml if s.nvml is not None and s.nvml.gpus else None, procs=s.procs or None,
                           host=s.host, status=brief, verdicts={r.name: r.health.value for r in results},
                           replicas=replicas)

    # -- lifetime --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = aiohttp.ClientSession()
        if self.exporter is not None and self.cfg.prometheus_port:
            self.exporter.serve(self.cfg.prometheus_addr, self.cfg.prometheus_port)

    async def close(self) -> None:
        for task, _ in self._probes.values():
            task.cancel()
        if self.http is not None:
            await self.http.close()
        self.kernel.close()
        self.nvml.close()
        self.ledger.close()

    def replay_done(self) -> bool:
        return isinstance(self.nvml, ReplayNvml) and self.nvml.exhausted


async def _none() -> None:
    return None


def replicas_of(st: StatusSnapshot) -> list[ReplicaStatus]:
    """The replicas a status lists (a status without the list: its one backend as replica 0)."""
    if st.replicas:
        return list(st.replicas)
    return [ReplicaStatus(index=0, state=st.state, generation=st.generation, backend_url=st.backend_url)]


def api_server_of(url: str, children: Sequence[ChildProcess], cmdline: Callable[[int], list[str]]) -> int | None:
    """The API server among `children` that serves `url`: its command line names the address
    (`--uds PATH` for a socket URL, `--port N` for TCP), as the runtime starts every generation."""
    sock = vllm_api.unix_socket_of(url)
    flag, value = ("--uds", sock) if sock is not None else ("--port", str(urllib.parse.urlsplit(url).port or ""))
    for c in children:
        if c.role is not Role.API_SERVER:
            continue
        args = cmdline(c.pid)
        if any(a == flag and b == value for a, b in zip(args, args[1:])) or f"{flag}={value}" in args:
            return c.pid
    return None



def verdicts_json(s: Sample, results: list[CheckResult]) -> dict[str, Any]:
    """What `--once --json` prints: the full sample and every detector's verdict."""
    return {"sample": s.to_json(), "verdicts": [r.public() for r in results],
            "healthy": all(r.health in (Health.HEALTHY, Health.UNKNOWN, Health.INITIALIZING) for r in results)}


def summary_text(s: Sample, results: list[CheckResult]) -> str:
    """What `--once` prints for a person: one line per detector, then failed sources."""
    width = max(len(r.name) for r in results)
    lines = [f"{r.name:<{width}}  {r.health.value:<12}  {r.reason}" for r in results]
    failed = [f"  {name}: {c.error}" for name, c in s.collectors.items() if not c.ok]
    if failed:
        lines += ["sources that failed this tick:", *failed]
    return "\n".join(lines)
