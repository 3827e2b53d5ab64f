"""The watchdog's runbook: collect every source (each with its own timeout), run every
detector, let the policy decide, act through the admin socket, record, export. Repeat.

One failing collector never stops the others: its value is None for that tick, its error is
in `errors`, and the exporter shows it. The probe runs as a background task (it can take the
probe timeout) and lands in the tick it finishes in.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path
from typing import Any, Awaitable

import aiohttp
import structlog

from vllm_guard.runtime.ledger import iso

from . import actions, host, kernel, service
from .base import Action, CheckResult, Detector, Finding, Health, Sample
from .drift import DriftDetector
from .exporter import Exporter
from .hang import HangDetector
from .nvml import NvmlSampler, visible_uuids
from .oom import OomDetector
from .policy import Policy
from .reboot import RebootDetector
from .settings import WatchdogConfig
from .store import WatchdogLedger
from .thermal import ThermalDetector
from .trace import ReplayNvml
from .xid import XidDetector

log = structlog.get_logger("vllm_guard.watchdog")
STATUS_KEYS = ("state", "generation", "requests_total", "requests_generation", "in_flight", "queued",
               "failures", "hold", "backend_url")
MAX_LOG_LINES = 2000
USS_EVERY_S = 60.0


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, state_dir: str | Path, exporter: bool = True) -> None:
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.nvml: NvmlSampler | ReplayNvml = ReplayNvml(cfg.nvml_trace) if cfg.nvml_trace else \
            NvmlSampler(cfg.nvml_timeout)
        if not self.nvml.available:
            log.warning("nvml_unavailable", error=self.nvml.error)
        self.visible = set(visible_uuids(self.nvml.static))  # the GPUs the service sees
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
        self._probe: asyncio.Task[dict[str, Any]] | None = None
        self._probe_at = 0.0
        self._log_pos: dict[str, int] = {}
        self._last_sample = 0.0
        self._uss_at = float("-inf")
        self._uss: dict[str, Any] = {}
        self.ticks = 0

    # -- collection ------------------------------------------------------------------------------
    async def _run(self, s: Sample, name: str, work: Awaitable[Any], timeout: float) -> Any:
        t0 = time.monotonic()
        try:
            value = await asyncio.wait_for(work, timeout)
            s["collectors"][name] = (True, round(time.monotonic() - t0, 4))
            return value
        except Exception as e:  # one collector's failure is data, not a crash
            s["errors"][name] = f"{type(e).__name__}: {e}"
            s["collectors"][name] = (False, round(time.monotonic() - t0, 4))
            return None

    async def collect(self) -> Sample:
        assert self.http is not None
        s: Sample = {"errors": {}, "collectors": {}}
        to = self.cfg.metrics_timeout
        s["status"], s["nvml"], s["host"], lines = await asyncio.gather(
            self._run(s, "status", service.status(self.state_dir, to), to + 1),
            self._run(s, "nvml", asyncio.to_thread(self.nvml.sample), self.cfg.nvml_timeout * 4),
            self._run(s, "host", asyncio.to_thread(host.host_memory), to),
            self._run(s, "kernel", asyncio.to_thread(self.kernel.poll), to),
        )
        if s["nvml"] and s["nvml"].get("gpus"):
            s["nvml"]["gpus"] = [g for g in s["nvml"]["gpus"] if g["uuid"] in self.visible]
        t = (s["nvml"] or {}).get("at_s") if self.cfg.nvml_trace else None
        s["t"] = float(t) if t is not None else time.time()
        s["at"] = iso(dt.datetime.fromtimestamp(s["t"], dt.timezone.utc))
        s["kernel_events"] = [e for e in (kernel.parse(x) for x in lines or []) if e is not None]
        s["nvml_mismatch"] = bool(getattr(self.nvml, "mismatch", False))
        st = s["status"] or {}
        url = st.get("backend_url")
        s["procs"], s["metrics"], s["cgroup"] = await asyncio.gather(
            self._run(s, "procs", asyncio.to_thread(self._procs, st.get("children", [])), to),
            self._run(s, "metrics", service.metrics(self.http, url, to), to + 1) if url else _none(),
            self._run(s, "cgroup", asyncio.to_thread(self._cgroup, st.get("pid")), to),
        )
        s["service_cgroup"] = self.cfg.service_cgroup or (host.service_path(st["pid"]) if st.get("pid") else None)
        s["child_log"] = await asyncio.to_thread(self._child_log, st.get("generation"))
        s["probe"] = self._probe_result(url)
        return s

    def _procs(self, children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """RSS every tick; USS (smaps, slow) every USS_EVERY_S, carried in between."""
        full = time.monotonic() - self._uss_at >= USS_EVERY_S
        procs = host.child_memory(children, full=full)
        if full:
            self._uss_at = time.monotonic()
            self._uss = {pid: m.get("uss_mb") for pid, m in procs.items()}
        for pid, m in procs.items():
            m.setdefault("uss_mb", self._uss.get(pid))
        return procs

    def _cgroup(self, pid: int | None) -> dict[str, Any] | None:
        path = self.cfg.service_cgroup or (host.service_path(pid) if pid else "")
        return host.oom_kills(path, self.cfg.cgroup_root) if path else None

    def _child_log(self, generation: int | None) -> list[str]:
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

    def _probe_result(self, url: str | None) -> dict[str, Any] | None:
        assert self.http is not None
        out = None
        if self._probe is not None and self._probe.done():
            out = self._probe.result() if not self._probe.cancelled() else None
            self._probe = None
        if url and self._probe is None and time.monotonic() - self._probe_at >= self.cfg.probe_interval:
            self._probe_at = time.monotonic()
            self._probe = asyncio.create_task(service.probe(self.http, url, self.cfg.probe_timeout))
        return out

    # -- one tick --------------------------------------------------------------------------------
    async def tick(self) -> tuple[Sample, list[CheckResult]]:
        s = await self.collect()
        results = [d.check(s) for d in self.detectors]
        st = s["status"] or {}
        present: set[tuple[str, str]] = set()
        for res in results:
            for f in res.findings:
                present.add((f.kind, f.key))
                if (f.kind, f.key) not in self.open:
                    await self._incident(f, s)
        if st.get("state") == "serving" and not st.get("hold"):
            for k in [k for k in self.open if k not in present]:
                self.ledger.restored(self.open.pop(k))
        if time.monotonic() - self._last_sample >= self.cfg.sample_every:
            self._last_sample = time.monotonic()
            self.ledger.sample(self._ledger_parts(s, results))
        if self.exporter is not None:
            self.exporter.update(results, s)
            self.exporter.escalated.set(1 if self.policy.escalated else 0)
            if self.ticks % 60 == 0:
                mtbf = self.ledger.mtbf_hours()
                if mtbf is not None:
                    self.exporter.mtbf.set(mtbf)
        self.ticks += 1
        return s, results

    async def _incident(self, f: Finding, s: Sample) -> None:
        st = s["status"] or {}
        d = self.policy.decide(f, time.monotonic(), st.get("state") if s["status"] else None, bool(st.get("hold")))
        action = d.action.value if d.why in ("act", "record") else f"{d.why}:{f.action.value}"
        row = self.ledger.incident(f.kind, f.cause, f.cls, action, {**f.data, "key": f.key, "policy": d.why})
        self.open[(f.kind, f.key)] = row
        log.warning("incident", id=row, kind=f.kind, cause=f.cause, cls=f.cls, action=action)
        if self.exporter is not None:
            self.exporter.incidents.labels(f.kind).inc()
        if d.why == "act" and d.action in (Action.RECYCLE, Action.RESTART, Action.HOLD):
            outcome = await actions.act(self.state_dir, d.action, f)
            self.ledger.set_action(row, f"{d.action.value}:{outcome}")
            log.warning("action", id=row, action=d.action.value, reason=actions.reason_of(f), outcome=outcome)
            if self.exporter is not None:
                self.exporter.actions.labels(d.action.value, "ok" if outcome == "ok" else "error").inc()
        if d.action in (Action.ALERT, Action.HOLD) or d.why.startswith("escalated"):
            payload = {"id": row, "kind": f.kind, "cause": f.cause, "class": f.cls, "action": action,
                       "at": s["at"], "data": f.data}
            await actions.alert(self.cfg.alert_command, self.cfg.alert_webhook, payload)

    def _ledger_parts(self, s: Sample, results: list[CheckResult]) -> dict[str, Any]:
        st = s["status"]
        return {
            "nvml": s["nvml"] if s["nvml"] and s["nvml"].get("gpus") else None,
            "procs": s["procs"] or None,
            "host": s["host"],
            "metrics": s["metrics"],
            "status": {k: st.get(k) for k in STATUS_KEYS} if st else None,
            "verdicts": {r.name: r.health.value for r in results},
        }

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
        return bool(getattr(self.nvml, "exhausted", False))


async def _none() -> None:
    return None


def verdicts_json(s: Sample, results: list[CheckResult]) -> dict[str, Any]:
    """What `--once --json` prints: the full sample and every detector's verdict."""
    sample = {k: v for k, v in s.items() if k != "collectors"}
    sample["collectors"] = {k: {"ok": ok, "seconds": sec} for k, (ok, sec) in s["collectors"].items()}
    return {"sample": sample, "verdicts": [r.public() for r in results],
            "healthy": all(r.health in (Health.HEALTHY, Health.UNKNOWN, Health.INITIALIZING) for r in results)}
