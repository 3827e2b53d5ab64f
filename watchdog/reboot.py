"""Host reboot: the kernel's boot_id differs from the one the last recorded sample saw, so
the service was down, unplanned, from that sample until now."""

from __future__ import annotations

from vllm_guard.core.ledger import EndClass

from .base import Action, CheckResult, Finding, Health, Sample, result


class RebootDetector:
    name = "host_reboot"

    def __init__(self, last_boot_id: str = "", last_seen_at: str = "") -> None:
        self.last = last_boot_id
        self.last_seen_at = last_seen_at

    def is_supported(self, s: Sample) -> bool:
        return s.host is not None and bool(s.host.boot_id)

    def check(self, s: Sample) -> CheckResult:
        if s.host is None or not s.host.boot_id:
            return result(self.name, s, Health.UNKNOWN, "no boot_id")
        cur = s.host.boot_id
        prev, self.last = self.last, cur
        if prev and prev != cur:
            f = Finding("host_reboot", f"boot:{cur}", f"host rebooted (boot_id {prev[:8]} -> {cur[:8]}); "
                        f"last sample before it at {self.last_seen_at or '?'}", EndClass.UNPLANNED, Action.ALERT,
                        {"previous": prev, "current": cur, "down_since": self.last_seen_at})
            return result(self.name, s, Health.UNHEALTHY, f.cause, [f])
        return result(self.name, s, Health.HEALTHY, "same boot")
