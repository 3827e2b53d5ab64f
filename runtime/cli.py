"""The `vllm-guard` command line. Every usage or config error: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import importlib
import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from . import admin, tiny_model
from .backend import find_owned_arg
from .config import ConfigError, GuardConfig, load, set_value, validate
from .states import EXIT_BOOT_ERROR, EXIT_USAGE

# serve flag -> (section, key) in guard.toml
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("server", "model"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "state_dir": ("server", "state_dir"),
    "python": ("server", "python"),
    "drain_timeout": ("server", "drain_timeout"),
    "startup_timeout": ("server", "startup_timeout"),
    "queue_max_wait": ("server", "queue_max_wait"),
    "max_requests": ("recycle", "max_requests"),
    "max_requests_jitter": ("recycle", "max_requests_jitter"),
    "max_uptime": ("recycle", "max_uptime"),
    "max_gpu_memory_growth_mb": ("recycle", "max_gpu_memory_growth_mb"),
    "max_host_rss_growth_mb": ("recycle", "max_host_rss_growth_mb"),
    "idle_fraction": ("recycle", "idle_fraction"),
    "idle_after": ("recycle", "idle_after"),
    "probe_interval": ("probe", "interval"),
    "probe_timeout": ("probe", "timeout"),
}
_INTS = {"port", "max_requests", "max_requests_jitter"}
_FLOATS = {"max_gpu_memory_growth_mb", "max_host_rss_growth_mb", "idle_fraction"}


# Modules that add subcommands: `add_commands(subparsers) -> {command: handler(args, extra) -> int}`.
PLUGIN_CLIS = (
    "vllm_guard.patches.cli",
    "vllm_guard.watchdog.cli",
    "vllm_guard.soak.cli",
    "vllm_guard.systemd.cli",
)
EXTRA_HANDLERS: dict[str, Any] = {}


class UsageError(Exception):
    """Bad command line: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _num(kind: type) -> Any:
    def conv(text: str) -> Any:
        try:
            return kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from e
    return conv


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vllm-guard", description="A reliability-guarded runtime for vLLM.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="serve vLLM under the guard (args after -- go to vLLM)")
    s.add_argument("--config", help="guard.toml")
    for flag, (section, key) in SERVE_FLAGS.items():
        kind = _num(int) if flag in _INTS else _num(float) if flag in _FLOATS else str
        s.add_argument("--" + flag.replace("_", "-"), dest=flag, type=kind, default=None,
                       help=f"[{section}] {key}")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    for name, text in (("status", "print the runtime's status"), ("recycle", "graceful recycle"),
                       ("restart", "hard restart"), ("hold", "stop all (re)starting until released"),
                       ("release", "release a hold")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--state-dir", default=os.environ.get("VLLM_GUARD_STATE_DIR", ".state"))
        c.add_argument("--json", action="store_true")
        if name in ("recycle", "restart", "hold"):
            c.add_argument("--reason", default="operator")
        if name in ("recycle", "restart"):
            c.add_argument("--class", dest="cls", default=None,
                           help="ledger class (recycle: scheduled|preventive; restart: unplanned|scheduled|preventive)")

    m = sub.add_parser("model", help="build the embedded tiny model (its text is noise)")
    m.add_argument("kind", choices=["tiny"])
    m.add_argument("dir", nargs="?", default=None)

    for mod in PLUGIN_CLIS:  # watchdog, soak/report, patches, install: each adds its own commands
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        EXTRA_HANDLERS.update(module.add_commands(sub))

    d = sub.add_parser("demo", help="serve the tiny model, drive streaming load, force a recycle, print status")
    d.add_argument("--state-dir", default=None)
    d.add_argument("--port", type=_num(int), default=None)
    d.add_argument("--requests", type=_num(int), default=48)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, vllm_args = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
        if vllm_args and args.command != "serve":
            raise UsageError(f"vllm-guard {args.command}: arguments after -- are only for serve")
        handlers = {"serve": cmd_serve, "model": cmd_model, "demo": cmd_demo, **EXTRA_HANDLERS}
        handler = handlers.get(args.command, cmd_admin)
        return handler(args, vllm_args)
    except (UsageError, ConfigError) as e:
        print(f"vllm-guard: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def serve_config(args: argparse.Namespace, vllm_args: list[str]) -> GuardConfig:
    """guard.toml, then CLI flags, then validation; raises ConfigError/UsageError."""
    cfg = load(args.config)
    for flag, (section, key) in SERVE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            set_value(cfg, section, key, value)
    cfg.server.vllm_args = [*cfg.server.vllm_args, *vllm_args]
    owned = find_owned_arg(cfg.server.vllm_args)
    if owned is not None:
        raise UsageError(
            f"{owned!r} after -- is owned by the runtime: use vllm-guard's own --host/--port/--model"
        )
    validate(cfg)
    try:  # the plugin's own sections ([patches], [inject]) are checked before anything starts
        from vllm_guard.patches import hooks as patches_hooks
    except ImportError:
        patches_hooks = None
    if patches_hooks is not None and hasattr(patches_hooks, "validate"):
        patches_hooks.validate(cfg)
    return cfg


def _preflight_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"[server] port has value {port}: cannot bind {host}:{port} ({e.strerror})") from e


def _lock_state_dir(state_dir: Path) -> Any:
    state_dir.mkdir(parents=True, exist_ok=True)
    fh = open(state_dir / "runtime.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        raise UsageError(f"[server] state_dir has value {str(state_dir)!r}: another runtime owns it") from e
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def _vllm_importable(python: str) -> bool:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cmd_serve(args: argparse.Namespace, vllm_args: list[str]) -> int:
    from . import logsetup
    from .supervisor import Supervisor

    cfg = serve_config(args, vllm_args)
    python = cfg.server.python or sys.executable
    _preflight_port(cfg.server.host, cfg.server.port)
    lock = _lock_state_dir(Path(cfg.server.state_dir))
    logsetup.configure(args.log_level)
    if not _vllm_importable(python):
        print(f"vllm-guard: error: {python} cannot import vllm (install vllm-guard[cpu] or [gpu])", file=sys.stderr)
        return EXIT_BOOT_ERROR
    model = cfg.server.model
    if not model:
        try:
            model = str(tiny_model.ensure(tiny_model.default_dir(), python))
        except RuntimeError as e:
            print(f"vllm-guard: error: {e}", file=sys.stderr)
            return EXIT_BOOT_ERROR
    sup = Supervisor(cfg, model, python)

    async def main_async() -> int:
        try:
            return await sup.run(admin.start)
        except ValueError as e:  # e.g. admin_group names no group
            raise UsageError(str(e)) from e

    try:
        import uvloop  # vLLM depends on it; faster proxying where present

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(main_async())
    finally:
        lock.close()


def cmd_model(args: argparse.Namespace, _: list[str]) -> int:
    out = Path(args.dir) if args.dir else tiny_model.default_dir()
    try:
        tiny_model.ensure(out)
    except RuntimeError as e:
        print(f"vllm-guard: error: {e}", file=sys.stderr)
        return 1
    print(f"{out}  (tiny Llama, random weights: its text is noise)")
    return 0


def cmd_admin(args: argparse.Namespace, _: list[str]) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `vllm-guard status | head` is not an error
    body: dict[str, Any] = {}
    if getattr(args, "reason", None):
        body["reason"] = args.reason
    if getattr(args, "cls", None):
        body["class"] = args.cls
    method, path = ("GET", "/status") if args.command == "status" else ("POST", "/" + args.command)
    try:
        data = asyncio.run(admin.request(args.state_dir, method, path, body or None))
    except admin.AdminError as e:
        print(f"vllm-guard: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.command == "status":
        print(format_status(data))
    else:
        print(f"{args.command}: accepted (state {data.get('state')}, generation {data.get('generation')})")
    return 0


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"state       {s['state']} (generation {s['generation']}, for {s.get('state_for_s')}s)"
        + (f"  HOLD: {s['hold']}" if s.get("hold") else ""),
        f"requests    total {s['requests_total']}, this generation {s['requests_generation']}"
        f"/{s.get('requests_limit_generation') or '-'}, in flight {s['in_flight']}, queued {s['queued']}, "
        f"failed {s['failed_requests']}",
        f"failures    {s['failures']} unplanned" + "".join(
            f"\n  - {f['kind']} at {f['at']} exit={f['exit_code']} restored={f['restored_at']}"
            for f in s["failure_log"][-5:]),
        f"recycles    {len(s['recycles'])}" + "".join(
            f"\n  - {r['reason']} ({r['class']}) at {r['started']} in_flight={r['in_flight']} "
            f"queued={r['queued']} took {r['duration_s']}s" for r in s["recycles"][-5:]),
        f"backend     {s['backend_url']}  vLLM {s['vllm_version'] or '?'}  GPU {s.get('gpu_name') or 'none'}",
        "children    " + ", ".join(f"{c['role']}={c['pid']}" for c in s["children"]),
        f"ttft        p50 {s['ttft']['p50_ms']} ms, p99 {s['ttft']['p99_ms']} ms",
    ]
    growth = (s.get("memory") or {}).get("growth")
    if growth:
        lines.append(f"memory      growth since warm-up: RSS {growth['rss_mb']} MB, GPU {growth['gpu_mb']} MB")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace, _: list[str]) -> int:
    from .demo import run_demo

    return run_demo(args.state_dir, args.port, args.requests)
