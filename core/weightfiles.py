"""A model directory's safetensors weights: which files vLLM loads, their size, their layout.

Shared by the runtime (a parked generation that prestages its weights holds their size in host
RAM: `runtime.replica.plan`) and the plugin (`patches.prestage` reads them before the startup
gate and serves tensors from its own copy). Pure Python, no torch: the runtime imports it.

The file set is vLLM's own rule for a local safetensors model (`DefaultModelLoader._prepare_weights`
and `filter_duplicate_safetensors_files` in 0.25.1 and 0.32.0): every `*.safetensors` in the
directory, and when `model.safetensors.index.json` exists only the files its `weight_map` names.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the safetensors library's own limit

# safetensors dtype -> bytes per element (the ones `patches.prestage` can view as torch dtypes)
DTYPE_BYTES: dict[str, int] = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files vLLM loads from `model_dir`, sorted; ValueError for a bad index."""
    d = Path(model_dir)
    files = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    index = d / INDEX
    if not index.is_file():
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        wanted = {str(v) for v in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from e
    return [p for p in files if p.name in wanted]


def weights_bytes(model_dir: str | Path) -> int:
    """Bytes of the files `weight_files` selects (0 when the dir has none or cannot be read)."""
    try:
        return sum(p.stat().st_size for p in weight_files(model_dir))
    except (OSError, ValueError):
        return 0


def header_length(head: bytes | memoryview) -> int:
    """The header's length from a file's first 8 bytes; ValueError when implausible."""
    if len(head) < 8:
        raise ValueError(f"{len(head)} bytes: shorter than the 8-byte header length")
    n = int.from_bytes(bytes(head[:8]), "little")
    if n <= 0 or n > MAX_HEADER:
        raise ValueError(f"header length {n}: not a safetensors file")
    return n


def parse_header(data: bytes | memoryview) -> list[TensorEntry]:
    """Every tensor of the safetensors file in `data` (its whole bytes), sorted by name as
    `safetensors.safe_open(...).keys()` lists them; ValueError names what is wrong."""
    n = header_length(data)
    size = len(data)
    if 8 + n > size:
        raise ValueError(f"header of {n} bytes runs past the file's {size}")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"tensor {name!r}: malformed entry {info!r}") from e
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} not supported")
        if not all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)):
            raise ValueError(f"tensor {name!r}: shape {list(shape)} or offsets {[begin, end]} not sizes")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype] or base + end > size:
            raise ValueError(f"tensor {name!r}: offsets {[begin, end]} do not hold {dtype}{list(shape)} "
                             f"within the file's {size - base} data bytes")
        out.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    return sorted(out, key=lambda e: e.name)
