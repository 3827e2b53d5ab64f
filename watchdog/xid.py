"""Xid and GPU health: NVIDIA's catalog classes decide the action. Restart-app Xids get a
hard restart; a GPU that needs a reset or the host a reboot gets `hold` + alert, never a
restart loop. NVML errors that mean the GPU is gone, and a driver/library mismatch after an
unattended driver upgrade, are incidents of their own."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_guard.core.ledger import EndClass

from .base import Action, CheckResult, Finding, Health, Sample, result

RESTART_APP = {13, 31, 43, 45, 94}
GPU_RESET = {46, 48, 62, 64, 74, 95, 109, 119, 120, 136, 140, 143, 155}
REBOOT = {79}


def catalog_class(xid: int) -> str:
    """NVIDIA's recovery class: restart_app | gpu_reset | reboot | unknown."""
    if xid in REBOOT:
        return "reboot"
    if xid in GPU_RESET:
        return "gpu_reset"
    if xid in RESTART_APP:
        return "restart_app"
    return "unknown"


_ACTION = {"restart_app": Action.RESTART, "gpu_reset": Action.HOLD, "reboot": Action.HOLD,
           "unknown": Action.ALERT}


@dataclass(frozen=True)
class XidSeen:
    xid: int
    where: str  # PCI bus id (kernel line) or GPU UUID (NVML event)
    pid: int | None
    detail: str
    line: str


class XidDetector:
    name = "xid"

    def __init__(self) -> None:
        self.count = 0

    def is_supported(self, s: Sample) -> bool:
        return True

    def check(self, s: Sample) -> CheckResult:
        findings: list[Finding] = []
        events = [XidSeen(e.xid, e.pci or "", e.pid, e.detail, e.line)
                  for e in s.kernel_events if e.type == "xid" and e.xid is not None]
        if s.nvml is not None:
            events += [XidSeen(x.xid, x.uuid, None, "NVML Xid event", f"NVML xid {x.xid}") for x in s.nvml.xids]
        for e in events:
            self.count += 1
            cls = catalog_class(e.xid)
            findings.append(Finding(f"xid_{e.xid}", f"xid:{self.count}:{e.where}",
                                    f"Xid {e.xid} on {e.where} ({cls}): {e.detail[:200]}", EndClass.UNPLANNED,
                                    _ACTION[cls], {"xid": e.xid, "catalog": cls, "pci": e.where,
                                                   "pid": e.pid, "line": e.line}))
        err = (s.nvml.error if s.nvml is not None else None) or ""
        if "GpuIsLost" in err or err.startswith("timeout"):
            findings.append(Finding("gpu_lost", "nvml", f"NVML: {err}", EndClass.UNPLANNED, Action.HOLD,
                                    {"error": err}))
        if s.nvml_mismatch:
            findings.append(Finding("nvml_mismatch", "nvml", "NVML driver/library version mismatch "
                                    "(driver upgraded without a reboot?)", EndClass.UNPLANNED, Action.ALERT,
                                    {"error": err}))
        if findings:
            return result(self.name, s, Health.UNHEALTHY, findings[0].cause, findings)
        if not s.kernel_source and (s.nvml is None or not s.nvml.gpus):
            return result(self.name, s, Health.UNKNOWN, "nothing to judge: no kernel messages and no NVML")
        return result(self.name, s, Health.HEALTHY, "no Xid")
