"""Prestaged weights without a server: the safetensors parser on literal bytes and on files the
`safetensors` package wrote (every tensor equal to `safetensors.torch.load_file`, in
`safe_open().keys()` order, as views of the buffer), vLLM's file selection, staging into host
memory and its failures, and the `prestaged-weights` patch on the installed vLLM's own
`safetensors_weights_iterator` (same names, order and values; buffers freed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_guard.core import weightfiles
from vllm_guard.core.weightfiles import TensorEntry, parse_header, weight_files, weights_bytes
from vllm_guard.patches import defs, prestage, registry

VLLM_ROOT = registry.vllm_root()
needs_vllm = pytest.mark.skipif(VLLM_ROOT is None, reason="vllm not installed")


def literal(header: dict[str, Any], data: bytes, pad: int = 0) -> bytes:
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "z.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.f16": torch.randn(7, generator=g).to(torch.float16),
        "m.f32": torch.randn(2, 3, 4, generator=g),
        "b.f64": torch.randn(3, generator=g, dtype=torch.float64),
        "layers.10.i64": torch.arange(5, dtype=torch.int64) - 2,
        "layers.2.i32": torch.arange(3, dtype=torch.int32) * 7,
        "i16": torch.tensor([-3, 4], dtype=torch.int16),
        "i8": torch.tensor([[-1, 2], [3, -4]], dtype=torch.int8),
        "u8": torch.tensor([1, 255, 0], dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "f8.e4m3": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "f8.e5m2": torch.randn(6, generator=g).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def same(t: torch.Tensor, w: torch.Tensor) -> bool:
    """Bit for bit (NaNs and float8 included), with dtype and shape."""
    return t.dtype == w.dtype and t.shape == w.shape and torch.equal(t.reshape(-1).view(torch.uint8),
                                                                      w.reshape(-1).view(torch.uint8))


def staged(path: Path) -> torch.Tensor:
    data = path.read_bytes()
    buf = torch.empty(len(data), dtype=torch.uint8)
    prestage.read_into(path, buf, len(data))
    return buf


# -- the parser -----------------------------------------------------------------------------------
def test_literal_bytes_parse_to_absolute_offsets_sorted_by_name() -> None:
    data = struct.pack("<2f", 1.5, -2.0) + struct.pack("<3b", 1, -2, 3)
    raw = literal({"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "I8", "shape": [1, 3], "data_offsets": [8, 11]}}, data, pad=3)
    base = len(raw) - len(data)
    assert parse_header(raw) == [TensorEntry("b", "I8", (1, 3), base + 8, base + 11),
                                 TensorEntry("w", "F32", (2,), base, base + 8)]
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    got = dict(prestage.buffer_tensors(buf))
    assert got["w"].tolist() == [1.5, -2.0] and got["b"].tolist() == [[1, -2, 3]]


@pytest.mark.parametrize("raw, needle", [
    (b"\x05\x00", "shorter than the 8-byte header length"),
    (struct.pack("<Q", 0), "header length 0"),
    (struct.pack("<Q", 10**12) + b"{}", "not a safetensors file"),
    (struct.pack("<Q", 40) + b"{}", "runs past the file"),
    (struct.pack("<Q", 4) + b"{x}!", "header is not JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (literal({"t": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\x00"), "dtype 'F4' not supported"),
    (literal({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\x00" * 8), "do not hold F32[2]"),
    (literal({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 4), "do not hold F32[2]"),
    (literal({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\x00" * 8), "not sizes"),
    (literal({"t": {"dtype": "F32", "shape": [2]}}, b"\x00" * 8), "malformed entry"),
])
def test_malformed_bytes_say_what_is_wrong(raw: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        parse_header(raw)
    assert needle in str(e.value)


def test_every_tensor_equals_safetensors_own_reading_as_a_view_of_the_buffer(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(every_dtype(), str(path), metadata={"format": "pt"})
    want = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        order = list(f.keys())
    buf = staged(path)
    got = list(prestage.buffer_tensors(buf))
    assert [n for n, _ in got] == order
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for name, t in got:
        w = want[name]
        assert same(t, w), name
        if t.numel():
            assert lo <= t.data_ptr() < hi, f"{name} is a copy, not a view of the buffer"
    skipped = [n for n, _ in prestage.buffer_tensors(buf, lambda n: n.startswith("layers."))]
    assert skipped == [n for n in order if not n.startswith("layers.")]


# -- which files --------------------------------------------------------------------------------
def test_file_selection_follows_the_index_like_vllm(tmp_path: Path) -> None:
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        save_file({"w": torch.zeros(4)}, str(tmp_path / name))
    assert [p.name for p in weight_files(tmp_path)] == ["consolidated.safetensors", "model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    (tmp_path / weightfiles.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors"}}))
    files = weight_files(tmp_path)
    assert [p.name for p in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weights_bytes(tmp_path) == sum(p.stat().st_size for p in files)
    (tmp_path / weightfiles.INDEX).write_text("{}")
    with pytest.raises(ValueError, match="not a safetensors index"):
        weight_files(tmp_path)
    assert weights_bytes(tmp_path) == 0 and weights_bytes(tmp_path / "nowhere") == 0


# -- staging ------------------------------------------------------------------------------------
def test_stage_reads_every_file_and_says_so(tmp_path: Path) -> None:
    save_file(every_dtype(), str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(3)}, str(tmp_path / "b.safetensors"))
    store = prestage.Store()
    rec = prestage.stage(tmp_path, store)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert rec["error"] == "" and rec["files"] == ["a.safetensors", "b.safetensors"] and rec["bytes"] == size
    assert rec["pinned"] is torch.cuda.is_available() and rec["cuda_context"] is torch.cuda.is_initialized()
    buf = store.take(tmp_path / "." / "a.safetensors")  # however the path is spelled
    assert buf is not None and bytes(buf.numpy()) == (tmp_path / "a.safetensors").read_bytes()
    assert store.release_all("test") == 1 and not store.buffers


def test_a_failed_stage_holds_nothing_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = prestage.Store()
    rec = prestage.stage(tmp_path, store)
    assert rec["error"].startswith("FileNotFoundError: no safetensors files") and not store.buffers
    save_file({"w": torch.ones(3)}, str(tmp_path / "a.safetensors"))
    monkeypatch.setattr(prestage, "RAM_SHARE", 1e-12)  # the host has no room for them
    rec = prestage.stage(tmp_path, store)
    assert rec["error"].startswith("MemoryError: ") and "RAM available" in rec["error"]
    assert rec["files"] == [] and rec["bytes"] == 0 and not store.buffers


# -- the patch on the installed vLLM's iterator ---------------------------------------------------
@needs_vllm
def test_the_patch_targets_exist_in_the_installed_vllm() -> None:
    assert VLLM_ROOT is not None
    for t in defs.PRESTAGED_WEIGHTS.targets:
        assert registry.static_check(VLLM_ROOT, t) is None, t.describe()
        assert registry.live_check(t) is None, t.describe()
    t = registry.Anchor(defs.WU, "", "safetensors_weights_iterator", ("hf_weights_files", "shard_order"))
    assert "lacks parameter(s) shard_order" in str(registry.static_check(VLLM_ROOT, t))
    assert registry.live_check(registry.Anchor(defs.WU, "", "no_such_iterator")) == f"function {defs.WU}.no_such_iterator not found"


@needs_vllm
def test_vllms_iterator_serves_staged_files_from_their_buffers(tmp_path: Path) -> None:
    from vllm.model_executor.model_loader import default_loader, weight_utils
    from vllm.v1.engine import core

    tensors = every_dtype()
    names = sorted(tensors)
    for i, part in enumerate((names[:5], names[5:9], names[9:])):
        save_file({n: tensors[n] for n in part}, str(tmp_path / f"model-{i + 1:05d}-of-00003.safetensors"))
    files = [str(p) for p in sorted(tmp_path.glob("*.safetensors"), reverse=True)]  # vLLM sorts them itself
    original = weight_utils.safetensors_weights_iterator
    want = [(n, t.clone()) for n, t in original(files, False)]
    saved = (original, default_loader.safetensors_weights_iterator, default_loader.DefaultModelLoader.load_weights,
             core.EngineCore._initialize_kv_caches)
    store, published = prestage.Store(), []
    try:
        prestage.PrestagedWeights(store, lambda: published.append(1)).install()
        assert default_loader.safetensors_weights_iterator is weight_utils.safetensors_weights_iterator
        assert prestage.stage(tmp_path, store)["error"] == ""
        store.take(files[1])  # one file was not staged: read from disk in its place
        got = list(default_loader.safetensors_weights_iterator(files, False))
        assert [n for n, _ in got] == [n for n, _ in want]
        for (n, t), (_, w) in zip(got, want):
            assert same(t, w), n
        s = store.summary()
        assert s["files_served"] == 2 and s["files_from_disk"] == 1 and s["held_files"] == 0
        assert s["tensors_served"] == len(want) - len(names[5:9]) and published
        # a load that never reads them (another path) frees them when the engine moves on
        assert prestage.stage(tmp_path, store)["error"] == ""
        with pytest.raises(AttributeError):  # vLLM's own method cannot run on a bare object; the release ran first
            core.EngineCore._initialize_kv_caches(object(), None)  # type: ignore[arg-type]
    finally:
        (weight_utils.safetensors_weights_iterator, default_loader.safetensors_weights_iterator,
         default_loader.DefaultModelLoader.load_weights, core.EngineCore._initialize_kv_caches) = saved
    s = store.summary()
    assert s["held_files"] == 0 and s["released_unused"] == 3, s
    assert "KV cache" in s["released_why"]
