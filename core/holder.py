"""The weight holder's contract: the process that keeps a replica's weights resident across generations.

A replica's holder (`patches.holder`, started by the runtime, imports torch but never vLLM) owns
one copy of the model's weights in device memory (GPU, or shared host memory on vLLM-CPU). A
generation's engine (`patches.held`) asks it for them before it loads anything: on a hit it
builds the model on the meta device and maps the holder's tensors (CUDA IPC, or shared memory)
instead of reading the checkpoint; on a miss it loads from disk as vLLM would, then hands its
freshly loaded tensors to the holder (the holder allocates, the engine copies, the engine then
uses the holder's copy and frees its own), so the next generation maps them.

A generation still dies whole: its activations, graphs and anything it leaked are its own
allocations and go with it. Only the weights, which a recycle never needed to give back, stay;
and, where the runtime asks for it (`KV_VAR`), the KV cache's raw buffers: the same bytes for each
generation that never computes beside another one mapping them (a gated successor, a standby, a
cold start), so a gated successor can capture its CUDA graphs (which bake in the KV cache's
addresses) while the old generation still serves, and park ready (`core.plugin.GATE_AT_VAR`).
The KV cache holds no state a generation needs from its predecessor: its block pool starts empty
and every block is written before it is read. vLLM's dummy runs (profiling, warm-up, capture)
write no KV (their slot mapping is -1, verified in 0.25.1 and 0.32.0), so a parked engine that
maps it leaves the serving one's blocks alone.

Wire: `multiprocessing.connection` on a Unix socket in the replica's state dir, with an authkey.
Control messages are JSON (`HolderRequest` -> `HolderReply`), typed and versioned here, so the
runtime can ask for the state or a drop without torch. Tensors follow a reply as one pickled
message (torch's reductions: CUDA IPC handles, or shared-memory file names), only to an engine.

Dropping the copy means restarting the holder (same socket, same key), and only once no live
engine maps it (the holder knows each engine's pid: RETIRE is refused while one lives): a process exit is the one thing that surely gives its GPU memory back. Drop
rules live here (`drop_reason`): an Xid or a CUDA error, `recycle --strategy cold`; the holder
itself marks its copy stale (never handed out again) when an engine asks for another key (the
model or its loading arguments changed) or a sampled checksum disagrees.
"""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import Field

from .protocol import Source, WeightsReport, _Model, decode

__all__ = ["Source", "WeightsReport"]  # defined with the report they are part of

VERSION = 1
HOLDER_VAR = "VLLM_GUARD_HOLDER"  # the holder's socket (set only for a replica with a holder)
HOLDER_KEY_VAR = "VLLM_GUARD_HOLDER_KEY"  # the socket's authkey, hex
SOCKET = "holder.sock"
LEASE_S = 60.0  # an orphaned holder (its runtime gone) waits this long for an adopter, then exits
CONNECT_TIMEOUT_S = 10.0


class Op(str, enum.Enum):
    GET = "get"  # the held tensors for `key` (a hit), or why not (a miss)
    ALLOC = "alloc"  # empty tensors for `specs` under `key` (a fresh holder only); the engine fills them
    SEAL = "seal"  # the engine filled them: record checksums, serve them from now on
    STAT = "stat"  # the state, nothing else
    RETIRE = "retire"  # the runtime restarts it: refuse everything from now on, unless an engine maps the copy
    ADOPT = "adopt"  # a new runtime (`owner` pid) takes over an orphaned holder (a hand-over)
    KV = "kv"  # the KV cache buffers of `sizes` under `key`: allocated (zeroed) on the first ask, the same bytes after


class TensorSpec(_Model):
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.": bfloat16, float32, ...
    kind: Literal["param", "buffer"]


class HolderRequest(_Model):
    v: int = VERSION
    op: Op
    key: str = ""
    reason: str = ""
    generation: int | None = None
    pid: int | None = None  # GET/ALLOC: the engine process that maps the tensors (kept while it lives)
    owner: int | None = None  # ADOPT: the pid the holder follows from now on
    specs: tuple[TensorSpec, ...] = ()
    append: bool = False  # ALLOC: more tensors for the copy being filled (an engine hands it over in chunks)
    aliases: dict[str, str] = Field(default_factory=dict)  # tied names -> the canonical name (ALLOC)
    sizes: tuple[int, ...] = ()  # KV: the byte size of each raw KV cache buffer the engine allocates


class HolderState(_Model):
    v: int = VERSION
    pid: int
    device: str  # "cuda:0" / "cpu"
    # stale: never handed out again (another key was asked for, a checksum disagreed, a fill broke
    # off); the runtime restarts the holder once no generation maps it (only an exit frees memory
    # that engines mapped: torch keeps a shared block until each consumer let go, and a killed one never does)
    # retiring: the runtime is restarting it (nothing is handed out; engines wait for the new one)
    state: Literal["empty", "filling", "held", "stale", "retiring"]
    key: str = ""
    tensors: int = 0
    bytes: int = 0
    sealed_at: str | None = None
    handed: int = 0  # generations that mapped this copy
    filled_by: int | None = None  # the generation that loaded it from disk
    stale: str = ""  # why it is stale
    mappers: list[int] = Field(default_factory=list)  # live engine pids that map its tensors
    kv_key: str = ""  # the held KV cache's key ('' : none held)
    kv_bytes: int = 0
    kv_mappers: list[int] = Field(default_factory=list)  # live engine pids that map the held KV cache


class HolderReply(_Model):
    v: int = VERSION
    ok: bool
    miss: str = ""  # GET: why there is nothing to map (the engine loads from disk)
    error: str = ""
    state: HolderState
    tensors_follow: bool = False  # a pickled {name: tensor} message comes next on the connection


def read(model: type[Any], raw: bytes) -> Any:
    """A message of `model` from the wire (ProtocolError when it is not one)."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        from .errors import ProtocolError

        raise ProtocolError(f"{model.__name__}: not JSON: {e}") from e
    return decode(model, data)


def write(msg: _Model) -> bytes:
    return msg.model_dump_json().encode()


def socket_path(replica_dir: str | Path) -> Path:
    return Path(replica_dir) / SOCKET


def weights_key(fields: Mapping[str, Any]) -> str:
    """One key for everything that decides the loaded tensors: a different key is a different copy."""
    text = json.dumps(dict(fields), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def files_fingerprint(model_dir: str | Path, patterns: Sequence[str] = ("*.safetensors", "*.bin", "*.pt")) -> list[Any]:
    """Names, sizes and mtimes of the checkpoint files: a rewritten checkpoint is another key."""
    d = Path(model_dir)
    if not d.is_dir():
        return []
    out: list[Any] = []
    for pattern in patterns:
        for p in sorted(d.glob(pattern)):
            st = p.stat()
            out.append([p.name, st.st_size, int(st.st_mtime)])
    return out


XID_REASONS = ("xid", "gpu-reset", "gpu_reset", "gpu-lost")
CUDA_MARKS = ("CUDA error", "cudaError", "CUBLAS_STATUS", "illegal memory access", "device-side assert",
              "uncorrectable ECC", "Xid")


def drop_reason(*, command: str = "", reason: str = "", strategy: str | None = None,
                death_cause: str = "") -> str | None:
    """Whether what just happened must drop the held copy, and why (None: keep it).

    - `recycle --strategy cold`: the operator asked for a start from disk;
    - a restart or hold the watchdog ordered for an Xid (the GPU's memory is not to be trusted);
    - a generation that died of a CUDA error (its log's cause).
    A changed model or loading arguments need no rule here: the key differs and the holder frees
    the old copy when the next engine asks; a checksum is the holder's own check."""
    if command == "recycle" and strategy == "cold":
        return "recycle --strategy cold"
    low = reason.lower()
    if command in ("restart", "hold") and any(m in low for m in XID_REASONS):
        return f"{command} for {reason}"
    if death_cause and any(m.lower() in death_cause.lower() for m in CUDA_MARKS):
        return f"the generation died of a CUDA error: {death_cause[:160]}"
    return None
