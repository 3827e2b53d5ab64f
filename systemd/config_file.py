"""The guard.toml that `install` writes: the base file, validated whole, plus the flags.

The base (`--config`, else the installed file) is read with `core.config.load`, so every
section is checked exactly as `serve` and `watchdog` check it: a file they would reject is
rejected here, before anything is written. Flags go through the same coercion
(`core.config.with_value`); their errors name the flag. A new file (no installed one, or
`--config`) gets the recycle settings a GPU box wants (`GPU_BOX_RECYCLE`) for every key the base
did not set. The file written back is complete and commented (`guardtoml`): the keys the base
set or the flags changed as settings, every other key commented out with its default; it is
loaded again before it is written (what `serve` will read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_guard.core import config as C
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.errors import ConfigError, UsageError

from . import guardtoml
from . import render as R

# A GPU box: recycle before a leak takes the host or the card (memory growth since warm-up of
# vLLM's processes), never on a request count unless asked. The watchdog's memory forecast
# (`[watchdog] forecast_horizon`) is on by default and recycles preventively on its own.
GPU_BOX_RECYCLE: dict[str, Any] = {
    "max_host_rss_growth_mb": 4096.0,  # a healthy server's RSS settles after warm-up; 4 GiB more is a leak
    "max_gpu_memory_growth_mb": 1024.0,  # beside a preallocated KV pool, 1 GiB more eats the card's slack
    "max_requests": 0,
    "max_uptime": 0.0,
}
# install flag -> (section, key)
RECYCLE_FLAGS: dict[str, tuple[str, str]] = {
    "max_requests": ("recycle", "max_requests"),
    "max_requests_jitter": ("recycle", "max_requests_jitter"),
    "max_uptime": ("recycle", "max_uptime"),
    "max_gpu_memory_growth_mb": ("recycle", "max_gpu_memory_growth_mb"),
    "max_host_rss_growth_mb": ("recycle", "max_host_rss_growth_mb"),
    "forecast_horizon": ("watchdog", "forecast_horizon"),
}


def base_config(path: str | None, installed: Path) -> tuple[GuardConfig, bool]:
    """(`--config`, else the installed guard.toml, else the defaults; every section validated,
    new): new when it is not the installed file, so install's own defaults apply to it."""
    if path is not None:
        return C.load(path), True
    if installed.exists():
        return C.load(installed), False
    return GuardConfig(), True


def gpu_box_defaults(cfg: GuardConfig) -> GuardConfig:
    """`cfg` with GPU_BOX_RECYCLE for each `[recycle]` key the base did not set."""
    given = cfg.explicit.get("recycle", frozenset())
    missing = {key: value for key, value in GPU_BOX_RECYCLE.items() if key not in given}
    return C.with_values(cfg, "recycle", missing) if missing else cfg


def recycle_off(cfg: GuardConfig) -> bool:
    """True when no runtime recycle trigger is on (an old installed file without `[recycle]`)."""
    r = cfg.recycle
    return not (r.max_requests or r.max_uptime or r.max_gpu_memory_growth_mb or r.max_host_rss_growth_mb)


def set_flag(cfg: GuardConfig, section: str, key: str, value: Any, flag: str) -> GuardConfig:
    """`cfg` with `[section] key` from a command-line flag, through the one coercion; errors name
    the flag."""
    try:
        return C.with_value(cfg, section, key, value)
    except ConfigError as e:
        raise UsageError(str(e).replace(f"[{section}] {key}", flag, 1)) from e


def parse_env_flag(text: str) -> tuple[str, str]:
    """`--env NAME=VALUE`, checked by the `[install] env` rule."""
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ConfigError("no '='")
        C.coerce("install", "env", {key: value})
    except ConfigError as e:
        raise UsageError(f"--env has value {text!r}: use NAME=VALUE") from e
    return key, value


def apply_flags(cfg: GuardConfig, *, model: str | None, host: str | None, port: int | None,
                user: str | None, watchdog_user: str | None, gpus: str | None, env: list[str],
                layout: R.Layout, recycle: dict[str, Any] | None = None) -> GuardConfig:
    """The installer's flags and its fixed values (state dir, admin group) on top of the base.
    `recycle`: RECYCLE_FLAGS name -> value given."""
    for flag, value in (recycle or {}).items():
        section, key = RECYCLE_FLAGS[flag]
        cfg = set_flag(cfg, section, key, value, "--" + flag.replace("_", "-"))
    flags: list[tuple[str, str, Any, str]] = [
        ("server", "model", model or None, "--model"), ("server", "host", host or None, "--host"),
        ("server", "port", port, "--port"), ("install", "user", user, "--user"),
        ("install", "watchdog_user", watchdog_user, "--watchdog-user"),
        ("server", "gpus", None if gpus is None else [g.strip() for g in gpus.split(",") if g.strip()], "--gpus"),
        ("install", "env", {**cfg.install.env, **dict(parse_env_flag(e) for e in env)} if env else None, "--env"),
    ]
    for section, key, value, flag in flags:
        if value is not None:
            cfg = set_flag(cfg, section, key, value, flag)
    cfg = C.with_value(cfg, "server", "state_dir", layout.state_dir)
    cfg = C.with_value(cfg, "server", "admin_group", cfg.install.group)
    return C.validate(cfg)


def render(cfg: GuardConfig, layout: R.Layout) -> tuple[str, GuardConfig]:
    """The file's text, and the config `serve` will load from it (a bad round trip fails now)."""
    text = guardtoml.render(cfg, R.config_header(layout))
    try:
        again = C.from_data(C.tomllib.loads(text), layout.config)
    except (ConfigError, C.tomllib.TOMLDecodeError) as e:  # a bug of ours, not the operator's
        raise ConfigError(f"the guard.toml install would write does not load back: {e}") from e
    return text, again
