"""The watchdog's runbook: collect every source (each with its own timeout), run every
detector, let the policy decide, act through the admin socket, record, export. Repeat.

One failing collector never stops the others: its value is None for that tick, its error is
in `collectors`, and the exporter shows it. NVML that is absent or broken is a failed
collector with its error, never "ok". The probe runs as a background task (it can take the
probe timeout) and lands in the tick it finishes in.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path
from typing import Any, Awaitable, Mapping, TypeVar

import aiohttp
import structlog

from vllm_guard.core import admin, gpu, host, vllm_api
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.nvml import NvmlSession
from vllm_guard.core.protocol import RuntimeState, StatusSnapshot
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading, StatusBrief
from vllm_guard.core.timefmt import iso
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult

from . import actions, kernel
from .base import Action, CgroupReading, CheckResult, Collected, Detector, Finding, Health, Sample
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


class Watchdog:
    """`env` is the service's environment (GPU selection); `api_key` what its vLLM demands;
    `nvml` a source to use instead of the live session or the configured trace."""

    def __init__(self, cfg: WatchdogConfig, state_dir: str | Path, exporter: bool = True,
                 env: Mapping[str, str] | None = None, api_key: str | None = None,
                 nvml: NvmlSource | None = None) -> None:
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.api_key = api_key
        self.nvml: NvmlSource = nvml if nvml is not None else \
            ReplayNvml(cfg.nvml_trace) if cfg.nvml_trace else NvmlSession(cfg.nvml_timeout)
        if not self.nvml.available:
            log.warning("nvml_unavailable", error=self.nvml.error)
        self.visible = set(gpu.visible_uuids(self.nvml.static, env))  # the GPUs the service sees
        self.kernel = kernel.open_source(cfg.kernel)
        if self.kernel.error:
            log.warning("kernel_unavailable", error=self.kernel.error)
        self.ledger = WatchdogLedger(self.state_dir)
        boot, seen = self.ledger.last_host()
        self.detectors: list[Detector] = [
            DriftDetector(cfg), ThermalDetector(cfg), OomDetector(), HangDetector(cfg), XidDetector(),
            RebootDetector(boot, seen),
        ]
        self.policy = Policy(cfg)
        self.exporter = Exporter() if exporter else None
        self.open: dict[tuple[str, str], int] = {}
        self.http: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[ProbeResult] | None = None
        self._probe_at = float("-inf")
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
            url = status.backend_url
            s.procs, s.metrics, s.cgroup = await asyncio.gather(
                self._run(done, "procs", asyncio.to_thread(self._procs, status), to),
                self._run(done, "metrics", self._metrics(url), to + 1) if url else _none(),
                self._run(done, "cgroup", asyncio.to_thread(self._cgroup, status.pid), to),
            )
            s.child_log = await asyncio.to_thread(self._child_log, status.generation)
            s.probe = self._probe_result(status)
        s.service_cgroup = self.cfg.service_cgroup or (host.service_path(status.pid) if status is not None else None)
        return s

    def _nvml(self) -> NvmlRecord:
        rec = NvmlRecord.model_validate(self.nvml.sample())
        if rec.gpus and any(g.uuid not in self.visible for g in rec.gpus):
            rec = rec.model_copy(update={"gpus": [g for g in rec.gpus if g.uuid in self.visible]})
        return rec

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

    def _child_log(self, generation: int) -> list[str]:
        """New lines of the current generation's log (the runtime writes it; we only read)."""
        if not generation:
            return []
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

    def _probe_result(self, st: StatusSnapshot) -> ProbeResult | None:
        """The probe that finished since the last tick; starts the next one when due. The
        model is the one the runtime serves; the key is the server's API key."""
        assert self.http is not None
        out = None
        if self._probe is not None and self._probe.done():
            out = self._probe.result() if not self._probe.cancelled() else None
            self._probe = None
        url = st.backend_url
        if url and self._probe is None and time.monotonic() - self._probe_at >= self.cfg.probe_interval:
            self._probe_at = time.monotonic()
            self._probe = asyncio.create_task(vllm_api.probe(
                self.http, url, st.served_model or st.model, self.api_key, timeout=self.cfg.probe_timeout))
        return out

    async def finish_probe(self, s: Sample) -> None:
        """Wait for the probe in flight and put it in `s` (`--once`: a complete verdict)."""
        if self._probe is not None:
            s.probe = await self._probe
            self._probe = None

    # -- one tick --------------------------------------------------------------------------------
    async def tick(self) -> tuple[Sample, list[CheckResult]]:
        s = await self.collect()
        return s, await self.judge(s)

    async def judge(self, s: Sample) -> list[CheckResult]:
        """Detectors, policy, actions, ledger, exporter for one collected sample."""
        results = [d.check(s) for d in self.detectors]
        st = s.status
        present: set[tuple[str, str]] = set()
        for res in results:
            for f in res.findings:
                present.add((f.kind, f.key))
                if (f.kind, f.key) not in self.open:
                    await self._incident(f, s)
        if st is not None and st.state is RuntimeState.SERVING and not st.hold:
            for k in [k for k in self.open if k not in present]:
                self.ledger.restored(self.open.pop(k))
        if time.monotonic() - self._last_sample >= self.cfg.sample_every:
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
        d = self.policy.decide(f, time.monotonic(), st.state if st is not None else None, held)
        action = d.action.value if d.why in ("act", "record") else f"{d.why}:{f.action.value}"
        row = self.ledger.incident(f.kind, f.cause, f.cls, action, {**f.data, "key": f.key, "policy": d.why})
        self.open[(f.kind, f.key)] = row
        log.warning("incident", id=row, kind=f.kind, cause=f.cause, cls=f.cls.value, action=action)
        if self.exporter is not None:
            self.exporter.incidents.labels(f.kind).inc()
        if d.why == "act" and d.action in (Action.RECYCLE, Action.RESTART, Action.HOLD):
            outcome = await actions.act(self.state_dir, d.action, f)
            self.ledger.set_action(row, f"{d.action.value}:{outcome}")
            log.warning("action", id=row, action=d.action.value, reason=actions.reason_of(f), outcome=str(outcome))
            if self.exporter is not None:
                self.exporter.actions.labels(d.action.value, outcome.result).inc()
        if d.action in (Action.ALERT, Action.HOLD) or d.why.startswith("escalated"):
            payload = {"id": row, "kind": f.kind, "cause": f.cause, "class": f.cls.value, "action": action,
                       "at": s.at, "data": f.data}
            await actions.alert(self.cfg.alert_command, self.cfg.alert_webhook, payload)

    def _record(self, s: Sample, results: list[CheckResult]) -> None:
        st = s.status
        brief = None if st is None else StatusBrief.from_snapshot(st)
        self.ledger.sample(nvml=s.nvml if s.nvml is not None and s.nvml.gpus else None, procs=s.procs or None,
                           host=s.host, metrics=s.metrics, status=brief,
                           verdicts={r.name: r.health.value for r in results})

    # -- lifetime --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = aiohttp.ClientSession()
        if self.exporter is not None and self.cfg.prometheus_port:
            self.exporter.serve(self.cfg.prometheus_addr, self.cfg.prometheus_port)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self.http is not None:
            await self.http.close()
        self.kernel.close()
        self.nvml.close()
        self.ledger.close()

    def replay_done(self) -> bool:
        return isinstance(self.nvml, ReplayNvml) and self.nvml.exhausted


async def _none() -> None:
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
