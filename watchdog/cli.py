"""`vllm-guard watchdog`: the separate, light process (it never imports vllm or torch)."""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass
from typing import Any

from vllm_guard.core.config import GuardConfig, WatchdogConfig

FLAGS = ("interval", "nvml_trace", "kernel", "prometheus_port")


def add_commands(sub: Any) -> dict[str, Any]:
    w = sub.add_parser("watchdog", help="watch GPU, host and server; recycle before OOM; record incidents")
    w.add_argument("--config", help="guard.toml: every section is validated; [watchdog] settings, [server] "
                                    "state_dir, the API key and gpus (the service's GPUs), [install] env")
    w.add_argument("--state-dir", default=None, help="the runtime's state dir (admin socket, ledger)")
    w.add_argument("--dry-run", action="store_true", help="decide and record, never act")
    w.add_argument("--once", action="store_true", help="one tick, print one line per detector, exit")
    w.add_argument("--json", action="store_true", help="with --once: print the sample and verdicts as JSON")
    w.add_argument("--interval", default=None, help="time between ticks (default 1s)")
    w.add_argument("--nvml-trace", default=None, help="replay this NVML JSONL trace instead of the live GPUs")
    w.add_argument("--kernel", default=None, help="kernel messages: auto, kmsg, journal, off, or a file to replay")
    w.add_argument("--prometheus-port", default=None, help="exporter port on prometheus_addr (default 9464; 0: off)")
    w.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return {"watchdog": cmd_watchdog}


@dataclass(frozen=True)
class Settings:
    guard: GuardConfig
    state_dir: str
    env: dict[str, str]  # the service's environment: GPU visibility, API key
    api_key: str | None
    gpus: tuple[str, ...] = ()  # [server] gpus: the GPUs the service's replicas use

    @property
    def watchdog(self) -> WatchdogConfig:
        return self.guard.watchdog


def build_settings(args: argparse.Namespace) -> Settings:
    """The whole guard.toml validated (core.config), then the flags; the state dir by the core's
    rule; the service's environment and API key from the file when one is given."""
    from vllm_guard.core import config, paths, vllm_api

    gc = config.load(args.config)
    for flag in FLAGS:
        v = getattr(args, flag)
        if v is not None:
            gc = config.with_value(gc, "watchdog", flag, config.coerce("watchdog", flag, v, text=True))
    if args.dry_run:
        gc = config.with_value(gc, "watchdog", "dry_run", True)
    config.validate(gc)
    state_dir, _ = paths.resolve_state_dir(args.state_dir, args.config)
    env = {**os.environ, **gc.install.environment()} if args.config else dict(os.environ)
    key = vllm_api.api_key(gc.server.vllm_args if args.config else [], env)
    return Settings(gc, state_dir, env, key, tuple(gc.server.gpus) if args.config else ())


def cmd_watchdog(args: argparse.Namespace, _: list[str]) -> int:
    from vllm_guard.core import logsetup
    from vllm_guard.core.errors import UsageError

    if args.json and not args.once:
        raise UsageError("--json needs --once (the running watchdog logs JSON lines on stderr)")
    settings = build_settings(args)
    logsetup.configure(args.log_level)
    return asyncio.run(_main(settings, args.once, args.json))


async def _main(st: Settings, once: bool, as_json: bool) -> int:
    import json
    import signal

    import structlog

    from vllm_guard.core.notify import Notifier

    from .loop import Watchdog, open_nvml, summary_text, verdicts_json
    from .profiles import apply_profile

    log = structlog.get_logger("vllm_guard.watchdog")
    nvml = open_nvml(st.watchdog)  # first: the GPU's name picks the profile the detectors are built with
    names = nvml.names()
    cfg, profile = apply_profile(st.watchdog, st.guard.explicit.get("watchdog", set()), names[0] if names else "")
    cap = st.guard.inject.gpu_cap_mb  # the card acts this small (core.gpu's rule)
    wd = Watchdog(cfg, st.state_dir, exporter=not once, env=st.env, api_key=st.api_key, gpus=st.gpus, nvml=nvml,
                  gpu_cap_mb=cap)
    wd.ledger.set_meta({"gpu_profile": profile, "gpu_budget_mb": cfg.gpu_budget_mb, "gpu_names": names,
                        "gpu_cap_mb": cap})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await wd.start()
    log.info("watchdog_started", state_dir=st.state_dir, gpus=names, profile=profile or None,
             nvml=wd.nvml.available, kernel=wd.kernel.name, dry_run=cfg.dry_run, api_key=bool(st.api_key),
             prometheus=f"{cfg.prometheus_addr}:{cfg.prometheus_port}" if cfg.prometheus_port and not once else None)
    try:
        if once:
            s = await wd.collect()
            await wd.finish_probe(s)  # --once waits for its probe so the verdict is complete
            results = await wd.judge(s)
            print(json.dumps(verdicts_json(s, results), indent=2, default=str) if as_json else summary_text(s, results))
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
