"""The weight holder: one process per replica that keeps the model's weights resident across generations.

`python -m vllm_guard.patches.holder --socket PATH --device cuda|cpu` (the runtime starts it; the
authkey comes in VLLM_GUARD_HOLDER_KEY). It imports torch, never vLLM: it owns memory and knows
nothing of models. An engine that loaded from disk asks it to allocate (ALLOC), copies its
weights in and SEALs; later engines GET the same tensors, mapped (CUDA IPC on a GPU; shared
memory files on the host). The contract and the drop rules: `core.holder`.

Before it hands a copy out it recomputes a sampled checksum of every tensor (an exact integer
sum of a strided sample of its bytes) and compares it with the one taken at SEAL: an engine that
wrote into the weights it mapped is caught here: the copy turns stale, and the next engine loads
from disk.

It also keeps a replica's KV cache buffers when an engine asks (KV): allocated once, the same
bytes for every later engine with the same key (`core.holder` says when the runtime lets an
engine share them).

It follows its runtime: when the parent is gone it waits `LEASE_S` for a new runtime to ADOPT it
(a hand-over), else exits. It never frees a copy: a stale one goes with the process, which the
runtime restarts once no generation maps it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from vllm_guard.core import holder as contract
from vllm_guard.core.errors import ProtocolError
from vllm_guard.core.timefmt import utcnow

log = logging.getLogger("vllm_guard.holder")

SAMPLE = 4096  # bytes summed per tensor for its checksum (strided over the whole tensor)


def checksum(torch: Any, tensors: dict[str, Any]) -> list[int]:
    """Per tensor: the exact sum of a strided sample of its bytes (deterministic on any device)."""
    out = []
    for t in tensors.values():
        flat = t.detach().reshape(-1).view(torch.uint8)
        step = max(1, flat.numel() // SAMPLE)
        out.append(flat[::step].to(torch.int64).sum())
    return [int(v) for v in torch.stack(out).tolist()] if out else []


class Holder:
    """The held copy and its bookkeeping; one lock, since connections are served on threads.

    It never frees a copy it handed out: memory an engine mapped stays allocated until that engine
    let go (torch's IPC bookkeeping), and a killed engine never does. A copy that must not be
    handed out again is marked stale; the runtime restarts this process once nothing maps it."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch, self.device = torch, device
        self.lock = threading.Lock()
        self.tensors: dict[str, Any] = {}
        self.aliases: dict[str, str] = {}
        self.kinds: dict[str, str] = {}
        self.sums: list[int] = []
        self.state = "empty"
        self.key = ""
        self.sealed_at: str | None = None
        self.handed = 0
        self.filled_by: int | None = None
        self.stale = ""
        self.mappers: dict[int, int | None] = {}  # engine pid -> its generation
        self.kv_key = ""
        self.kv_buffers: list[Any] = []  # the raw KV cache buffers (int8), kept for the holder's life
        self.kv_mappers: dict[int, int | None] = {}

    def live_mappers(self) -> list[int]:
        self.mappers = {p: g for p, g in self.mappers.items() if _alive(p)}
        return sorted(self.mappers)

    def live_kv_mappers(self) -> list[int]:
        self.kv_mappers = {p: g for p, g in self.kv_mappers.items() if _alive(p)}
        return sorted(self.kv_mappers)

    def snapshot(self) -> contract.HolderState:
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return contract.HolderState(pid=os.getpid(), device=self.device, state=self.state, key=self.key,  # type: ignore[arg-type]
                                    tensors=len(self.tensors), bytes=nbytes, sealed_at=self.sealed_at,
                                    handed=self.handed, filled_by=self.filled_by, stale=self.stale,
                                    mappers=self.live_mappers(), kv_key=self.kv_key,
                                    kv_bytes=sum(int(b.numel()) for b in self.kv_buffers),
                                    kv_mappers=self.live_kv_mappers())

    def kv(self, req: contract.HolderRequest) -> list[Any]:
        """The KV cache buffers for `req.key`: the held ones, or (none held yet) new zeroed ones.

        Another key while one is held is refused: the held buffers cannot be given back while
        a killed engine's mapping pins them (see the class), so a second set would double the
        memory; the engine allocates its own, and the holder's restart (a model or argument
        change drops the weights too) frees both."""
        if self.state == "retiring":
            raise RuntimeError("the holder is restarting")
        if self.kv_buffers and req.key != self.kv_key:
            raise RuntimeError("another KV cache is held (the cache's shape changed): the engine keeps its own")
        if not self.kv_buffers:
            if not req.sizes or any(n <= 0 for n in req.sizes):
                raise RuntimeError(f"bad KV cache sizes {list(req.sizes)}")
            torch = self.torch
            bufs = []
            for n in req.sizes:
                b = torch.zeros(n, dtype=torch.int8, device=self.device)
                if self.device == "cpu":
                    b.share_memory_()
                bufs.append(b)
            self.kv_buffers, self.kv_key = bufs, req.key
            log.warning("holder allocated the KV cache: %d buffers, %.2f GiB (%s)", len(bufs),
                        sum(req.sizes) / 2**30, req.key)
        elif [int(b.numel()) for b in self.kv_buffers] != list(req.sizes):
            raise RuntimeError("the KV cache sizes differ from the held ones under the same key")
        if req.pid is not None:
            self.kv_mappers[req.pid] = req.generation
        return self.kv_buffers

    def retire(self) -> str:
        """'' and nothing handed out from now on, or why not yet (engines map the copy)."""
        live = sorted(set(self.live_mappers()) | set(self.live_kv_mappers()))
        if live:
            return f"engines map the copy: pids {live}"
        self.state = "retiring"
        return ""

    def spoil(self, reason: str) -> None:
        if self.state == "retiring":
            return
        if self.state != "stale":
            log.warning("holder: copy %s is stale: %s", self.key, reason)
        self.state, self.stale = "stale", reason

    def get(self, key: str) -> str:
        """'' when the held copy may be handed out for `key`, else why not."""
        if self.state == "empty":
            return "nothing held yet"
        if self.state == "retiring":
            return "the holder is restarting"
        if self.state == "filling":
            self.spoil("an engine asked while another was still filling it")
        elif self.state == "held" and key != self.key:
            self.spoil("another key was asked for: the model or its loading arguments changed")
        elif self.state == "held" and checksum(self.torch, self.tensors) != self.sums:
            self.spoil("a sampled checksum disagrees: an engine wrote into the held weights")
        return f"the held copy is stale ({self.stale})" if self.state == "stale" else ""

    def alloc(self, req: contract.HolderRequest) -> dict[str, Any]:
        """Empty tensors for `req.specs`: a new copy (a fresh holder only), or (append) more of it."""
        if req.append and (self.state != "filling" or req.key != self.key):
            raise RuntimeError(f"nothing being filled for this key to append to (state {self.state})")
        if self.state == "retiring":
            raise RuntimeError("the holder is restarting")
        if not req.append and self.state != "empty":
            raise RuntimeError(f"this holder has a copy already ({self.state}); the runtime restarts it first")
        torch = self.torch
        out = {}
        for s in req.specs:
            t = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=self.device)
            if self.device == "cpu":
                t.share_memory_()
            out[s.name] = t
            self.kinds[s.name] = s.kind
        self.tensors.update(out)
        if req.pid is not None:
            self.mappers[req.pid] = req.generation
        self.state, self.key = "filling", req.key
        if not req.append:
            self.filled_by = req.generation
        return out

    def seal(self, key: str, aliases: dict[str, str]) -> str:
        if self.state != "filling" or key != self.key:
            return f"nothing being filled for this key (state {self.state})"
        missing = [a for a, n in aliases.items() if n not in self.tensors]
        if missing:
            return f"aliases of tensors never allocated: {missing[:3]}"
        self.aliases = dict(aliases)
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()
        self.sums = checksum(self.torch, self.tensors)
        self.state, self.sealed_at = "held", utcnow()
        log.warning("holder sealed %d tensors, %.2f GiB (%s)", len(self.tensors),
                    self.snapshot().bytes / 2**30, self.key)
        return ""

    def payload(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "aliases": self.aliases, "kinds": self.kinds}


class Server:
    def __init__(self, holder: Holder, socket_path: Path, authkey: bytes) -> None:
        self.holder = holder
        self.path = socket_path
        self.authkey = authkey
        self.owner = os.getppid()
        self.orphaned_at: float | None = None

    def serve_forever(self) -> None:
        self.path.unlink(missing_ok=True)
        listener = Listener(str(self.path), family="AF_UNIX", authkey=self.authkey)
        os.chmod(self.path, 0o600)
        threading.Thread(target=self._follow_owner, daemon=True, name="owner").start()
        log.warning("holder %d serves %s on %s", os.getpid(), self.holder.device, self.path)
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError) as e:  # a client that failed the handshake
                log.warning("holder: connection refused: %s", e)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _follow_owner(self) -> None:
        """Exit when the runtime is gone and no new one adopted this holder within the lease."""
        while True:
            time.sleep(1.0)
            if _alive(self.owner):
                self.orphaned_at = None
                continue
            now = time.monotonic()
            if self.orphaned_at is None:
                self.orphaned_at = now
                log.warning("holder: runtime %d is gone; waiting %.0f s for a new one", self.owner, contract.LEASE_S)
            elif now - self.orphaned_at > contract.LEASE_S:
                log.warning("holder: not adopted within %.0f s; exiting", contract.LEASE_S)
                os._exit(0)

    def _serve(self, conn: Connection) -> None:
        filling = False
        try:
            while True:
                try:
                    raw = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    req = contract.read(contract.HolderRequest, raw)
                except ProtocolError as e:
                    self._reply(conn, False, error=f"bad request: {e}")
                    continue
                filling = self._handle(conn, req, filling)
        finally:
            with self.holder.lock:
                if filling and self.holder.state == "filling":
                    self.holder.spoil("the engine filling it went away before it sealed")
            conn.close()

    def _handle(self, conn: Connection, req: contract.HolderRequest, filling: bool) -> bool:
        h = self.holder
        with h.lock:
            if req.op is contract.Op.STAT:
                self._reply(conn, True)
            elif req.op is contract.Op.RETIRE:
                why = h.retire()
                self._reply(conn, not why, error=why)
            elif req.op is contract.Op.ADOPT:
                self.owner = req.owner or self.owner
                self.orphaned_at = None
                log.warning("holder adopted by pid %d", self.owner)
                self._reply(conn, True)
            elif req.op is contract.Op.GET:
                miss = h.get(req.key)
                if miss:
                    self._reply(conn, True, miss=miss)
                else:
                    h.handed += 1
                    if req.pid is not None:
                        h.mappers[req.pid] = req.generation
                    self._reply(conn, True, follow=True)
                    conn.send(h.payload())
            elif req.op is contract.Op.ALLOC:
                try:
                    h.alloc(req)
                except Exception as e:  # noqa: BLE001 - out of memory, a dtype: the engine keeps its own
                    if h.state == "filling":
                        h.spoil(f"could not allocate: {type(e).__name__}: {e}")
                    self._reply(conn, False, error=f"{type(e).__name__}: {e}")
                    return filling
                self._reply(conn, True, follow=True)
                conn.send({"tensors": {s.name: h.tensors[s.name] for s in req.specs}})
                return True
            elif req.op is contract.Op.KV:
                try:
                    bufs = h.kv(req)
                except Exception as e:  # noqa: BLE001 - out of memory, another shape: the engine allocates its own
                    self._reply(conn, False, error=f"{type(e).__name__}: {e}")
                    return filling
                self._reply(conn, True, follow=True)
                conn.send({"kv": bufs})
            elif req.op is contract.Op.SEAL:
                why = h.seal(req.key, req.aliases)
                self._reply(conn, not why, error=why)
                return False
        return filling

    def _reply(self, conn: Connection, ok: bool, miss: str = "", error: str = "", follow: bool = False) -> None:
        r = contract.HolderReply(ok=ok, miss=miss, error=error, state=self.holder.snapshot(), tensors_follow=follow)
        conn.send_bytes(contract.write(r))


def _alive(pid: int) -> bool:
    """A live process (a zombie is not: it maps nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_guard.patches.holder", description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, type=Path)
    p.add_argument("--device", default="cuda", help="cuda (the first visible GPU) or cpu")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s holder %(levelname)s %(message)s", stream=sys.stderr)
    key = os.environ.get(contract.HOLDER_KEY_VAR, "")
    if not key:
        print(f"{contract.HOLDER_KEY_VAR} is not set", file=sys.stderr)
        return 2
    import torch
    import torch.multiprocessing as mp

    device = "cuda:0" if a.device == "cuda" else "cpu"
    if device == "cpu":
        # file names, not fds: fd passing needs the receiver to share this process's authkey
        mp.set_sharing_strategy("file_system")
    else:
        torch.cuda.init()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Server(Holder(torch, device), a.socket, bytes.fromhex(key)).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
