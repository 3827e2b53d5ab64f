"""`vllm-guard install`, `uninstall` and `revive`: the systemd side of the guard.

Preflight failures are one line on stderr and exit 2 (ConfigError through the runtime's CLI);
warnings (persistence mode off, the tiny model) are printed and do not stop the install.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_guard.runtime.config import ConfigError, tomllib

from . import install as I
from . import preflight as P
from . import render as R
from . import revive
from .settings import parse, parse_env_flag

_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace, list[str]], int]]:
    i = sub.add_parser("install", help="install the systemd units, guard.toml and users; enable and start them")
    i.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    i.add_argument("--root", default=None, help="write into this prefix (packaging, tests); runs no service")
    i.add_argument("--model", default=None, help="absolute path of a local model directory (pinned)")
    i.add_argument("--gpus", default=None, help="comma-separated GPU UUIDs (CUDA_VISIBLE_DEVICES)")
    i.add_argument("--port", type=int, default=None)
    i.add_argument("--host", default=None)
    i.add_argument("--user", default=None, help="the runtime's system user (default vllm-guard)")
    i.add_argument("--watchdog-user", default=None)
    i.add_argument("--instance", default=None,
                   help="install vllm-guard@NAME.service (one per GPU set) instead of vllm-guard.service")
    i.add_argument("--config", default=None, help="base guard.toml to install (default: the installed one)")
    i.add_argument("--env", action="append", default=[], help="NAME=VALUE for the runtime's environment")
    i.add_argument("--force-config", action="store_true", help="overwrite an existing guard.toml")
    u = sub.add_parser("uninstall", help="disable and remove the units (keeps the ledger and users)")
    u.add_argument("--dry-run", action="store_true")
    u.add_argument("--root", default=None)
    u.add_argument("--instance", default=None)
    u.add_argument("--purge", action="store_true", help="also remove guard.toml (never the state dir)")
    sub.add_parser("revive", help="restart failed vllm-guard units (run by vllm-guard-revive.timer)")
    return {"install": cmd_install, "uninstall": cmd_uninstall, "revive": lambda a, e: revive.revive_all()}


def _layout(instance: str | None) -> R.Layout:
    if instance is not None and not _INSTANCE.match(instance):
        raise ConfigError(f"--instance has value {instance!r}: use letters, digits, '.', '_' or '-'")
    return R.Layout(instance)


def _base_raw(path: str | None, installed: Path) -> dict[str, Any]:
    src = Path(path) if path else installed
    if path is None and not src.exists():
        return {}
    try:
        return tomllib.loads(src.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"--config has value {path!r}: no such file") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(src)!r} is not valid TOML: {e}") from e


def _bin_path() -> str:
    candidate = Path(sys.prefix) / "bin" / "vllm-guard"
    found = str(candidate) if candidate.exists() else shutil.which("vllm-guard")
    if not found:
        raise ConfigError("cannot find the vllm-guard executable (install the package into a venv first)")
    return found


def _unit_active(unit: str) -> bool:
    if shutil.which("systemctl") is None:
        return False
    return subprocess.run(["systemctl", "is-active", "--quiet", unit]).returncode == 0


def _watchdog_available() -> bool:
    return importlib.util.find_spec("vllm_guard.watchdog.cli") is not None


def cmd_install(args: argparse.Namespace, _: list[str]) -> int:
    root = Path(args.root).resolve() if args.root else Path("/")
    live = args.root is None and not args.dry_run
    layout = _layout(args.instance)
    raw = _base_raw(args.config, R.under(root, layout.config))
    if not isinstance(raw.get("install", {}), dict):
        raise ConfigError("[install] must be a table")
    table = dict(raw.get("install", {}))
    for key in ("user", "watchdog_user"):
        if getattr(args, key) is not None:
            table[key] = getattr(args, key)
    if args.gpus is not None:
        table["gpus"] = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if args.env:
        table["env"] = {**(table.get("env") or {}), **dict(parse_env_flag(e) for e in args.env)}
    settings = parse(table)
    gpus, env = settings.gpus, settings.environment()
    if args.port is not None and not 1 <= args.port <= 65535:
        raise ConfigError(f"--port has value {args.port!r}: must be 1..65535")
    server = I.server_table(raw, args.model or "", args.host, args.port, layout, settings.group)
    text = R.toml_text(I.guard_config(raw, server, settings), R.config_header(layout))
    cfg = I.validated(text)
    try:
        _preflight(args, live, cfg, layout, gpus, settings)
    except P.PreflightError as e:
        raise ConfigError(str(e)) from e
    bin_path = _bin_path()
    base = R.base_context(settings, bin_path, I.stop_timeout(cfg), [cfg.server.model])
    units = R.render_units(base)
    watchdog = _watchdog_available()
    # A re-install without flags keeps an operator's guard.toml; flags that change it rewrite it
    # from the existing file plus the flags (other keys survive, comments do not).
    changes = (args.model, args.port, args.host, args.config, args.user, args.watchdog_user, args.gpus)
    rewrite = args.force_config or bool(args.env) or any(v is not None for v in changes)
    plan = I.plan_install(root, live, layout, text, env, units, settings, watchdog, rewrite)
    if not watchdog:
        print("note: `vllm-guard watchdog` is not in this build: its unit is installed, not enabled",
              file=sys.stderr)
    print(I.describe(plan, "install"))
    if args.dry_run:
        for path, (content, _) in plan.files.items():
            print(f"\n# ---- {path}\n{content}", end="")
        return 0
    try:
        I.apply_install(plan, args.instance)
    except (OSError, RuntimeError) as e:
        print(f"vllm-guard: error: install failed: {e}", file=sys.stderr)
        return 1
    print(f"installed {layout.unit}" + (" and started it" if live else f" under {root}"))
    return 0


def _preflight(args: argparse.Namespace, live: bool, cfg: Any, layout: R.Layout, gpus: list[str],
               settings: Any) -> None:
    report = P.Report()
    if live:
        P.require_root()
        P.require_systemd()
    P.check_users_differ(settings.user, settings.watchdog_user)
    P.require_model_dir(cfg.server.model)
    if not cfg.server.model:
        report.warnings.append("no --model: the service serves the embedded tiny model (its text is noise)")
    if args.root is None and not _unit_active(layout.unit):
        P.require_free_port(cfg.server.host, cfg.server.port)
    if args.root is None:
        P.check_nvidia(cfg.server.python or sys.executable, gpus, report)
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)


def cmd_uninstall(args: argparse.Namespace, _: list[str]) -> int:
    root = Path(args.root).resolve() if args.root else Path("/")
    live = args.root is None and not args.dry_run
    if args.instance is not None:
        _layout(args.instance)
    try:
        if live:
            P.require_root()
            P.require_systemd()
    except P.PreflightError as e:
        raise ConfigError(str(e)) from e
    plan = I.plan_uninstall(root, live, args.instance, args.purge)
    print(I.describe(plan, "uninstall"))
    if args.dry_run:
        return 0
    try:
        I.apply_uninstall(plan, args.instance)
    except (OSError, RuntimeError) as e:
        print(f"vllm-guard: error: uninstall failed: {e}", file=sys.stderr)
        return 1
    print("uninstalled; kept /var/lib/vllm-guard (ledger, hold) and the system users"
          + ("" if args.purge else " and guard.toml (--purge removes it)"))
    return 0
