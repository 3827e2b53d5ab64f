"""Install and uninstall as a plan: files to write and systemctl commands to run, then applied.

`--dry-run` prints the plan, `--root DIR` writes the files under a prefix and runs nothing but
`systemctl --root DIR enable` (packaging and tests), a live install writes and runs it all. A
manifest (`/etc/vllm-guard/installed.json`) records what was written so `uninstall` removes
exactly that; the state directory (ledger, hold) is never removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_guard.core.config import GuardConfig, InstallConfig
from vllm_guard.core.errors import ConfigError

from . import render as R

MANIFEST = f"{R.ETC}/installed.json"


@dataclass
class Plan:
    root: Path
    live: bool
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # path -> (text, mode)
    keep: list[str] = field(default_factory=list)  # existing files left as they are
    commands: list[list[str]] = field(default_factory=list)
    enable: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)

    def path(self, p: str) -> Path:
        return R.under(self.root, p)


def stop_timeout(cfg: GuardConfig) -> float:
    """Drain, stop and memory release, plus a margin: systemd must never SIGKILL a draining runtime."""
    s = cfg.server
    return s.drain_timeout + s.stop_timeout + s.memory_release_timeout + 30.0


def read_manifest(root: Path) -> dict[str, Any]:
    try:
        return json.loads(R.under(root, MANIFEST).read_text())
    except FileNotFoundError:
        return {"files": [], "units": [], "instances": []}
    except ValueError as e:
        raise ConfigError(f"manifest {MANIFEST} is not valid JSON: {e}") from e


def plan_install(root: Path, live: bool, layout: R.Layout, config_text: str, env: dict[str, str],
                 units: dict[str, str], settings: InstallConfig, start_watchdog: bool,
                 force_config: bool) -> Plan:
    plan = Plan(root=root, live=live)
    for name, text in units.items():
        plan.files[f"{R.UNIT_DIR}/{name}"] = (text, 0o644)
    plan.files[R.SYSUSERS] = (R.sysusers(settings), 0o644)
    if plan.path(layout.config).exists() and not force_config:
        plan.keep.append(layout.config)
    else:
        plan.files[layout.config] = (config_text, 0o640)
    plan.files[layout.env_file] = (R.env_text(env), 0o640)
    plan.enable = [layout.unit, "vllm-guard-revive.timer", layout.unit.removesuffix(".service") + ".socket"]
    if start_watchdog:
        plan.enable.insert(1, layout.watchdog_unit)
    if live:
        plan.commands = [["systemd-sysusers", R.SYSUSERS],
                         ["chgrp", settings.group, layout.config, layout.env_file],
                         ["systemctl", "daemon-reload"],
                         ["systemctl", "enable", *plan.enable],
                         # blocks until READY=1 (or fails): install returns with the service serving
                         ["systemctl", "start", layout.unit],
                         ["systemctl", "start", "--no-block", *plan.enable[1:]]]
    else:
        plan.commands = [["systemctl", f"--root={root}", "enable", *plan.enable]]
    return plan


def apply_install(plan: Plan, instance: str | None) -> None:
    manifest = read_manifest(plan.root)
    for path, (text, mode) in plan.files.items():
        target = plan.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    manifest["files"] = sorted(set(manifest["files"]) | set(plan.files) | set(plan.keep))
    manifest["units"] = sorted(set(manifest["units"]) | set(plan.enable))
    manifest["instances"] = sorted(set(manifest["instances"]) | {instance or ""})
    m = plan.path(MANIFEST)
    m.write_text(json.dumps(manifest, indent=2) + "\n")
    for cmd in plan.commands:
        run(cmd, plan.live)


def plan_uninstall(root: Path, live: bool, instance: str | None, purge: bool) -> Plan:
    """Disable and remove what the manifest lists; with an instance, only that instance's files."""
    manifest = read_manifest(root)
    plan = Plan(root=root, live=live)
    if instance is not None:
        layout = R.Layout(instance)
        units = [layout.unit, layout.watchdog_unit]
        plan.remove = [layout.env_file] + ([layout.config] if purge else [])
    else:
        units = list(manifest["units"]) or [R.PLAIN.unit, R.PLAIN.watchdog_unit, "vllm-guard-revive.timer"]
        for inst in manifest["instances"]:
            if inst:
                units += [R.Layout(inst).unit, R.Layout(inst).watchdog_unit]
        units = sorted(set(units))
        configs = {p for p in manifest["files"] if p.endswith(".toml")}
        plan.remove = [p for p in manifest["files"] if purge or p not in configs]
        if purge:
            plan.remove.append(MANIFEST)
    plan.enable = units
    if live:
        plan.commands = [["systemctl", "disable", "--now", *units], ["systemctl", "reset-failed", *units],
                         ["systemctl", "daemon-reload"]]
    else:
        plan.commands = [["systemctl", f"--root={root}", "disable", *units]]
    return plan


def apply_uninstall(plan: Plan, instance: str | None) -> None:
    for cmd in plan.commands[:2]:  # disable (and stop), reset-failed: while the units still exist
        if cmd[1] != "daemon-reload":
            run(cmd, plan.live)
    for path in plan.remove:
        plan.path(path).unlink(missing_ok=True)
    manifest = read_manifest(plan.root)
    if plan.path(MANIFEST).exists():
        manifest["files"] = [p for p in manifest["files"] if p not in plan.remove]
        manifest["units"] = [u for u in manifest["units"] if u not in plan.enable]
        manifest["instances"] = [i for i in manifest["instances"] if instance is not None and i != instance]
        plan.path(MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for cmd in plan.commands:
        if cmd[1] == "daemon-reload":
            run(cmd, plan.live)


def run(cmd: list[str], live: bool) -> None:
    """Run one command; offline (`--root`) systemctl is best effort, live failures are fatal."""
    if shutil.which(cmd[0]) is None:
        if live:
            raise RuntimeError(f"{cmd[0]} not found")
        print(f"skipped (no {cmd[0]}): {' '.join(cmd)}", file=sys.stderr)
        return
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0 and cmd[:2] == ["systemctl", "reset-failed"]:
        return  # best effort: a unit that is not loaded has no failed state to reset
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        line = f"{' '.join(cmd)} failed ({out.returncode}): {detail[-1] if detail else ''}"
        if live:
            raise RuntimeError(line)
        print(f"warning: {line}", file=sys.stderr)


def describe(plan: Plan, verb: str) -> str:
    lines = [f"{verb} plan (root {plan.root}):"]
    lines += [f"  write {p}  ({mode:o})" for p, (_, mode) in plan.files.items()]
    lines += [f"  keep  {p}  (exists; flags or --force-config rewrite it)" for p in plan.keep]
    lines += [f"  remove {p}" for p in plan.remove]
    lines += [f"  run   {' '.join(c)}" for c in plan.commands]
    return "\n".join(lines)
