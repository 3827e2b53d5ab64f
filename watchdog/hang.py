"""Hang: the runtime's own hang verdicts, and the watchdog's probe with the same rule —
a timed-out 1-token completion *and* no engine progress (tokens) in between. A hang the
runtime has not acted on asks for a restart; a runtime that stops answering is an alert
(systemd's WatchdogSec restarts a frozen runtime)."""

from __future__ import annotations

from vllm_guard.runtime.ledger import UNPLANNED

from .base import Action, CheckResult, Finding, Health, Sample, result
from .settings import WatchdogConfig


class HangDetector:
    name = "hang"

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.misses = 0
        self.tokens: float | None = None
        self.seen_failures: int | None = None
        self.status_misses = 0
        self.had_status = False

    def is_supported(self, s: Sample) -> bool:
        return True

    def check(self, s: Sample) -> CheckResult:
        st = s.get("status")
        findings: list[Finding] = []
        if st is None:
            self.status_misses += 1
            if self.had_status and self.status_misses * self.cfg.interval >= 3 * self.cfg.probe_timeout:
                findings.append(Finding("runtime_unresponsive", "runtime", f"runtime status unanswered for "
                                        f"{self.status_misses} ticks: {s['errors'].get('status')}",
                                        UNPLANNED, Action.ALERT))
            return result(self.name, s, Health.UNHEALTHY if findings else Health.UNKNOWN,
                          findings[0].cause if findings else "no runtime status", findings)
        self.had_status, self.status_misses = True, 0
        log = st.get("failure_log", [])
        if self.seen_failures is not None:
            for f in log[self.seen_failures:]:
                if f["kind"] == "hang":
                    findings.append(Finding("hang", f"failure:{f['generation']}:{f['at']}",
                                            f"runtime detected a hang: {f['detail']}", UNPLANNED, Action.NONE,
                                            {**f, "handled_by": "runtime"}))
        self.seen_failures = len(log)
        findings += self._probe(s)
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings,
                          {"probe_misses": self.misses})
        return result(self.name, s, Health.HEALTHY, "probe answers or engine progresses",
                      data={"probe_misses": self.misses})

    def _probe(self, s: Sample) -> list[Finding]:
        p, m = s.get("probe"), s.get("metrics") or {}
        if p is None:
            return []
        tokens = m.get("generation_tokens", 0.0) + m.get("prompt_tokens", 0.0) if m else None
        moved = tokens is not None and self.tokens is not None and tokens > self.tokens
        self.tokens = tokens if tokens is not None else self.tokens
        if p["ok"] or moved:
            self.misses = 0
            return []
        self.misses += 1
        if self.misses < self.cfg.hang_failures or s["status"].get("state") != "serving":
            return []
        gen = s["status"].get("generation")
        return [Finding("hang", f"probe:{gen}", f"{self.misses} probes failed ({p['error']}) and the engine "
                        f"made no progress; the runtime still says serving", UNPLANNED, Action.RESTART,
                        {"probe": p, "generation": gen, "handled_by": "watchdog"})]
