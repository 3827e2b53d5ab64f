"""Where things are when the operator does not say: the state dir and the installed config.

`vllm-guard status` (and recycle, restart, hold, release, watchdog, soak, report) on a box
where `vllm-guard install` ran should find the service without flags. Order:
`--state-dir`, then `$VLLM_GUARD_STATE_DIR`, then `[server] state_dir` of `--config`, then
of the installed `/etc/vllm-guard/guard.toml`, then `.state` in the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import DEFAULT_CONFIG, ConfigError, read_toml

LOCAL_STATE_DIR = ".state"


def installed_config(root: str | Path = "/") -> Path | None:
    """The installed guard.toml when it exists and is readable by this user."""
    p = Path(root) / DEFAULT_CONFIG.lstrip("/")
    return p if p.is_file() and os.access(p, os.R_OK) else None


def _state_dir_of(config: str | Path) -> str | None:
    data = read_toml(config)
    server = data.get("server")
    if isinstance(server, dict) and isinstance(server.get("state_dir"), str):
        return str(server["state_dir"])
    return None


def resolve_state_dir(arg: str | None, config: str | None = None, env: dict[str, str] | None = None,
                      root: str | Path = "/") -> tuple[str, str]:
    """(state dir, where it came from) following the order above."""
    env = dict(os.environ) if env is None else env
    if arg:
        return arg, "--state-dir"
    if env.get("VLLM_GUARD_STATE_DIR"):
        return env["VLLM_GUARD_STATE_DIR"], "$VLLM_GUARD_STATE_DIR"
    if config:
        found = _state_dir_of(config)
        if found:
            return found, f"[server] state_dir in {config}"
    installed = installed_config(root)
    if installed is not None:
        try:
            found = _state_dir_of(installed)
        except ConfigError:
            found = None
        if found:
            return found, f"[server] state_dir in {installed}"
    return LOCAL_STATE_DIR, "the default (./.state)"
