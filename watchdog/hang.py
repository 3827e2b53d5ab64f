"""Hang: the runtime's own hang verdicts, and the watchdog's probe with the same rule —
a timed-out 1-token completion *and* no engine progress (tokens) since the last probe (a
probe answered with an HTTP error, e.g. 401 for a wrong API key, is degraded, not a hang). A hang
the runtime has not acted on asks for a restart; a runtime that stops answering is an alert
(systemd's WatchdogSec restarts a frozen runtime).

The runtime's verdicts come from its bounded status (`recent_failures` + the `failures`
total, through `FailureFeed`): new failures are counted by the total, so a burst larger than
the window is still counted."""

from __future__ import annotations

from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.protocol import RuntimeState
from vllm_guard.core.vllm_api import EngineMetrics, ProbeResult, progressed

from .base import Action, CheckResult, Finding, Health, Sample, result
from .feed import FailureFeed


class HangDetector:
    name = "hang"

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.misses = 0
        self.metrics: EngineMetrics | None = None  # at the last probe
        self.feed = FailureFeed()
        self.status_misses = 0
        self.had_status = False
        self.missed_failures = 0
        self.last_probe: ProbeResult | None = None

    def is_supported(self, s: Sample) -> bool:
        return True

    def check(self, s: Sample) -> CheckResult:
        st = s.status
        findings: list[Finding] = []
        if st is None:
            self.status_misses += 1
            if self.had_status and self.status_misses * self.cfg.interval >= 3 * self.cfg.probe_timeout:
                findings.append(Finding("runtime_unresponsive", "runtime", f"runtime status unanswered for "
                                        f"{self.status_misses} ticks: {s.error('status')}",
                                        EndClass.UNPLANNED, Action.ALERT))
            return result(self.name, s, Health.UNHEALTHY if findings else Health.UNKNOWN,
                          findings[0].cause if findings else f"no runtime status: {s.error('status')}", findings)
        self.had_status, self.status_misses = True, 0
        new = self.feed.update(st)
        self.missed_failures += new.missed
        for f in new.failures:
            if f.kind == FailureKind.HANG.value:
                findings.append(Finding("hang", f"failure:{f.generation}:{f.at}",
                                        f"runtime detected a hang: {f.detail}", EndClass.UNPLANNED, Action.NONE,
                                        {**f.model_dump(mode="json"), "handled_by": "runtime"}))
        findings += self._probe(s, st.state, st.generation)
        data = {"probe_misses": self.misses, "failures_total": st.failures,
                "failures_not_in_status": self.missed_failures}
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings, data)
        last = self.last_probe  # a probe lands in one tick; its verdict holds until the next one
        if last is not None and not last.ok:
            why = "timed out, but the engine progresses" if last.timed_out and not self.misses else \
                f"{self.misses} timed out in a row" if last.timed_out else "failed without timing out (not a hang)"
            return result(self.name, s, Health.DEGRADED, f"probe {why}: {last.error}", data=data)
        return result(self.name, s, Health.HEALTHY, "probe answers or engine progresses", data=data)

    def _probe(self, s: Sample, state: RuntimeState, generation: int) -> list[Finding]:
        p = s.probe
        if p is None:
            return []
        self.last_probe = p
        moved = progressed(self.metrics, s.metrics) is True
        if s.metrics is not None:
            self.metrics = s.metrics
        if p.ok or moved or not p.timed_out:  # an HTTP error (401, 503...) is an answer, not a hang
            self.misses = 0
            return []
        self.misses += 1
        if self.misses < self.cfg.hang_failures or state is not RuntimeState.SERVING:
            return []
        return [Finding("hang", f"probe:{generation}", f"{self.misses} probes failed ({p.error}) and the engine "
                        f"made no progress; the runtime still says serving", EndClass.UNPLANNED, Action.RESTART,
                        {"probe": {"ok": p.ok, "error": p.error, "latency_s": round(p.latency_s, 3)},
                         "generation": generation, "handled_by": "watchdog"})]
