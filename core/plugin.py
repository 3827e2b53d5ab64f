"""The contract between the runtime and the vLLM plugin: the child's environment, and the
per-process report files the plugin writes and the runtime reads.

Environment of each vLLM generation: VLLM_PLUGINS keeps the user's list and adds ours;
VLLM_GUARD_STATE_DIR / VLLM_GUARD_GENERATION say where to report; VLLM_GUARD_INJECT and
VLLM_GUARD_PATCHES carry `[inject]` and `[patches]` as `key=value,...` (a plain `vllm serve`
can be driven the same way); allocator settings where they are safe.

Report files under the state dir, one folder per generation so a recycle never mixes them:
  patches/gen-<N>/<pid>.json    one per vLLM process, rewritten atomically (tmp + rename)
  patches/gen-<N>/events.jsonl  patch events (orphans reclaimed, idle releases)
  patches/gen-<N>/inject.jsonl  what the fault injector did (tests compare guards against it)

The startup gate (gated pre-start, docs/RUNTIME.md): the runtime sets VLLM_GUARD_GATE to
`patches/gen-<N>/gate/` and VLLM_GUARD_GATE_TIMEOUT for one generation only. Its EngineCore,
fully imported and before any CUDA work, writes `gate/state.json` (a `GateReport`: parked, or
skipped with the reason) and waits until the runtime creates `gate/open`; then it writes
`opened` and goes on. Files, not a fifo: either side may look at any time, a restart of either
leaves a readable record, and nothing blocks when the other side is gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .config import ConfigError, GuardConfig, InjectConfig, PatchesConfig, format_kv, parse_kv, section_from_table
from .errors import ProtocolError
from .protocol import GateReport, PatchEvents, PatchProcessReport, decode
from .vllm_api import arg_value

PLUGIN_NAME = "vllm_guard"
STATE_DIR_VAR = "VLLM_GUARD_STATE_DIR"
GENERATION_VAR = "VLLM_GUARD_GENERATION"
INJECT_VAR = "VLLM_GUARD_INJECT"
PATCHES_VAR = "VLLM_GUARD_PATCHES"
ALLOC_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_VALUE = "expandable_segments:True"
NOTE_VAR = "VLLM_GUARD_ALLOC_NOTE"  # why the allocator setting was (not) applied; the plugin reports it
EVENTS = "events.jsonl"
INJECT = "inject.jsonl"
GATE_VAR = "VLLM_GUARD_GATE"  # the generation's gate dir; set only for a gated generation
GATE_TIMEOUT_VAR = "VLLM_GUARD_GATE_TIMEOUT"  # seconds the engine waits at the gate, then exits
# the model dir whose safetensors a gated generation's EngineCore reads into host memory before it
# parks (`[server] prestage_weights = "on"`); set only beside GATE_VAR
PRESTAGE_VAR = "VLLM_GUARD_PRESTAGE"
# "1": a gated generation imports, before it parks, the modules a generation of this state dir
# imported after its gate (`[server] warm_start = "on"`); set only beside GATE_VAR
WARM_VAR = "VLLM_GUARD_WARM"
# vLLM's own switch for its usage report: a gated generation (a recycle of a running deployment)
# does not send it again, and its thread does not run in the gap (set only where not already set)
USAGE_STATS_VAR = "VLLM_NO_USAGE_STATS"
GATE_AT_VAR = "VLLM_GUARD_GATE_AT"  # "ready": park once ready (held KV cache), not before CUDA
GATE_AT_READY = "ready"
KV_VAR = "VLLM_GUARD_KV"  # "held": map the replica holder's KV cache (`core.holder`); else its own
KV_HELD = "held"
KV_OWN = "own"
# the ratio a start paces its engine work by (`patches.pace`), set only for a start whose engine work
# runs while another generation of its replica serves (`pace_wanted`)
PACE_VAR = "VLLM_GUARD_PACE"
UNPACE = "unpace"  # in a generation's report dir: nothing serves beside its start any more, stop pacing
GATE_STATE = "state.json"
GATE_OPEN = "open"


def tensor_parallel_size(vllm_args: Sequence[str]) -> int:
    value = arg_value(vllm_args, "--tensor-parallel-size") or arg_value(vllm_args, "-tp")
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


def child_env(env: Mapping[str, str], cfg: GuardConfig, vllm_args: Sequence[str]) -> dict[str, str]:
    """The env of one vLLM generation: plugin enabled, allocator settings, injection."""
    out = dict(env)
    settings = cfg.patches
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
    if INJECT_VAR not in out and cfg.inject.active:
        out[INJECT_VAR] = format_kv(cfg.inject.active)
    explicit = cfg.explicit.get("patches", frozenset())
    if PATCHES_VAR not in out and explicit:
        from .config import section_table

        table = section_table(settings)
        out[PATCHES_VAR] = format_kv({k: v for k, v in table.items() if k in explicit})
    return out


def pace_wanted(cfg: GuardConfig, beside: bool, gated: bool, late: bool) -> bool:
    """Whether a start paces its engine work (`[patches] pace_beside`): only where that work runs
    while another generation serves, an overlap's successor or a standby that parks once ready. A
    start that parks before CUDA does its engine work after its gate, when the old one is gone."""
    p = cfg.patches
    return beside and (not gated or late) and p.pace_beside > 0 and p.wants("pace-beside")


def pace_env(env: Mapping[str, str], cfg: GuardConfig, paced: bool) -> dict[str, str]:
    """The env of a start that paces (`pace_wanted`) or does not."""
    out = dict(env)
    out.pop(PACE_VAR, None)
    if paced:
        out[PACE_VAR] = f"{cfg.patches.pace_beside:g}"
    return out


def unpace(state_dir: str | Path, generation: int) -> None:
    """Tell a paced start that nothing serves beside it any more (the plugin looks at each point)."""
    d = gen_dir(state_dir, generation)
    d.mkdir(parents=True, exist_ok=True)
    (d / UNPACE).touch()


def settings_from_env(env: Mapping[str, str]) -> tuple[InjectConfig, PatchesConfig]:
    """What a vLLM process reads at plugin load; ConfigError names the bad entry."""
    inject = section_from_table("inject", parse_kv(env.get(INJECT_VAR, ""), "inject"), text=True)
    patches = section_from_table("patches", parse_kv(env.get(PATCHES_VAR, ""), "patches"), text=True)
    return inject, patches


# -- report files -----------------------------------------------------------------------------
def gen_dir(state_dir: str | Path, generation: int) -> Path:
    return Path(state_dir) / "patches" / f"gen-{int(generation)}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (process killed mid-write) is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def summarize_events(records: list[dict[str, Any]]) -> PatchEvents:
    """Totals for status: orphans reclaimed, idle releases and bytes."""
    reclaimed = [r for r in records if r.get("event") == "orphans_reclaimed"]
    releases = [r for r in records if r.get("event") == "idle_release"]
    return PatchEvents(
        orphan_events=len(reclaimed),
        orphan_blocks_reclaimed=sum(len(r.get("block_ids", [])) for r in reclaimed),
        idle_releases=len(releases),
        idle_released_bytes=sum(int(r.get("released_bytes", 0)) for r in releases),
    )


def read_states(state_dir: str | Path, generation: int) -> dict[str, PatchProcessReport]:
    """{pid: report} for one generation's processes; dead processes are marked, not dropped.
    A report that does not match the schema is left out (the plugin is of another version)."""
    d = gen_dir(state_dir, generation)
    if not d.is_dir():
        return {}
    by_pid: dict[str, list[dict[str, Any]]] = {}
    for r in read_jsonl(d / EVENTS):
        by_pid.setdefault(str(r.get("pid")), []).append(r)
    out: dict[str, PatchProcessReport] = {}
    for p in sorted(d.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        pid = p.stem
        if not isinstance(data, dict):
            continue
        data["alive"] = pid.isdigit() and _alive(int(pid))
        if pid in by_pid:
            data["events"] = summarize_events(by_pid[pid]).model_dump()
        try:
            out[pid] = decode(PatchProcessReport, data)
        except ProtocolError:
            continue
    return out


def injected(state_dir: str | Path, generation: int) -> list[dict[str, Any]]:
    """What the fault injector did in that generation (its own channel)."""
    return read_jsonl(gen_dir(state_dir, generation) / INJECT)


def events(state_dir: str | Path, generation: int) -> list[dict[str, Any]]:
    return read_jsonl(gen_dir(state_dir, generation) / EVENTS)


# -- the startup gate -------------------------------------------------------------------------
def gate_dir(state_dir: str | Path, generation: int) -> Path:
    return gen_dir(state_dir, generation) / "gate"


def gate_env(env: Mapping[str, str], gate: Path, timeout_s: float, prestage: str | None = None,
             warm: bool = False, at_ready: bool = False) -> dict[str, str]:
    """The env of a generation that must park at `gate` (at most `timeout_s` seconds); with
    `prestage` (a model dir), its engine reads that model's weights into host memory first; with
    `warm`, its processes import what an earlier generation imported after its gate; with
    `at_ready`, it parks once ready on the held KV cache (before CUDA when it has none held)."""
    out = {**env, GATE_VAR: str(gate), GATE_TIMEOUT_VAR: f"{timeout_s:.0f}"}
    if at_ready:
        out[GATE_AT_VAR] = GATE_AT_READY
    if prestage:
        out[PRESTAGE_VAR] = prestage
    if warm:
        out[WARM_VAR] = "1"
        out.setdefault(USAGE_STATS_VAR, "1")
    return out


def warm_imports_path(state_dir: str | Path, role: str) -> Path:
    """The modules a generation's `role` process (api_server, engine_core) imported after its
    plugin loaded, as the last generation to get up recorded them (`patches.warmstart`)."""
    return Path(state_dir) / "patches" / f"warm-imports-{role}.json"


def prestage_applies(vllm_args: Sequence[str]) -> str | None:
    """Why prestaged weights would go unused with these vLLM args, or None: vLLM loads them in
    the engine process itself only with one GPU per engine (its `uni` executor); with tensor or
    pipeline parallelism the workers are separate processes that read the files themselves."""
    pp = arg_value(vllm_args, "--pipeline-parallel-size") or arg_value(vllm_args, "-pp") or "1"
    if tensor_parallel_size(vllm_args) > 1 or pp.strip() != "1":
        return "tensor or pipeline parallel: the workers load the weights in processes of their own"
    return None


def kv_hold_applies(vllm_args: Sequence[str]) -> str | None:
    """Why a held KV cache cannot be shared with these vLLM args, or None: every generation must
    size it the same, which only `--kv-cache-memory-bytes` guarantees (else vLLM sizes it from the
    memory free at each start); one engine process per replica (no tensor or pipeline parallel)."""
    if not arg_value(vllm_args, "--kv-cache-memory-bytes"):
        return "no --kv-cache-memory-bytes: vLLM sizes the KV cache from the memory free at each start"
    return prestage_applies(vllm_args)


def read_gate(gate: Path) -> GateReport | None:
    """The engine's word at the gate; None until it has said anything (or if it is unreadable)."""
    try:
        return decode(GateReport, json.loads((gate / GATE_STATE).read_text()))
    except (OSError, ValueError, ProtocolError):
        return None


def gate_settled(report: GateReport | None) -> bool:
    """The engine will say nothing more at its gate: it went on (opened), could not park
    (skipped) or gave up waiting (timed_out)."""
    return report is not None and report.state in ("opened", "skipped", "timed_out")


def open_gate(gate: Path, kv: str = "") -> None:
    """Let the parked engine go on (idempotent); `kv` (held | own) is what its KV cache is to be,
    for an engine that allocates it after the gate (written before the open mark appears)."""
    gate.mkdir(parents=True, exist_ok=True)
    tmp = gate / f".{GATE_OPEN}.{os.getpid()}"
    tmp.write_text(f"kv={kv}\n" if kv else "")
    os.replace(tmp, gate / GATE_OPEN)


def gate_kv(gate: str | Path) -> str | None:
    """The KV cache the runtime said at the opening of `gate`; None: not open, or nothing said."""
    try:
        text = (Path(gate) / GATE_OPEN).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("kv=") and line[3:] in (KV_HELD, KV_OWN):
            return line[3:]
    return None


def gate_is_open(gate: Path) -> bool:
    return (gate / GATE_OPEN).exists()
