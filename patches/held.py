"""Held weights, in a generation's engine: map the replica holder's copy instead of reading the checkpoint.

With VLLM_GUARD_HOLDER set (the runtime started a holder for this replica: `core.holder`), vLLM's
default loader asks the holder first:
- a hit: the model is built on the meta device and every parameter and buffer is the holder's
  tensor (CUDA IPC, or shared memory on the host); then vLLM's own post-load processing runs as
  after any load (a no-op for unquantized weights on a GPU; vLLM-CPU repacks into its own memory);
- a miss (nothing held, another model or loading arguments, a checksum that disagreed): vLLM
  loads from disk as always; right after its `load_weights`, before post-processing, the engine
  hands the holder its tensors a chunk at a time (the holder allocates, the engine copies, then
  uses the holder's copy and frees its own: the peak is one chunk above a plain load), and seals.

Only where the tensors after `load_weights` are all there is to a model: unquantized weights
(`quantization` None), the default loader with `auto`/`safetensors`/`pt`, one process per engine.
Anything else, or any error, is a plain load from disk; the reason goes to the report
(`WeightsReport`), the status and the ledger. vLLM 0.32 ships its own weight cache (#54921,
`--load-format ipc_cache`, CUDA only); this patch stands in on versions without it and on the host.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from multiprocessing.connection import Client, Connection
from typing import Any, Callable

from vllm_guard.core import holder as contract
from vllm_guard.core import plugin as plugin_contract

log = logging.getLogger("vllm.vllm_guard.held")

CHUNK_BYTES = 1 << 30  # handed to the holder a chunk at a time: the peak above a plain load
LOAD_FORMATS = ("auto", "safetensors", "pt")
START_WAIT_S = 60.0  # for a holder that is still starting (its socket not there yet)


def _generation() -> int | None:
    try:
        return int(os.environ.get(plugin_contract.GENERATION_VAR, ""))
    except ValueError:
        return None


def requested(env: Any = os.environ) -> tuple[str, bytes] | None:
    path = env.get(contract.HOLDER_VAR, "").strip()
    key = env.get(contract.HOLDER_KEY_VAR, "").strip()
    if not path or not key:
        return None
    try:
        return path, bytes.fromhex(key)
    except ValueError:
        return None


class HolderClient:
    """One connection to the holder (a GET, then the ALLOC/SEAL of a load from disk)."""

    def __init__(self, path: str, authkey: bytes, wait_s: float = START_WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)  # the runtime starts the holder with the replica's first generation
        self.conn: Connection = Client(path, family="AF_UNIX", authkey=authkey)

    def ask(self, req: contract.HolderRequest) -> tuple[contract.HolderReply, Any]:
        self.conn.send_bytes(contract.write(req))
        reply = contract.read(contract.HolderReply, self.conn.recv_bytes())
        payload = self.conn.recv() if reply.tensors_follow else None
        return reply, payload

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def eligible(loader: Any, model_config: Any, vllm_config: Any = None) -> str:
    """'' when this load may use the holder, else why not."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and (pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1):
        return "tensor or pipeline parallel (one holder per replica keeps one GPU's tensors)"
    if getattr(model_config, "quantization", None):
        return f"quantized weights ({model_config.quantization}) are processed after loading"
    fmt = str(getattr(loader.load_config, "load_format", "auto"))
    if fmt not in LOAD_FORMATS:
        return f"--load-format {fmt}"
    if getattr(loader.load_config, "device", None) not in (None, "cuda", "cpu"):
        return f"load device {loader.load_config.device}"
    return ""


def key_for(vllm_config: Any, model_config: Any, loader: Any) -> str:
    """Everything that decides the tensors `load_weights` leaves (`core.holder.weights_key`)."""
    import torch
    import vllm

    from vllm_guard.patches.registry import version_tuple

    pc = vllm_config.parallel_config
    model = str(model_config.model)
    fields = {
        "model": os.path.realpath(model) if os.path.isdir(model) else model,
        "revision": getattr(model_config, "revision", None),
        "dtype": str(model_config.dtype), "quantization": model_config.quantization,
        "hf_overrides": getattr(model_config, "hf_overrides", None),
        "load_format": str(loader.load_config.load_format),
        "extra": getattr(loader.load_config, "model_loader_extra_config", None),
        "tp": [pc.tensor_parallel_size, getattr(pc, "rank", 0)], "pp": pc.pipeline_parallel_size,
        "files": contract.files_fingerprint(model) if os.path.isdir(model) else [],
        "vllm": ".".join(map(str, version_tuple(vllm.__version__))), "torch": torch.__version__,
        "format": contract.VERSION,
    }
    return contract.weights_key(fields)


def _named(model: Any) -> list[tuple[str, Any, str]]:
    """Every parameter and buffer by every name it has (tied weights appear under each)."""
    out = [(n, t, "param") for n, t in model.named_parameters(remove_duplicate=False)]
    out += [(n, t, "buffer") for n, t in model.named_buffers(remove_duplicate=False)]
    return out


def _set(modules: dict[str, Any], name: str, tensor: Any, kind: str, like: Any = None) -> Any:
    """Put `tensor` in the model under `name` (as a Parameter for a parameter, keeping the old
    one's attributes: vLLM hangs its weight loaders and shard info on them)."""
    import torch

    mod_name, _, leaf = name.rpartition(".")
    module = modules[mod_name]
    if kind == "param":
        obj = torch.nn.Parameter(tensor, requires_grad=False)
        if like is not None:
            for k, v in vars(like).items():
                if not k.startswith("_"):
                    setattr(obj, k, v)
        module._parameters[leaf] = obj
        return obj
    module._buffers[leaf] = tensor
    return tensor


def give(client: HolderClient, model: Any, key: str, generation: int | None) -> tuple[int, int]:
    """Hand the freshly loaded tensors to the holder and use its copy from now on; (tensors, bytes).

    A chunk at a time, holding no reference to a tensor once the holder's copy replaced it: the
    engine's own copy is freed chunk by chunk, so the peak is one chunk above the weights."""
    import torch

    modules = dict(model.named_modules(remove_duplicate=False))
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    todo: list[contract.TensorSpec] = []
    sizes: list[int] = []
    t = None
    for name, t, kind in _named(model):
        ident = id(t)
        if ident in canonical:
            aliases[name] = canonical[ident]
            continue
        canonical[ident] = name
        if t.device.type == "meta" or not t.is_contiguous():
            raise RuntimeError(f"{name} is {'on meta' if t.device.type == 'meta' else 'not contiguous'}")
        todo.append(contract.TensorSpec(name=name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                        kind=kind))  # type: ignore[arg-type]
        sizes.append(t.numel() * t.element_size())
    del t
    placed: dict[str, Any] = {}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def own(name: str) -> Any:
        mod_name, _, leaf = name.rpartition(".")
        m = modules[mod_name]
        return m._parameters[leaf] if leaf in m._parameters else m._buffers[leaf]

    def flush(chunk: list[contract.TensorSpec], first: bool) -> None:
        reply, payload = client.ask(contract.HolderRequest(op=contract.Op.ALLOC, key=key, generation=generation,
                                                           specs=tuple(chunk), append=not first, pid=os.getpid()))
        if not reply.ok or payload is None:
            raise RuntimeError(f"the holder could not allocate: {reply.error}")
        held = payload["tensors"]
        for spec in chunk:
            mine = own(spec.name)
            held[spec.name].copy_(mine)
            placed[spec.name] = _set(modules, spec.name, held[spec.name], spec.kind, like=mine)
            del mine
        held.clear()
        if cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()

    chunk: list[contract.TensorSpec] = []
    first, size = True, 0
    for spec, nbytes in zip(todo, sizes):
        chunk.append(spec)
        size += nbytes
        if size >= CHUNK_BYTES:
            flush(chunk, first)
            chunk, first, size = [], False, 0
    if chunk or first:
        flush(chunk, first)
    for alias, name in aliases.items():
        mod_name, _, leaf = alias.rpartition(".")
        store = modules[mod_name]._parameters if isinstance(placed[name], torch.nn.Parameter) else modules[mod_name]._buffers
        store[leaf] = placed[name]
    reply, _ = client.ask(contract.HolderRequest(op=contract.Op.SEAL, key=key, aliases=aliases))
    if not reply.ok:
        raise RuntimeError(f"the holder did not seal: {reply.error}")
    return len(todo), sum(sizes)


def build(vllm_config: Any, model_config: Any, prefix: str, target: Any, payload: dict[str, Any]) -> Any:
    """The model on the meta device, every tensor the holder's; then vLLM's post-load processing."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    tensors, aliases, kinds = payload["tensors"], payload["aliases"], payload["kinds"]
    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        modules = dict(model.named_modules(remove_duplicate=False))
        before = {n: t for n, t, _ in _named(model)}
        placed = {}
        for name, t in tensors.items():
            if name.rpartition(".")[0] not in modules:
                raise RuntimeError(f"held tensor {name} has no module in this model")
            like = before.get(name)
            if like is not None and tuple(like.shape) != tuple(t.shape):
                raise RuntimeError(f"held tensor {name} is {tuple(t.shape)}, the model wants {tuple(like.shape)}")
            placed[name] = _set(modules, name, t, kinds[name], like=like)
        for alias, name in aliases.items():
            mod_name, _, leaf = alias.rpartition(".")
            store = modules[mod_name]._parameters if kinds[name] == "param" else modules[mod_name]._buffers
            store[leaf] = placed[name]
        left = [n for n, t, _ in _named(model) if t.device.type == "meta"]
        if left:
            raise RuntimeError(f"{len(left)} tensors not held, e.g. {left[0]}")
        process_weights_after_loading(model, model_config, target)
    return model.eval()


class HeldWeights:
    """The patch: wraps DefaultModelLoader.load_model and .load_weights (`install`)."""

    def __init__(self, path: str, authkey: bytes, on_report: Callable[[contract.WeightsReport], None]) -> None:
        self.path, self.authkey, self.on_report = path, authkey, on_report
        self.local = threading.local()
        self.report: contract.WeightsReport | None = None

    def summary(self) -> dict[str, Any]:
        return self.report.model_dump(mode="json") if self.report is not None else {"source": None}

    def install(self) -> None:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        load_model, load_weights = DefaultModelLoader.load_model, DefaultModelLoader.load_weights
        patch = self

        def guarded_load_model(loader: Any, vllm_config: Any, model_config: Any, prefix: str = "", **kw: Any) -> Any:
            return patch.load_model(load_model, loader, vllm_config, model_config, prefix, **kw)

        def guarded_load_weights(loader: Any, model: Any, model_config: Any, *a: Any, **kw: Any) -> Any:
            out = load_weights(loader, model, model_config, *a, **kw)
            patch.after_load_weights(model)
            return out

        DefaultModelLoader.load_model = guarded_load_model  # type: ignore[method-assign]
        DefaultModelLoader.load_weights = guarded_load_weights  # type: ignore[method-assign]

    def _say(self, r: contract.WeightsReport) -> None:
        self.report = r
        log.warning("vllm-guard held weights: %s", r.model_dump_json())
        self.on_report(r)

    def _ask_get(self, key: str, generation: int | None) -> tuple[HolderClient, Any, Any]:
        """GET from the holder; while the runtime restarts it (a drop), from the fresh one."""
        req = contract.HolderRequest(op=contract.Op.GET, key=key, generation=generation, pid=os.getpid())
        deadline = time.monotonic() + START_WAIT_S
        while True:
            client = HolderClient(self.path, self.authkey)
            try:
                reply, payload = client.ask(req)
            except BaseException:
                client.close()
                raise
            if reply.state.state != "retiring" or time.monotonic() > deadline:
                return client, reply, payload
            client.close()
            while os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.1)  # the old one goes, then the new one's socket appears

    def load_model(self, orig: Callable[..., Any], loader: Any, vllm_config: Any, model_config: Any, prefix: str,
                   **kw: Any) -> Any:
        import torch

        t0 = time.monotonic()
        why = eligible(loader, model_config, vllm_config)
        if why:
            self._say(contract.WeightsReport(source=contract.Source.DISK, reason=f"not held: {why}"))
            return orig(loader, vllm_config, model_config, prefix, **kw)
        generation = _generation()
        try:
            key = key_for(vllm_config, model_config, loader)
            client, reply, payload = self._ask_get(key, generation)
        except Exception as e:  # noqa: BLE001 - no holder: a plain load
            self._say(contract.WeightsReport(source=contract.Source.DISK, reason=f"no holder: {type(e).__name__}: {e}"))
            return orig(loader, vllm_config, model_config, prefix, **kw)
        try:
            miss = reply.miss or ("" if payload is not None else reply.error or "no tensors came")
            if not miss:
                device = vllm_config.device_config.device if loader.load_config.device is None else loader.load_config.device
                try:
                    model = build(vllm_config, model_config, prefix, torch.device(device), payload)
                except Exception as e:  # noqa: BLE001 - map failed: load from disk, report why
                    log.exception("vllm-guard held weights: mapping failed; loading from disk")
                    miss = f"mapping failed: {type(e).__name__}: {e}"
                    payload = None
                    gc.collect()
                else:
                    self._say(contract.WeightsReport(source=contract.Source.HELD, tensors=reply.state.tensors,
                                                     bytes=reply.state.bytes, seconds=round(time.monotonic() - t0, 3)))
                    return model
            # only a fresh holder takes a copy (a stale one is restarted by the runtime first)
            self.local.give = (client, key, generation) if reply.state.state == "empty" else None
            self.local.given = None
            try:
                model = orig(loader, vllm_config, model_config, prefix, **kw)
            finally:
                self.local.give = None
            given = self.local.given or (0, 0, "")
            self._say(contract.WeightsReport(source=contract.Source.DISK, reason=miss, tensors=given[0],
                                             bytes=given[1], seconds=round(time.monotonic() - t0, 3),
                                             given=not given[2] and given[0] > 0, give_error=given[2]))
            return model
        finally:
            client.close()

    def after_load_weights(self, model: Any) -> None:
        """Right after a load from disk (before post-processing): the holder's copy becomes ours."""
        pending = getattr(self.local, "give", None)
        if pending is None:
            return
        client, key, generation = pending
        self.local.give = None
        try:
            n, nbytes = give(client, model, key, generation)
            self.local.given = (n, nbytes, "")
        except Exception as e:  # noqa: BLE001 - the model keeps whatever it has: every tensor is valid
            log.exception("vllm-guard held weights: the holder could not take the weights")
            self.local.given = (0, 0, f"{type(e).__name__}: {e}")  # the holder marks its part stale
