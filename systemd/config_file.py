"""The guard.toml that `install` writes: the base file, validated whole, plus the flags.

The base (`--config`, else the installed file) is read with `core.config.load`, so every
section is checked exactly as `serve` and `watchdog` check it: a file they would reject is
rejected here, before anything is written. Flags go through the same coercion
(`core.config.set_value`); their errors name the flag. The file written back holds the keys the
base set or the flags changed, plus the whole `[install]` section, rendered with
`core.config.section_table`; it is loaded again before it is written (what `serve` will read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_guard.core import config as C
from vllm_guard.core.config import GuardConfig
from vllm_guard.core.errors import ConfigError, UsageError

from . import render as R


def base_config(path: str | None, installed: Path) -> GuardConfig:
    """`--config`, else the installed guard.toml, else the defaults; every section validated."""
    if path is not None:
        return C.load(path)
    return C.load(installed) if installed.exists() else GuardConfig()


def set_flag(cfg: GuardConfig, section: str, key: str, value: Any, flag: str) -> None:
    """`[section] key` from a command-line flag, through the one coercion; errors name the flag."""
    try:
        C.set_value(cfg, section, key, value)
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
                layout: R.Layout) -> GuardConfig:
    """The installer's flags and its fixed values (state dir, admin group) on top of the base."""
    if model:
        set_flag(cfg, "server", "model", model, "--model")
    if host:
        set_flag(cfg, "server", "host", host, "--host")
    if port is not None:
        set_flag(cfg, "server", "port", port, "--port")
    if user is not None:
        set_flag(cfg, "install", "user", user, "--user")
    if watchdog_user is not None:
        set_flag(cfg, "install", "watchdog_user", watchdog_user, "--watchdog-user")
    if gpus is not None:
        set_flag(cfg, "install", "gpus", [g.strip() for g in gpus.split(",") if g.strip()], "--gpus")
    if env:
        set_flag(cfg, "install", "env", {**cfg.install.env, **dict(parse_env_flag(e) for e in env)}, "--env")
    C.set_value(cfg, "server", "state_dir", layout.state_dir)
    C.set_value(cfg, "server", "admin_group", cfg.install.group)
    return C.validate(cfg)


def tables(cfg: GuardConfig) -> dict[str, dict[str, Any]]:
    """What goes into the file: explicit keys of each section, `[install]` in full."""
    out: dict[str, dict[str, Any]] = {}
    for name in C.SECTIONS:
        table = C.section_table(getattr(cfg, name))
        if name != "install":
            keys = cfg.explicit.get(name, set())
            table = {k: v for k, v in table.items() if k in keys}
        if table:
            out[name] = table
    return out


def render(cfg: GuardConfig, layout: R.Layout) -> tuple[str, GuardConfig]:
    """The file's text, and the config `serve` will load from it (a bad round trip fails now)."""
    text = R.toml_text(tables(cfg), R.config_header(layout))
    try:
        again = C.from_data(C.tomllib.loads(text), layout.config)
    except (ConfigError, C.tomllib.TOMLDecodeError) as e:  # a bug of ours, not the operator's
        raise ConfigError(f"the guard.toml install would write does not load back: {e}") from e
    return text, again
