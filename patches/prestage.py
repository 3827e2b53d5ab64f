"""Prestaged weights: a parked EngineCore reads its model's safetensors before the startup gate.

After a gated generation's gate opens, vLLM creates the CUDA context and copies the weights from
mmap'd page-cache pages to the GPU. With `[server] prestage_weights = "on"` the runtime gives a
gated generation VLLM_GUARD_PRESTAGE (the model dir); its EngineCore, before it parks, reads every
safetensors file vLLM will load into one host buffer per file, page-locked where CUDA is available
(the pinning creates this process's CUDA context before the gate, on purpose: ~0.5 GiB of GPU
memory beside the serving generation). After the gate, the `prestaged-weights` patch makes vLLM's
`safetensors_weights_iterator` yield zero-copy views of those buffers, in its own order and under
its own names, and frees each file's buffer once its tensors are handed out.

Never at the engine's expense: a failure while staging drops what was staged and the engine parks
as before; a load that does not come through the iterator (another loader or format, workers in
processes of their own) leaves the buffers unused, and they are freed when weight loading ends or,
at the latest, when the engine goes on to its KV cache.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from vllm_guard.core import plugin as contract
from vllm_guard.core.host import host_memory
from vllm_guard.core.weightfiles import DTYPE_BYTES, TensorEntry, parse_header, weight_files

log = logging.getLogger("vllm.vllm_guard.prestage")

# safetensors dtype -> torch dtype attribute (core.weightfiles.DTYPE_BYTES has the sizes)
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
RAM_SHARE = 0.9  # stage only when the files fit in this share of MemAvailable
# safetensors_load_strategy values whose result is the same tensors from the same files: served
# from the buffers ("prefetch" only warms the page cache first). Others go to vLLM's own code.
COVERED_STRATEGIES = (None, "lazy", "prefetch")


def requested(env: Mapping[str, str] = os.environ) -> Path | None:
    text = env.get(contract.PRESTAGE_VAR, "").strip()
    return Path(text) if text else None


def key(path: str | Path) -> str:
    """One name per file, however vLLM spells the model dir (relative, a symlink)."""
    return os.path.realpath(path)


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a CPU build: no CUDA
        return False


class Store:
    """This process's staged files (one uint8 tensor each) and what became of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffers: dict[str, Any] = {}
        self.staged: dict[str, Any] = {}  # the `PrestageReport` of the staging, as JSON
        self.pinned = False
        self.tensors_served = 0
        self.files_served = 0
        self.files_from_disk = 0
        self.released_unused = 0
        self.released_why = ""

    def put(self, path: str | Path, buf: Any) -> None:
        with self.lock:
            self.buffers[key(path)] = buf

    def has(self, path: str | Path) -> bool:
        with self.lock:
            return key(path) in self.buffers

    def take(self, path: str | Path) -> Any | None:
        """The buffer of `path`, now owned by the caller (None when not staged)."""
        with self.lock:
            return self.buffers.pop(key(path), None)

    def drop(self) -> None:
        """Forget a staging that failed (nothing of it was used)."""
        with self.lock:
            bufs = list(self.buffers.values())
            self.buffers.clear()
        for buf in bufs:
            unpin(buf, self.pinned)

    def release_all(self, why: str) -> int:
        """Drop every buffer still held (unused); returns how many."""
        with self.lock:
            bufs = list(self.buffers.values())
            self.buffers.clear()
            if bufs:
                self.released_unused += len(bufs)
                self.released_why = why
        for buf in bufs:
            unpin(buf, self.pinned)
        if bufs:
            log.warning("vllm-guard prestaged weights: %d file buffer(s) released unused (%s)", len(bufs), why)
        return len(bufs)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {"staged": self.staged, "held_files": len(self.buffers), "tensors_served": self.tensors_served,
                    "files_served": self.files_served, "files_from_disk": self.files_from_disk,
                    "released_unused": self.released_unused, "released_why": self.released_why}


STORE = Store()


def pin(buf: Any) -> str:
    """Page-lock `buf` where it lies (cudaHostRegister), so the copy to the GPU after the gate is
    DMA at bus speed. Not `pin_memory=True`: torch's pinned allocator rounds every block up to a
    power of two (a 1.35 GB shard would lock 2 GiB). Returns "" or why it could not."""
    import torch

    cudart = torch.cuda.cudart()  # initialises CUDA here: this process's context, before the gate
    rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    return "" if rc == cudart.cudaError.success else f"cudaHostRegister: {rc}"


def unpin(buf: Any, pinned: bool) -> None:
    """Unlock a buffer before it is freed (memory freed while registered would stay locked)."""
    if not pinned:
        return
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except Exception:  # noqa: BLE001 - never break loading over an unlock
        log.exception("vllm-guard prestaged weights: cudaHostUnregister failed")


def read_into(path: Path, buf: Any, size: int) -> None:
    """Fill the uint8 tensor `buf` with the file's `size` bytes, straight into its memory."""
    view = memoryview(buf.numpy())
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path.name}: short read, {got} of {size} bytes")
            got += n


def stage(model_dir: Path, store: Store = STORE) -> dict[str, Any]:
    """Read the model's safetensors into `store`; returns a `PrestageReport` as JSON. Never
    raises: on any failure what was staged is dropped and `error` says why."""
    import torch

    start = time.monotonic()
    rec: dict[str, Any] = {"model_dir": str(model_dir), "files": [], "bytes": 0, "seconds": 0.0,
                           "pinned": False, "cuda_context": False, "error": ""}
    try:
        files = weight_files(model_dir)
        if not files:
            raise FileNotFoundError(f"no safetensors files in {model_dir}")
        sizes = [f.stat().st_size for f in files]
        avail = host_memory()["mem_available_mb"] * 2**20
        if sum(sizes) > RAM_SHARE * avail:
            raise MemoryError(f"{sum(sizes) / 2**30:.1f} GiB of weights, {avail / 2**30:.1f} GiB RAM available")
        store.pinned = want_pin = bool(torch.cuda.is_available())
        for f, size in zip(files, sizes):
            buf = torch.empty(size, dtype=torch.uint8)
            read_into(f, buf, size)
            if store.pinned and (why := pin(buf)):  # staged all the same, unlocked (a slower copy)
                log.warning("vllm-guard prestaged weights: %s not page-locked (%s); staging unlocked", f.name, why)
                with store.lock:
                    locked = list(store.buffers.values())
                for b in locked:
                    unpin(b, True)
                store.pinned = False
            store.put(f, buf)
        rec.update(files=[f.name for f in files], bytes=sum(sizes), pinned=store.pinned and want_pin)
    except Exception as e:  # noqa: BLE001 - an optimisation: the engine parks and loads from disk
        log.exception("vllm-guard prestaged weights: staging %s failed; loading from disk as before", model_dir)
        store.drop()
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["seconds"] = round(time.monotonic() - start, 3)
    rec["cuda_context"] = cuda_initialized()
    store.staged = rec
    if not rec["error"]:
        log.warning("vllm-guard prestaged weights: %d file(s), %.2f GiB in %.1f s (%s)", len(rec["files"]),
                    rec["bytes"] / 2**30, rec["seconds"], "pinned" if rec["pinned"] else "not pinned")
    return rec


def tensor_view(buf: Any, e: TensorEntry) -> Any:
    """The tensor `e` as a view of the file's buffer (a copy only when its bytes are misaligned
    for its dtype, which safetensors' own writer never does)."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[e.dtype])
    if e.begin == e.end:
        return torch.empty(e.shape, dtype=dtype)
    raw = buf[e.begin:e.end]
    if e.begin % DTYPE_BYTES[e.dtype]:
        raw = raw.clone()
    return raw.view(dtype).reshape(e.shape)


def buffer_tensors(buf: Any, skip: Callable[[str], bool] = lambda _: False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of one staged file, in `safe_open(...).keys()` order;
    ValueError (before yielding anything) when the buffer is not a safetensors file."""
    entries = parse_header(memoryview(buf.numpy()))
    return ((e.name, tensor_view(buf, e)) for e in entries if not skip(e.name))


class PrestagedWeights:
    """The patch: vLLM's safetensors iterator serves staged files from their buffers."""

    def __init__(self, store: Store, publish: Callable[[], None]) -> None:
        self.store = store
        self.publish = publish

    def summary(self) -> dict[str, Any]:
        return self.store.summary()

    def finish(self, why: str) -> None:
        if self.store.release_all(why):
            self.publish()

    def install(self) -> None:
        from vllm.model_executor.model_loader import default_loader, weight_utils
        from vllm.v1.engine import core

        original = weight_utils.safetensors_weights_iterator
        iterate = self._iterator(original, weight_utils)
        weight_utils.safetensors_weights_iterator = iterate
        default_loader.safetensors_weights_iterator = iterate  # imported there by name

        loader = default_loader.DefaultModelLoader
        load_weights = loader.load_weights

        @functools.wraps(load_weights)
        def load_then_release(loader_self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return load_weights(loader_self, *args, **kwargs)
            finally:
                self.finish("weight loading finished without reading them")

        loader.load_weights = load_then_release  # type: ignore[method-assign]
        kv_init = core.EngineCore._initialize_kv_caches

        @functools.wraps(kv_init)
        def release_then_kv(engine: Any, *args: Any, **kwargs: Any) -> Any:
            self.finish("the engine went on to its KV cache without reading them")
            return kv_init(engine, *args, **kwargs)

        core.EngineCore._initialize_kv_caches = release_then_kv  # type: ignore[method-assign]

    def _iterator(self, original: Callable[..., Iterator[tuple[str, Any]]], wu: Any) -> Callable[..., Any]:
        store = self.store

        @functools.wraps(original)
        def safetensors_weights_iterator(hf_weights_files: list[str], use_tqdm_on_load: bool,
                                         safetensors_load_strategy: str | None = None,
                                         local_expert_ids: set[int] | None = None,
                                         **kwargs: Any) -> Iterator[tuple[str, Any]]:
            def disk(files: Iterable[str]) -> Iterator[tuple[str, Any]]:
                return original(list(files), use_tqdm_on_load, safetensors_load_strategy, local_expert_ids,
                                **kwargs)

            if not any(store.has(f) for f in hf_weights_files):
                yield from disk(hf_weights_files)
                return
            if safetensors_load_strategy not in COVERED_STRATEGIES:
                self.finish(f"safetensors_load_strategy {safetensors_load_strategy!r} reads the files itself")
                yield from disk(hf_weights_files)
                return
            skip = functools.partial(_skip, wu.should_skip_weight, local_expert_ids)
            for f in sorted(hf_weights_files, key=wu._natural_sort_key):
                buf = store.take(f)
                if buf is None:
                    store.files_from_disk += 1
                    yield from disk([f])
                    continue
                try:
                    tensors = buffer_tensors(buf, skip)
                except ValueError as e:
                    log.warning("vllm-guard prestaged weights: %s unreadable from its buffer (%s); from disk", f, e)
                    del buf
                    store.files_from_disk += 1
                    yield from disk([f])
                    continue
                try:
                    for name, tensor in tensors:
                        store.tensors_served += 1
                        yield name, tensor
                    store.files_served += 1
                finally:
                    unpin(buf, store.pinned)
                    del buf, tensors  # the caller's views keep what they still use
            self.publish()

        return safetensors_weights_iterator


def _skip(should_skip: Callable[[str, set[int] | None], bool], ids: set[int] | None, name: str) -> bool:
    return bool(should_skip(name, ids))
