"""Hang: the runtime's own hang verdicts, and the watchdog's probe of every replica judged by the
runtime's rule (`core.hang`, the one definition): a timed-out 1-token completion is a miss only
when nothing progressed over the window (no token moved in /metrics, or /metrics silent and
the API server used no CPU); `hang_failures` misses in a row of one generation, while its
replica serves, ask for a restart of that replica. A probe answered with an HTTP error (401
for a wrong API key, 503) is degraded, never a hang. A runtime that stops answering is an alert
(systemd's WatchdogSec restarts a frozen runtime).

Each replica has its own window and count (`ReplicaWatch`), started afresh with each of its
generations. The runtime's verdicts come from its bounded status (`recent_failures` + the
`failures` total, through `FailureFeed`): new failures are counted by the total, so a burst
larger than the window is still counted."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from vllm_guard.core import hang
from vllm_guard.core.config import WatchdogConfig
from vllm_guard.core.ledger import EndClass, FailureKind
from vllm_guard.core.protocol import RuntimeState
from vllm_guard.core.vllm_api import ProbeResult

from .base import Action, CheckResult, Finding, Health, ReplicaReading, Sample, result
from .feed import FailureFeed

HEALTH_ORDER = (Health.HEALTHY, Health.UNKNOWN, Health.INITIALIZING, Health.DEGRADED, Health.UNHEALTHY)


@dataclass
class ReplicaWatch:
    """One replica's current generation under watch: its progress window, its miss count, the
    timed-out probes waiting for their window to be covered, and its last verdict."""

    generation: int
    window: hang.ProgressWindow
    rule: hang.HangRule
    pending: collections.deque[ProbeResult] = field(default_factory=lambda: collections.deque(maxlen=16))
    last: ProbeResult | None = None
    judged: hang.Judgement | None = None
    verdict: hang.Verdict | None = None
    health: Health = Health.UNKNOWN
    reason: str = "no probe answered yet"


class HangDetector:
    name = "hang"

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.watches: dict[int, ReplicaWatch] = {}
        self.feed = FailureFeed()
        self.status_misses = 0
        self.had_status = False
        self.missed_failures = 0

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
        for r in s.replicas:
            findings += self._replica(r)
        for gone in self.watches.keys() - {r.index for r in s.replicas}:
            del self.watches[gone]
        data = {"failures_total": st.failures, "failures_not_in_status": self.missed_failures,
                "replicas": {str(i): {"generation": w.generation, "health": w.health.value, "reason": w.reason,
                                      "probe_misses": w.rule.misses,
                                      "verdict": w.verdict.value if w.verdict is not None else None}
                             for i, w in sorted(self.watches.items())}}
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings, data)
        health, reason = self._overall()
        return result(self.name, s, health, reason, data=data)

    def misses(self, replica: int) -> int:
        w = self.watches.get(replica)
        return w.rule.misses if w is not None else 0

    def _watch(self, r: ReplicaReading) -> ReplicaWatch:
        w = self.watches.get(r.index)
        if w is None or w.generation != r.generation:  # a new generation starts with a clean slate
            keep = hang.keep(self.cfg.progress_window, self.cfg.probe_timeout, self.cfg.probe_interval)
            w = self.watches[r.index] = ReplicaWatch(r.generation, hang.ProgressWindow(keep),
                                                     hang.HangRule(self.cfg.hang_failures))
        return w

    def _replica(self, r: ReplicaReading) -> list[Finding]:
        """Add this tick's scrape to the replica's window, then judge every probe whose window is
        covered (oldest first): a probe lands in one tick, its window may close ticks later."""
        w = self._watch(r)
        if r.url is not None:
            w.window.add(r.at, r.metrics.tokens if r.metrics is not None else None, r.cpu_s)
        if r.probe is not None:
            w.last = r.probe
            w.pending.append(r.probe)
        out: list[Finding] = []
        while w.pending:
            p = w.pending[0]
            verdict = w.window.verdict(r.at, hang.span(self.cfg.progress_window, p)) if hang.asks_window(p) else None
            judged = w.rule.judge(p, verdict)
            if judged is hang.Judgement.WAIT:
                break
            w.pending.popleft()
            w.judged, w.verdict = judged, verdict
            if judged is hang.Judgement.HUNG and r.state is RuntimeState.SERVING:
                out.append(self._finding(r, w, p, verdict))
        w.health, w.reason = self._health(w, out)
        return out

    def _finding(self, r: ReplicaReading, w: ReplicaWatch, p: ProbeResult, verdict: hang.Verdict | None) -> Finding:
        why = hang.WHY.get(verdict, "no progress") if verdict is not None else "no progress"
        span = hang.span(self.cfg.progress_window, p)
        return Finding("hang", f"probe:{r.generation}",
                       f"replica {r.index}: {w.rule.misses} probes timed out ({p.error}) and {why} in {span:.0f} s; "
                       f"the runtime still says serving", EndClass.UNPLANNED, Action.RESTART,
                       {"probe": {"ok": p.ok, "error": p.error, "latency_s": round(p.latency_s, 3)},
                        "verdict": verdict.value if verdict is not None else None, "replica": r.index,
                        "generation": r.generation, "handled_by": "watchdog"}, replica=r.index)

    @staticmethod
    def _health(w: ReplicaWatch, found: list[Finding]) -> tuple[Health, str]:
        """A probe's verdict holds until the next one is judged."""
        if found:
            return Health.UNHEALTHY, found[0].cause
        last = w.last
        if last is None:
            return Health.UNKNOWN, "no probe answered yet"
        if w.pending:
            return Health.DEGRADED, f"probe timed out, judged once its window is covered: {w.pending[-1].error}"
        if last.ok:
            return Health.HEALTHY, "probe answers"
        if not last.timed_out:
            return Health.DEGRADED, f"probe failed without timing out (not a hang): {last.error}"
        if w.judged is hang.Judgement.HUNG:  # until a probe answers or a new generation starts
            return Health.UNHEALTHY, f"hung: {w.rule.misses} probes timed out in a row with no progress " \
                                     f"({w.verdict.value if w.verdict else '?'}): {last.error}"
        if w.judged is hang.Judgement.STARVED:
            return Health.DEGRADED, f"probe timed out, but the engine is starved, not hung " \
                                    f"({w.verdict.value if w.verdict else '?'}): {last.error}"
        return Health.DEGRADED, f"probe {w.rule.misses} timed out in a row with no progress: {last.error}"

    def _overall(self) -> tuple[Health, str]:
        if not self.watches:
            return Health.UNKNOWN, "no replica to probe"
        many = len(self.watches) > 1
        worst = max(self.watches.items(), key=lambda kv: (HEALTH_ORDER.index(kv[1].health), -kv[0]))
        i, w = worst
        if w.health is Health.HEALTHY:
            return Health.HEALTHY, "every replica's probe answers" if many else "probe answers"
        return w.health, f"replica {i}: {w.reason}" if many else w.reason
