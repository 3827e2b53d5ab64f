"""OOM: a kernel kill of a service process, a cgroup oom_kill counter that rose, a CUDA OOM in
the child's log, or a child exit the runtime recorded.

The kernel line's pid is usually gone by the time anyone looks, so a kill is attributed to the
service by `task_memcg` (under the service's cgroup) as well as by any pid the service ever had.
The runtime restarts its own crashed child: these findings record and alert, they do not act.
"""

from __future__ import annotations

import re

from vllm_guard.core.ledger import EndClass, FailureKind

from .base import Action, CheckResult, Finding, Health, Sample, result
from .feed import FailureFeed
from .kernel import KernelEvent

CUDA_OOM = re.compile(r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory)")
MAX_PIDS = 4096


def in_cgroup(memcg: str | None, service: str | None) -> bool:
    if not memcg or not service or service == "/":
        return False
    return memcg == service or memcg.startswith(service.rstrip("/") + "/")


class OomDetector:
    name = "oom"

    def __init__(self) -> None:
        self.known: dict[int, str] = {}  # every pid the service ever had -> role
        self.context: dict[int, KernelEvent] = {}  # oom-kill: lines waiting for their Killed line
        self.feed = FailureFeed()
        self.cgroup_kills: int | None = None

    def is_supported(self, s: Sample) -> bool:
        return True  # kernel lines, cgroup and status each may be absent; judged per source

    def _remember(self, s: Sample) -> None:
        for c in s.status.children if s.status is not None else []:
            self.known[c.pid] = c.role.value
        while len(self.known) > MAX_PIDS:
            self.known.pop(next(iter(self.known)))

    def check(self, s: Sample) -> CheckResult:
        if not s.kernel_source and s.status is None and (s.cgroup is None or s.cgroup.oom_kill is None) \
                and not s.child_log:
            return result(self.name, s, Health.UNKNOWN, "nothing to judge: no kernel messages, no runtime "
                          "status, no cgroup counter")
        self._remember(s)
        service = s.service_cgroup
        findings: list[Finding] = []
        for ev in s.kernel_events:
            if ev.type == "oom_context" and ev.pid is not None:
                self.context[ev.pid] = ev
                while len(self.context) > MAX_PIDS:
                    self.context.pop(next(iter(self.context)))
                findings += self._kill(ev, ev, service)
            elif ev.type == "oom_killed" and ev.pid is not None:
                findings += self._kill(ev, self.context.get(ev.pid), service)
        findings += self._cgroup(s, bool(findings))
        for line in s.child_log:
            if CUDA_OOM.search(line):
                findings.append(Finding("cuda_oom", f"log:{hash(line)}", line.strip()[:300], EndClass.UNPLANNED,
                                        Action.ALERT, {"line": line.strip()[:1000]}))
        findings += self._exits(s)
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings)
        return result(self.name, s, Health.HEALTHY, "no OOM seen")

    def _kill(self, ev: KernelEvent, ctx: KernelEvent | None, service: str | None) -> list[Finding]:
        pid = ev.pid
        if pid is None:
            return []
        memcg = ctx.task_memcg if ctx is not None else None
        by = "task_memcg" if in_cgroup(memcg, service) else "pid" if pid in self.known else None
        if by is None:
            return []
        task = ev.task or (ctx.task if ctx is not None else None)
        data = {"pid": pid, "task": task, "attributed_by": by, "task_memcg": memcg,
                "role": self.known.get(pid), "line": ev.line}
        return [Finding("oom_kill", f"pid:{pid}", f"kernel OOM killed {task} (pid {pid}), a service process "
                        f"by {by}", EndClass.UNPLANNED, Action.ALERT, data)]

    def _cgroup(self, s: Sample, explained: bool) -> list[Finding]:
        n = s.cgroup.oom_kill if s.cgroup is not None else None
        if s.cgroup is None or n is None:
            return []
        prev, self.cgroup_kills = self.cgroup_kills, n
        if prev is None or n <= prev or explained:
            return []
        return [Finding("oom_kill", f"cgroup:{n}", f"cgroup oom_kill rose {prev} -> {n}", EndClass.UNPLANNED,
                        Action.ALERT, {"cgroup": vars(s.cgroup), "before": prev})]

    def _exits(self, s: Sample) -> list[Finding]:
        """Failures the runtime recorded (it restarts its own child: record only). Hangs are
        the hang detector's."""
        if s.status is None:
            return []
        new = self.feed.update(s.status)
        out = [Finding("child_exit", f"failure:{f.generation}:{f.at}",
                       f"runtime recorded {f.kind} of generation {f.generation} (exit {f.exit_code})",
                       EndClass.UNPLANNED, Action.NONE, f.model_dump(mode="json"))
               for f in new.failures if f.kind != FailureKind.HANG.value]
        if new.missed:
            out.append(Finding("child_exit", f"failures:{s.status.pid}:{s.status.failures}",
                               f"runtime recorded {new.missed} more failures than its status shows "
                               f"(see the ledger's failures table)", EndClass.UNPLANNED, Action.NONE,
                               {"missed": new.missed, "failures_total": s.status.failures}))
        return out
