"""A reload: the configuration the runtime was started with, composed again, held against the one
it runs, and judged here, purely.

`vllm-guard reload` and SIGHUP re-read guard.toml the way `serve` composed it: the same file, the
same command-line flags and vLLM arguments re-applied on top (`runtime.cli.composer`). The verdict:
- refused: the file does not validate (its one `ConfigError` line, which names the key), or it
  changes a key the runtime bound when it started (`RESTART_ONLY`: which key, and that it needs
  `systemctl restart`). Nothing of it is applied; the serving generation goes on;
- unchanged: the runtime's sections hash the same (`config_hash`): nothing to do, no recycle;
- apply: the keys that changed (`changed_keys`); the supervisor swaps the one value and a recycle
  with reason "reload" gives each replica a generation of the new configuration.
Sections the runtime does not read (`[watchdog]`, `[soak]`, `[install]`) are named, not applied.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

import msgspec

from vllm_guard.core.config import SECTIONS, GuardConfig
from vllm_guard.core.errors import GuardError

# what the runtime reads of guard.toml; the rest belongs to the watchdog, soak and install
RUNTIME_SECTIONS = ("server", "recycle", "probe", "inject", "patches", "ledger")
HASH_CHARS = 12

# Keys the runtime bound when it started, and where: a reload that changes one is refused whole.
RESTART_ONLY: dict[tuple[str, str], str] = {
    ("server", "host"): "the public socket is bound at start",
    ("server", "port"): "the public socket is bound at start",
    ("server", "max_connections"): "the public listener's connection cap is set at start",
    ("server", "header_timeout"): "the public listener's header timeout is set at start",
    ("server", "idle_timeout"): "the public listener's keep-alive is set at start",
    ("server", "max_body_mb"): "the public listener's body limit is set at start",
    ("server", "state_dir"): "the ledger, the lock and the admin socket live there",
    ("server", "admin_group"): "the admin socket is created at start",
    ("server", "admin_mode"): "the admin socket is created at start",
    ("server", "metrics_addr"): "the metrics port is bound at start",
    ("server", "metrics_port"): "the metrics port is bound at start",
    ("server", "replicas"): "the replicas and their GPUs are planned at start",
    ("server", "gpus"): "the replicas and their GPUs are planned at start",
    ("server", "python"): "vLLM's interpreter is probed at start (its version, CPU build, attention ISA)",
    ("ledger", "request_retention"): "the ledger's request recorder is set up at start",
}

Verdict = Literal["refused", "unchanged", "apply"]


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload does; `cfg` and `model` are the new configuration (only for "apply")."""

    verdict: Verdict
    detail: str  # one line for the operator
    config_hash: str = ""  # of the configuration the runtime runs after it
    changed: tuple[str, ...] = ()  # "[section] key" the reload changes
    ignored: tuple[str, ...] = ()  # changed keys of sections the runtime does not read
    cfg: GuardConfig | None = None
    model: str = ""


def _table(cfg: GuardConfig, section: str) -> dict[str, Any]:
    return msgspec.structs.asdict(getattr(cfg, section))


def config_hash(cfg: GuardConfig) -> str:
    """A short, stable hash of what the runtime reads of `cfg` (the order of keys in the file, its
    comments and the other sections do not count)."""
    data = {s: _table(cfg, s) for s in RUNTIME_SECTIONS}
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def changed_keys(old: GuardConfig, new: GuardConfig, sections: tuple[str, ...] = tuple(SECTIONS)) -> list[str]:
    """`[section] key` of every value that differs, in the schema's order."""
    out = []
    for s in sections:
        a, b = _table(old, s), _table(new, s)
        out += [f"[{s}] {k}" for k in a if a[k] != b.get(k)]
    return out


def restart_needed(old: GuardConfig, new: GuardConfig) -> str | None:
    """The refusal line for the first changed key only a restart applies, else None."""
    for (s, k), why in RESTART_ONLY.items():
        a, b = getattr(getattr(old, s), k), getattr(getattr(new, s), k)
        if a != b:
            return (f"[{s}] {k} has value {b!r} (running with {a!r}): {why}; apply it with "
                    "`systemctl restart vllm-guard` (nothing was reloaded)")
    return None


def plan_reload(old: GuardConfig, compose: Callable[[], tuple[GuardConfig, str]]) -> ReloadPlan:
    """Compose the configuration again and judge it against `old` (see the module's docstring)."""
    was = config_hash(old)
    try:
        new, model = compose()
    except GuardError as e:  # ConfigError, UsageError: one line that names the key
        return ReloadPlan("refused", str(e), was)
    except (OSError, RuntimeError) as e:  # the tiny model could not be built, a file vanished
        return ReloadPlan("refused", f"{type(e).__name__}: {e}", was)
    why = restart_needed(old, new)
    if why is not None:
        return ReloadPlan("refused", why, was)
    runtime = changed_keys(old, new, RUNTIME_SECTIONS)
    other = tuple(k for k in changed_keys(old, new) if k not in runtime)
    note = f"; not the runtime's, left to their own services: {', '.join(other)}" if other else ""
    now = config_hash(new)
    if not runtime:
        what = "started without --config: no file to re-read" if new.source is None else "unchanged"
        return ReloadPlan("unchanged", f"configuration {was} {what}: nothing to do{note}", was, (), other)
    return ReloadPlan("apply", f"configuration {was} -> {now}: {', '.join(runtime)}{note}", now,
                      tuple(runtime), other, new, model)


__all__ = ["HASH_CHARS", "RESTART_ONLY", "RUNTIME_SECTIONS", "ReloadPlan", "changed_keys", "config_hash",
           "plan_reload", "restart_needed"]
