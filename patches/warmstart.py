"""Warm start: a gated generation imports, before it parks, what the last one imported after its gate.

After a gated generation's gate opens, a good part of vLLM's start is Python importing modules
it did not need before (the model's layers and attention backends, third-party kernels, the
API server's routers and uvicorn's protocols once the engine is up) and the garbage collector
walking everything imported so far. None of it needs the GPU. So every vLLM process of a
generation records the modules it imported after the plugin loaded, up to its engine being up
(EngineCore) or its app started (API server), in `<state>/patches/warm-imports-<role>.json`
(`core.protocol.WarmImports`); a later gated generation (`[server] warm_start = "on"`)
imports that list before its gate, then moves everything it has so far out of the collector's
sight (`gc.freeze`, what vLLM itself does at the end of its start), so the collections vLLM
makes after the gate walk only what is new.

Never at the engine's expense: no CUDA before the gate (torch's lazy CUDA init raises while the
list is imported, so a module that would initialise CUDA at import fails here and is imported
after the gate as before), a module that fails is listed in the report and left for later, a
list from another vLLM version is ignored, and any error leaves the process as it was.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from vllm_guard.core import plugin as contract
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.protocol import WarmImports, WarmReport, decode
from vllm_guard.core.timefmt import utcnow

from .report import write_json_atomic

log = logging.getLogger("vllm.vllm_guard.warmstart")

ROLES = ("api_server", "engine_core")
SKIP_PREFIXES = ("__main__", "__mp_main__", "vllm_guard", "sitecustomize")


def asked(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get(contract.GATE_VAR, "").strip()) and env.get(contract.WARM_VAR, "") == "1"


def list_path(role: str, env: Mapping[str, str] = os.environ) -> Path | None:
    sd = env.get(contract.STATE_DIR_VAR, "").strip()
    return contract.warm_imports_path(sd, role) if sd and role in ROLES else None


def _roots() -> tuple[str, ...]:
    """The sys.path folders, as given and resolved (a module's origin is compared as a string)."""
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    return tuple({os.path.join(d, "") for d in dirs} | {os.path.join(os.path.realpath(d), "") for d in dirs})


def importable(name: str, origin: Any, roots: tuple[str, ...]) -> bool:
    """A module another process can import by name: from a file under sys.path (not one loaded
    by path from a cache, not __main__, not ours)."""
    if name.startswith(SKIP_PREFIXES):
        return False
    return isinstance(origin, str) and os.path.isabs(origin) and origin.startswith(roots)


def _origin(module: Any) -> Any:
    spec = getattr(module, "__spec__", None)
    return getattr(spec, "origin", None) if spec is not None else None


class Recorder:
    """Remembers which modules were loaded when it was made; `record()` writes the ones added since.

    `record()` runs where a start ends (in the gap, for a gated generation): it only takes the
    names and origins (milliseconds); filtering and writing go to a thread."""

    def __init__(self, role: str, path: Path, version: str) -> None:
        self.role, self.path, self.version = role, path, version
        self.baseline = set(sys.modules)
        self.roots = _roots()
        self.done = False
        self.thread: threading.Thread | None = None

    def new_modules(self) -> list[tuple[str, Any]]:
        """(name, origin) of each module loaded since, in the order they were first loaded."""
        return [(n, _origin(m)) for n, m in list(sys.modules.items()) if n not in self.baseline]

    def record(self) -> None:
        """Write the list once (later calls do nothing); never raises."""
        if self.done:
            return
        self.done = True
        try:
            found = self.new_modules()
        except Exception:  # noqa: BLE001 - a record is an optimisation: never break serving
            log.exception("vllm-guard warm start: could not list this process's imports")
            return
        self.thread = threading.Thread(target=self.write, args=(found,), name="vllm-guard-warm-record",
                                       daemon=True)
        self.thread.start()

    def write(self, found: list[tuple[str, Any]]) -> int:
        try:
            mods = [n for n, origin in found if importable(n, origin, self.roots)]
            data = {"schema": "vllm-guard-warm-imports/1", "role": self.role, "vllm_version": self.version,
                    "recorded_at": utcnow(), "generation": os.environ.get(contract.GENERATION_VAR),
                    "modules": mods}
            decode(WarmImports, data)
            write_json_atomic(self.path, data)
            log.info("vllm-guard warm start: %d modules imported after the plugin loaded, recorded in %s",
                     len(mods), self.path)
            return len(mods)
        except Exception:  # noqa: BLE001 - a record is an optimisation: never break serving
            log.exception("vllm-guard warm start: could not record this process's imports")
            return 0


def after(obj: Any, name: str, then: Callable[[], Any]) -> None:
    """Wrap `obj.name` (sync or async) so that `then()` runs once it has returned."""
    orig = getattr(obj, name)
    if getattr(orig, "_vllm_guard_warm", False):
        return
    if inspect.iscoroutinefunction(orig):
        @functools.wraps(orig)
        async def wrapper(*a: Any, **kw: Any) -> Any:
            out = await orig(*a, **kw)
            then()
            return out
    else:
        @functools.wraps(orig)
        def wrapper(*a: Any, **kw: Any) -> Any:
            out = orig(*a, **kw)
            then()
            return out
    wrapper._vllm_guard_warm = True  # type: ignore[attr-defined]
    setattr(obj, name, wrapper)


def install_recorder(role: str, version: str) -> Recorder | None:
    """Record this process's later imports when its start is done: EngineCore once its KV cache
    and warm-up are done (`EngineCore._initialize_kv_caches` returned), the API server once
    uvicorn's startup completed (`uvicorn.Server.startup`). None where there is no state dir."""
    path = list_path(role)
    if path is None:
        return None
    rec = Recorder(role, path, version)
    if role == "engine_core":
        from vllm.v1.engine.core import EngineCore

        after(EngineCore, "_initialize_kv_caches", rec.record)
    else:
        import uvicorn.server

        after(uvicorn.server.Server, "startup", rec.record)
    return rec


def read_list(path: Path, version: str) -> tuple[list[str], str]:
    """(modules, note): the recorded list when it is there and for this vLLM version."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return [], "no list yet (no generation of this state dir has started since warm start was on)"
    except OSError as e:
        return [], f"cannot read {path}: {e}"
    try:
        w = decode(WarmImports, json.loads(raw))
    except (ValueError, ProtocolError) as e:
        return [], f"{path.name} unreadable: {e}"
    if w.vllm_version != version:
        return [], f"the list is from vLLM {w.vllm_version}, this is {version}"
    return list(w.modules), ""


@contextlib.contextmanager
def no_cuda_init() -> Iterator[None]:
    """torch's lazy CUDA init raises inside: nothing imported here makes a CUDA context."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    orig = getattr(cuda, "_lazy_init", None)
    if cuda is None or orig is None:
        yield
        return

    def refuse() -> None:
        raise RuntimeError("vllm-guard warm start: no CUDA before the startup gate")

    cuda._lazy_init = refuse
    try:
        yield
    finally:
        cuda._lazy_init = orig


def warm_keys() -> None:
    """The cache keys torch.compile hashes from torch's and Triton's own files (cached per
    process; seconds of file hashing after the gate otherwise). CPU only."""
    for mod, fn in (("triton.compiler.compiler", "triton_key"), ("torch._inductor.codecache", "torch_key")):
        with contextlib.suppress(Exception):
            getattr(importlib.import_module(mod), fn)()


def replay(role: str, version: str, freeze: bool, env: Mapping[str, str] = os.environ) -> WarmReport:
    """Import the recorded list (before the gate), then optionally gc.freeze. Never raises."""
    t0 = time.monotonic()
    path = list_path(role, env)
    if path is None:
        return WarmReport(role=role, note=f"no {contract.STATE_DIR_VAR}")  # type: ignore[arg-type]
    mods, note = read_list(path, version)
    imported, failed = 0, []
    try:
        with no_cuda_init():
            for name in mods:
                if name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                    imported += 1
                except BaseException as e:  # noqa: BLE001 - SystemExit from a module too: it is imported later
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    failed.append(name)
            if role == "engine_core":
                warm_keys()
        frozen = 0
        if freeze:
            gc.collect()
            gc.freeze()
            frozen = gc.get_freeze_count()
    except Exception as e:  # noqa: BLE001 - an optimisation: never break the start
        log.exception("vllm-guard warm start failed")
        return WarmReport(role=role, listed=len(mods), imported=imported, failed=failed,  # type: ignore[arg-type]
                          seconds=round(time.monotonic() - t0, 3), note=f"{type(e).__name__}: {e}")
    rep = WarmReport(role=role, listed=len(mods), imported=imported, failed=failed[:50],  # type: ignore[arg-type]
                     seconds=round(time.monotonic() - t0, 3), gc_frozen=frozen, note=note)
    log.warning("vllm-guard warm start (%s): imported %d of %d listed modules (%d failed) in %.1f s%s%s",
                role, imported, len(mods), len(failed), rep.seconds,
                f", {frozen} objects frozen" if freeze else "", f"; {note}" if note else "")
    return rep
