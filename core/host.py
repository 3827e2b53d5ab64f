"""Host readings: per-child memory and CPU time (psutil), host memory, boot id, cgroup OOM counters.

Filesystem roots are parameters (node_exporter's `--path.procfs` habit), so tests point them
at fixture trees. cgroup v2 keeps `oom_kill` in `memory.events`; v1 in `memory.oom_control`
(kernel >= 4.13). Both are read; whichever exists answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

MIB = 2**20


def child_memory(children: list[dict[str, Any]], full: bool = False, proc: str = "/proc") -> dict[str, dict[str, Any]]:
    """RSS and swap (MiB) per child pid (str keys: JSON and the ledger keep them); USS only
    when `full`: it walks smaps (50-100 ms for a vLLM worker), RSS and VmSwap cost microseconds."""
    out: dict[str, dict[str, Any]] = {}
    for c in children:
        try:
            p = psutil.Process(int(c["pid"]))
            info = p.memory_full_info() if full else p.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        m = {"role": c.get("role", "?"), "rss_mb": round(info.rss / MIB, 2), "swap_mb": _vm_swap(c["pid"], proc)}
        if full:
            m["uss_mb"] = round(getattr(info, "uss", 0) / MIB, 2)
        out[str(c["pid"])] = m
    return out


def _vm_swap(pid: int, proc: str) -> float | None:
    try:
        for line in Path(proc, str(pid), "status").read_text().splitlines():
            if line.startswith("VmSwap:"):
                return round(int(line.split()[1]) / 1024, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used (from /proc/PID/stat, readable for any user's
    process); None when it is gone. The hang rule's evidence that a silent API server is alive."""
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return float(t.user + t.system)


def cmdline(pid: int) -> list[str]:
    """A process's command line (world-readable in /proc); [] when it is gone or hidden."""
    try:
        return list(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def host_memory(proc: str = "/proc") -> dict[str, Any]:
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    return {"mem_total_mb": round(vm.total / MIB, 1), "mem_available_mb": round(vm.available / MIB, 1),
            "swap_used_mb": round(sw.used / MIB, 1), "boot_id": boot_id(proc)}


def boot_id(proc: str = "/proc") -> str:
    try:
        return Path(proc, "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cgroup_of(pid: int, proc: str = "/proc") -> dict[str, str]:
    """controller -> path from /proc/PID/cgroup ('' key: the v2 unified path)."""
    out: dict[str, str] = {}
    try:
        text = Path(proc, str(pid), "cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(",") if parts[1] else [""]:
            out[ctrl] = parts[2]
    return out


def service_path(pid: int, proc: str = "/proc") -> str:
    """The service's cgroup path (memory controller on v1, the unified path on v2)."""
    cg = cgroup_of(pid, proc)
    return cg.get("memory") or cg.get("") or cg.get("name=systemd", "")


def oom_kills(path: str, root: str = "/sys/fs/cgroup") -> dict[str, Any]:
    """{'version', 'oom_kill', 'file'} for a cgroup path; oom_kill None when unreadable."""
    rel = path.lstrip("/")
    candidates = [("v2", Path(root, rel, "memory.events")), ("v2", Path(root, "unified", rel, "memory.events")),
                  ("v1", Path(root, "memory", rel, "memory.oom_control"))]
    for version, f in candidates:
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                return {"version": version, "oom_kill": int(v), "file": str(f)}
    return {"version": None, "oom_kill": None, "file": None}
