"""Host readings: per-child memory (psutil), host memory, boot id, cgroup OOM counters.

Filesystem roots are parameters (node_exporter's `--path.procfs` habit), so tests point them
at fixture trees. cgroup v2 keeps `oom_kill` in `memory.events`; v1 in `memory.oom_control`
(kernel >= 4.13). Both are read; whichever exists answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

MIB = 2**20


def child_memory(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """RSS/USS/swap (MiB) per child pid (str keys: JSON and the ledger keep them)."""
    out: dict[str, dict[str, Any]] = {}
    for c in children:
        try:
            info = psutil.Process(int(c["pid"])).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[str(c["pid"])] = {"role": c.get("role", "?"), "rss_mb": round(info.rss / MIB, 2),
                              "uss_mb": round(getattr(info, "uss", 0) / MIB, 2),
                              "swap_mb": round(getattr(info, "swap", 0) / MIB, 2)}
    return out


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
