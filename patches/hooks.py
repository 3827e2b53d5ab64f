"""The runtime's side of the plugin: the child's env, and the patch states for status.

Imported by the supervisor, so it must never import vLLM or torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from vllm_guard.runtime.config import ConfigError, GuardConfig

from . import report, spec

PLUGIN_NAME = "vllm_guard"
ALLOC_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_VALUE = "expandable_segments:True"
NOTE_VAR = "VLLM_GUARD_ALLOC_NOTE"  # why the allocator setting was (not) applied; the plugin reports it


def validate(cfg: GuardConfig) -> tuple[spec.InjectSpec, spec.PatchSettings]:
    """Check `[inject]` and `[patches]`; raise ConfigError naming the key and value. Call at config time."""
    return spec.inject_from_table(cfg.inject), spec.patches_from_table(cfg.patches)


def _arg_value(args: Sequence[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def tensor_parallel_size(vllm_args: Sequence[str]) -> int:
    value = _arg_value(vllm_args, "--tensor-parallel-size", "-tp")
    try:
        return int(value) if value is not None else 1
    except ValueError as e:
        raise ConfigError(f"vLLM arg --tensor-parallel-size has value {value!r}: not an integer") from e


def alloc_conflict(vllm_args: Sequence[str]) -> str | None:
    """Why expandable segments must stay off for these vLLM args, or None."""
    if "--enable-sleep-mode" in vllm_args:
        return "sleep mode (--enable-sleep-mode) uses its own CUDA memory pool"
    if tensor_parallel_size(vllm_args) > 1 and "--disable-custom-all-reduce" not in vllm_args:
        return "tensor parallel with custom all-reduce (vLLM #14189, #43923)"
    return None


def plugins_value(current: str | None) -> str | None:
    """Keep the user's VLLM_PLUGINS and add ours; unset stays unset (vLLM then loads all)."""
    if current is None:
        return None
    names = [n.strip() for n in current.split(",") if n.strip()]
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return ",".join(names)


def child_env(env: dict[str, str], cfg: GuardConfig, vllm_args: list[str]) -> dict[str, str]:
    """The env of one vLLM generation: plugin enabled, allocator settings, injection."""
    inject, settings = validate(cfg)
    out = dict(env)
    plugins = plugins_value(out.get("VLLM_PLUGINS"))
    if plugins is not None:
        out["VLLM_PLUGINS"] = plugins
    if ALLOC_VAR in out:
        out[NOTE_VAR] = f"user set {ALLOC_VAR}={out[ALLOC_VAR]}"
    elif not settings.enabled or not settings.expandable_segments:
        out[NOTE_VAR] = "off in [patches]"
    elif (why := alloc_conflict(vllm_args)) is not None:
        out[NOTE_VAR] = f"not set: {why}"
    else:
        out[ALLOC_VAR] = ALLOC_VALUE
        out[NOTE_VAR] = f"set {ALLOC_VAR}={ALLOC_VALUE}"
    if settings.enabled and settings.malloc_arena_max and "MALLOC_ARENA_MAX" not in out:
        out["MALLOC_ARENA_MAX"] = str(settings.malloc_arena_max)
    if "VLLM_GUARD_INJECT" not in out and inject.active:
        out["VLLM_GUARD_INJECT"] = spec.format_kv(inject.active)
    if "VLLM_GUARD_PATCHES" not in out and cfg.patches:
        out["VLLM_GUARD_PATCHES"] = spec.format_kv(cfg.patches)
    return out


def read_states(state_dir: Path, generation: int) -> dict[str, Any]:
    """{pid: {"process", "patches": {id: {"state", "reason"}}, "events"?...}} for one generation."""
    states = report.read_reports(state_dir, generation)
    records = report.read_jsonl(report.gen_dir(state_dir, generation) / report.EVENTS)
    by_pid: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_pid.setdefault(str(r.get("pid")), []).append(r)
    for pid, data in states.items():
        if pid in by_pid:
            data["events"] = report.summarize_events(by_pid[pid])
    return states


def injected(state_dir: Path, generation: int) -> list[dict[str, Any]]:
    """What the fault injector did in that generation (its own channel)."""
    return report.read_jsonl(report.gen_dir(state_dir, generation) / report.INJECT)


def events(state_dir: Path, generation: int) -> list[dict[str, Any]]:
    return report.read_jsonl(report.gen_dir(state_dir, generation) / report.EVENTS)


__all__ = ["alloc_conflict", "child_env", "events", "injected", "plugins_value", "read_states", "validate"]
