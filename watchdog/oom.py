"""OOM: a kernel kill of a service process, a cgroup oom_kill counter that rose, a CUDA OOM in
the child's log, or a child exit the runtime recorded.

The kernel line's pid is usually gone by the time anyone looks, so a kill is attributed to the
service by `task_memcg` (under the service's cgroup) as well as by any pid the service ever had.
The runtime restarts its own crashed child: these findings record and alert, they do not act.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_guard.runtime.ledger import UNPLANNED

from .base import Action, CheckResult, Finding, Health, Sample, result

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
        self.context: dict[int, dict[str, Any]] = {}  # oom-kill: lines waiting for their Killed line
        self.seen_failures: int | None = None
        self.cgroup_kills: int | None = None

    def is_supported(self, s: Sample) -> bool:
        return True  # kernel lines, cgroup and status each may be absent; judged per source

    def _remember(self, s: Sample) -> None:
        for c in (s.get("status") or {}).get("children", []):
            self.known[int(c["pid"])] = c["role"]
        while len(self.known) > MAX_PIDS:
            self.known.pop(next(iter(self.known)))

    def check(self, s: Sample) -> CheckResult:
        self._remember(s)
        service = s.get("service_cgroup")
        findings: list[Finding] = []
        for ev in s.get("kernel_events", []):
            if ev["type"] == "oom_context" and ev["pid"] is not None:
                self.context[ev["pid"]] = ev
                while len(self.context) > MAX_PIDS:
                    self.context.pop(next(iter(self.context)))
                findings += self._kill(ev, ev, service)
            elif ev["type"] == "oom_killed":
                findings += self._kill(ev, self.context.get(ev["pid"], {}), service)
        findings += self._cgroup(s, bool(findings))
        for line in s.get("child_log", []):
            if CUDA_OOM.search(line):
                findings.append(Finding("cuda_oom", f"log:{hash(line)}", line.strip()[:300], UNPLANNED,
                                        Action.ALERT, {"line": line.strip()[:1000]}))
        findings += self._exits(s)
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings)
        return result(self.name, s, Health.HEALTHY, "no OOM seen")

    def _kill(self, ev: dict[str, Any], ctx: dict[str, Any], service: str | None) -> list[Finding]:
        pid = ev["pid"]
        by = "task_memcg" if in_cgroup(ctx.get("task_memcg"), service) else "pid" if pid in self.known else None
        if by is None:
            return []
        task = ev.get("task") or ctx.get("task")
        data = {"pid": pid, "task": task, "attributed_by": by, "task_memcg": ctx.get("task_memcg"),
                "role": self.known.get(pid), "line": ev["line"]}
        return [Finding("oom_kill", f"pid:{pid}", f"kernel OOM killed {task} (pid {pid}), a service process "
                        f"by {by}", UNPLANNED, Action.ALERT, data)]

    def _cgroup(self, s: Sample, explained: bool) -> list[Finding]:
        n = (s.get("cgroup") or {}).get("oom_kill")
        if n is None:
            return []
        prev, self.cgroup_kills = self.cgroup_kills, n
        if prev is None or n <= prev or explained:
            return []
        return [Finding("oom_kill", f"cgroup:{n}", f"cgroup oom_kill rose {prev} -> {n}", UNPLANNED,
                        Action.ALERT, {"cgroup": s["cgroup"], "before": prev})]

    def _exits(self, s: Sample) -> list[Finding]:
        log = (s.get("status") or {}).get("failure_log")
        if log is None:
            return []
        prev, self.seen_failures = self.seen_failures, len(log)
        if prev is None:
            return []
        return [Finding("child_exit", f"failure:{f['generation']}:{f['at']}",
                        f"runtime recorded {f['kind']} of generation {f['generation']} (exit {f['exit_code']})",
                        UNPLANNED, Action.NONE, dict(f)) for f in log[prev:] if f["kind"] != "hang"]
