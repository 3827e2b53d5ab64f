"""`vllm-guard install`, `uninstall` and `revive`: the systemd side of the guard.

`install` validates the whole guard.toml through `vllm_guard.core.config`, like every other
command: bad config, bad flags and failed preflight checks are one line on stderr and exit 2,
before anything is written. Warnings (persistence mode off, the tiny model) are printed and do
not stop the install. The modules that do the work are imported inside the handlers, so
`vllm-guard --help` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vllm_guard.core.errors import UsageError

if TYPE_CHECKING:
    from vllm_guard.core.config import GuardConfig

    from .preflight import Report
    from .render import Layout

Handler = Callable[[argparse.Namespace, list[str]], int]
_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_commands(sub: Any) -> dict[str, Handler]:
    i = sub.add_parser("install", help="install the systemd units, guard.toml and users; enable and start them")
    i.add_argument("--dry-run", action="store_true", help="print the plan and the files, change nothing")
    i.add_argument("--root", default=None, metavar="DIR",
                   help="write into this prefix (packaging, tests); runs no service")
    i.add_argument("--model", default=None, metavar="DIR",
                   help="absolute path of a local model directory (pinned; the unit runs offline)")
    i.add_argument("--gpus", default=None, metavar="LIST",
                   help="comma-separated GPU indexes or UUIDs (`nvidia-smi -L`), [server] gpus: one replica per "
                        "GPU or --tensor-parallel-size group (default: one replica, every GPU)")
    i.add_argument("--port", type=int, default=None, help="public port of the guard (default 8000)")
    i.add_argument("--host", default=None, help="address the guard listens on (default 127.0.0.1)")
    i.add_argument("--user", default=None, help="the runtime's system user; its group owns the admin socket "
                                                "(default vllm-guard)")
    i.add_argument("--watchdog-user", default=None,
                   help="the watchdog's system user, a member of the runtime's group (default vllm-guard-watchdog)")
    i.add_argument("--instance", default=None, metavar="NAME",
                   help="install vllm-guard@NAME.service (one per GPU set) instead of vllm-guard.service")
    i.add_argument("--config", default=None, metavar="FILE",
                   help="base guard.toml to install (default: the installed one, else the defaults)")
    i.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the runtime (repeatable)")
    i.add_argument("--force-config", action="store_true", help="overwrite an existing guard.toml")
    r = i.add_argument_group("recycling (a new guard.toml recycles on memory growth: host RSS +4096 MB, "
                             "GPU +1024 MB since warm-up; never on a request count unless asked)")
    r.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="recycle a generation after N requests (default 0: off)")
    r.add_argument("--max-requests-jitter", type=int, default=None, metavar="N",
                   help="add a random 0..N to --max-requests per generation")
    r.add_argument("--max-uptime", default=None, metavar="DUR",
                   help="recycle a generation that has served this long, e.g. 24h (default 0: off)")
    r.add_argument("--max-host-rss-growth-mb", type=float, default=None, metavar="MB",
                   help="recycle when vLLM's host RSS grew this much since warm-up (default 4096; 0: off)")
    r.add_argument("--max-gpu-memory-growth-mb", type=float, default=None, metavar="MB",
                   help="recycle when vLLM's GPU memory grew this much since warm-up (default 1024; 0: off)")
    r.add_argument("--forecast-horizon", default=None, metavar="DUR",
                   help="the watchdog recycles when a leak's forecast runs out of memory within this time "
                        "(default 1h)")
    u = sub.add_parser("uninstall", help="disable and remove the units (keeps the ledger and users)")
    u.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    u.add_argument("--root", default=None, metavar="DIR", help="remove from this prefix (packaging, tests)")
    u.add_argument("--instance", default=None, metavar="NAME", help="only vllm-guard@NAME.service")
    u.add_argument("--purge", action="store_true", help="also remove guard.toml (never the state dir)")
    sub.add_parser("revive", help="restart failed vllm-guard units (run by vllm-guard-revive.timer)")
    return {"install": cmd_install, "uninstall": cmd_uninstall, "revive": cmd_revive}


def _layout(instance: str | None) -> Layout:
    from .render import Layout

    if instance is not None and not _INSTANCE.match(instance):
        raise UsageError(f"--instance has value {instance!r}: use letters, digits, '.', '_' or '-'")
    return Layout(instance)


def _bin_path() -> str:
    import shutil

    candidate = Path(sys.prefix) / "bin" / "vllm-guard"
    found = str(candidate) if candidate.exists() else shutil.which("vllm-guard")
    if not found:
        raise UsageError("cannot find the vllm-guard executable (install the package into a venv first)")
    return found


def _unit_active(unit: str) -> bool:
    import shutil
    import subprocess

    if shutil.which("systemctl") is None:
        return False
    return subprocess.run(["systemctl", "is-active", "--quiet", unit], capture_output=True).returncode == 0


def _watchdog_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_guard.watchdog.cli") is not None


def cmd_install(args: argparse.Namespace, _: list[str]) -> int:
    from . import config_file as F
    from . import install as I
    from . import render as R

    root = Path(args.root).resolve() if args.root else Path("/")
    live = args.root is None and not args.dry_run
    layout = _layout(args.instance)
    cfg, new = F.base_config(args.config, R.under(root, layout.config))
    if new:
        cfg = F.gpu_box_defaults(cfg)
    recycle = {k: getattr(args, k) for k in F.RECYCLE_FLAGS if getattr(args, k) is not None}
    cfg = F.apply_flags(cfg, model=args.model, host=args.host, port=args.port, user=args.user,
                  watchdog_user=args.watchdog_user, gpus=args.gpus, env=args.env, layout=layout, recycle=recycle)
    text, cfg = F.render(cfg, layout)
    settings = cfg.install
    report = _preflight(args, live, cfg, layout)
    bin_path = _bin_path()
    base = R.base_context(settings, bin_path, I.stop_timeout(cfg), [cfg.server.model, cfg.server.python], cfg)
    units = R.render_units(base)
    sock_name, sock_text = R.socket_unit(layout, cfg.server.host, cfg.server.port, layout.instance or "this box")
    units[sock_name] = sock_text
    _sandbox_check(args, cfg, units, layout, bin_path, report)
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for n in report.notes:
        print(f"preflight: {n}", file=sys.stderr)
    watchdog = _watchdog_available()
    # A re-install without flags keeps an operator's guard.toml; flags that change it rewrite it
    # from the existing file plus the flags (other keys survive, comments do not).
    changes = (args.model, args.port, args.host, args.config, args.user, args.watchdog_user, args.gpus)
    rewrite = args.force_config or bool(args.env) or bool(recycle) or any(v is not None for v in changes)
    if not rewrite and cfg.deprecations:
        print(f"note: {layout.config} uses keys that were replaced ({'; '.join(cfg.deprecations)}); re-run "
              "install with --force-config to rewrite it", file=sys.stderr)
    if not rewrite and F.recycle_off(cfg):
        print(f"note: {layout.config} turns every recycle trigger off; re-run install with "
              "--max-host-rss-growth-mb/--max-gpu-memory-growth-mb (or edit [recycle]) to recycle before a leak",
              file=sys.stderr)
    plan = I.plan_install(root, live, layout, text, settings.environment(), units, settings, watchdog, rewrite)
    if not watchdog:
        print("note: `vllm-guard watchdog` is not in this build: its unit is installed, not enabled",
              file=sys.stderr)
    print(I.describe(plan, "install"))
    if args.dry_run:
        for path, (content, _mode) in plan.files.items():
            print(f"\n# ---- {path}\n{content}", end="")
        return 0
    try:
        I.apply_install(plan, args.instance)
    except (OSError, RuntimeError) as e:
        print(f"vllm-guard: error: install failed: {e}", file=sys.stderr)
        return 1
    print(f"installed {layout.unit}" + (" and started it" if live else f" under {root}"))
    return 0


def _preflight(args: argparse.Namespace, live: bool, cfg: GuardConfig, layout: Layout) -> Report:
    """Each failure raises PreflightError (one line, exit 2); warnings and notes are returned."""
    from . import preflight as P

    report = P.Report()
    if live:
        P.require_root()
        P.require_systemd()
    P.check_users_differ(cfg.install.user, cfg.install.watchdog_user)
    P.require_model_dir(cfg.server.model)
    if not cfg.server.model:
        report.warnings.append("no --model: the service serves the embedded tiny model (its text is noise)")
    socket = layout.unit.removesuffix(".service") + ".socket"  # a re-install: the socket unit holds the port
    if args.root is None and not _unit_active(layout.unit) and not _unit_active(socket):
        P.require_free_port(cfg.server.host, cfg.server.port)
    if args.root is None:
        P.check_nvidia(cfg.server.python or sys.executable, cfg.server.gpus, cfg.install.environment(), report)
    return report


def _sandbox_check(args: argparse.Namespace, cfg: GuardConfig, units: dict[str, str], layout: Layout,
                   bin_path: str, report: Report) -> None:
    """The service user runs the interpreter(s) and reads the model under the rendered unit's
    sandbox (systemd-run, or setpriv and the sandbox's path rules); PreflightError otherwise."""
    import os

    from . import preflight as P
    from . import sandbox as S

    if args.root is not None:
        report.notes.append("--root: the service user and sandbox check was skipped (paths belong to the "
                            "target system)")
        return
    unit_text = (units["vllm-guard.service"] if layout.instance is None
                 else units["vllm-guard@.service"].replace("%i", layout.instance))
    verdict = S.check(unit_text, layout.unit, cfg.install.user, bin_path, cfg.server.python, cfg.server.model,
                      systemd_pid1=Path("/run/systemd/system").is_dir(), is_root=os.geteuid() == 0)
    if verdict.problem:
        raise P.PreflightError(f"{verdict.problem} (checked with {verdict.how})")
    report.notes.append(f"the service user can run the interpreter and read the model (checked with {verdict.how})")


def cmd_uninstall(args: argparse.Namespace, _: list[str]) -> int:
    from . import install as I
    from . import preflight as P

    root = Path(args.root).resolve() if args.root else Path("/")
    live = args.root is None and not args.dry_run
    if args.instance is not None:
        _layout(args.instance)
    if live:
        P.require_root()
        P.require_systemd()
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


def cmd_revive(args: argparse.Namespace, _: list[str]) -> int:
    from .revive import revive_all

    return revive_all()
