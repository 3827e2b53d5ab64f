"""`vllm-guard watchdog`: the separate, light process (it never imports vllm or torch)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from typing import Any

from vllm_guard.runtime.config import ConfigError, load

from .settings import WatchdogConfig, apply_profile, from_table


def add_commands(sub: Any) -> dict[str, Any]:
    w = sub.add_parser("watchdog", help="watch GPU, host and server; recycle before OOM; record incidents")
    w.add_argument("--config", help="guard.toml ([watchdog] section; [server] state_dir)")
    w.add_argument("--state-dir", default=None, help="the runtime's state dir (admin socket, ledger)")
    w.add_argument("--dry-run", action="store_true", help="decide and record, never act")
    w.add_argument("--once", action="store_true", help="one tick, then exit")
    w.add_argument("--json", action="store_true", help="with --once: print the sample and verdicts as JSON")
    w.add_argument("--interval", default=None, help="[watchdog] interval (e.g. 1s)")
    w.add_argument("--nvml-trace", default=None, help="[watchdog] nvml_trace: replay this NVML JSONL trace")
    w.add_argument("--kernel", default=None, help="[watchdog] kernel: auto|kmsg|journal|off|FILE to replay")
    w.add_argument("--prometheus-port", default=None, help="[watchdog] prometheus_port (0: off)")
    w.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return {"watchdog": cmd_watchdog}


def build_config(args: argparse.Namespace) -> tuple[WatchdogConfig, set[str], str]:
    """guard.toml [watchdog], then flags; returns (config, keys set explicitly, state dir)."""
    gc = load(args.config)
    table = dict(gc.watchdog)
    for flag in ("interval", "nvml_trace", "kernel", "prometheus_port"):
        v = getattr(args, flag)
        if v is not None:
            if flag == "prometheus_port":
                if not v.isdigit():
                    raise ConfigError(f"[watchdog] prometheus_port has value {v!r}: not an integer")
                v = int(v)
            table[flag] = v
    if args.dry_run:
        table["dry_run"] = True
    cfg, explicit = from_table(table)
    state_dir = args.state_dir or (gc.server.state_dir if args.config else None) \
        or os.environ.get("VLLM_GUARD_STATE_DIR", ".state")
    return cfg, explicit, state_dir


def cmd_watchdog(args: argparse.Namespace, _: list[str]) -> int:
    from vllm_guard.runtime import logsetup

    cfg, explicit, state_dir = build_config(args)
    if args.json and not args.once:
        raise ConfigError("--json needs --once (the running watchdog logs JSON lines on stderr)")
    logsetup.configure(args.log_level)
    return asyncio.run(_main(cfg, explicit, state_dir, args.once, args.json))


async def _main(cfg: WatchdogConfig, explicit: set[str], state_dir: str, once: bool, as_json: bool) -> int:
    from .loop import Watchdog, verdicts_json
    import structlog

    from vllm_guard.runtime.notify import Notifier

    log = structlog.get_logger("vllm_guard.watchdog")
    wd = Watchdog(cfg, state_dir, exporter=not once)
    names = [s.get("name") or "" for s in wd.nvml.static]
    profile = apply_profile(cfg, explicit, names[0] if names else "")
    wd.ledger.set_meta({"gpu_profile": profile, "gpu_budget_mb": cfg.gpu_budget_mb, "gpu_names": names})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await wd.start()
    log.info("watchdog_started", state_dir=state_dir, gpus=names, profile=profile or None,
             nvml=wd.nvml.available, kernel=wd.kernel.name, dry_run=cfg.dry_run,
             prometheus=f"{cfg.prometheus_addr}:{cfg.prometheus_port}" if cfg.prometheus_port and not once else None)
    try:
        if once:
            s, results = await wd.tick()
            if wd._probe is not None:  # --once waits for its probe so the verdict is complete
                s["probe"] = await wd._probe
                wd._probe = None
            out = verdicts_json(s, results)
            print(json.dumps(out, indent=2 if as_json else None, default=str))
            return 0
        notifier = Notifier()  # its unit is Type=notify with its own WatchdogSec
        notifier.ready("watching")
        while not stop.is_set():
            await wd.tick()
            notifier.status(f"watching: tick {wd.ticks}")
            if notifier.watchdog_due():
                notifier.watchdog()
            if wd.replay_done():
                log.info("replay_finished", ticks=wd.ticks)
                break
            try:
                await asyncio.wait_for(stop.wait(), cfg.interval)
            except asyncio.TimeoutError:
                pass
        notifier.stopping()
        return 0
    finally:
        await wd.close()
