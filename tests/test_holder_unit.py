"""The weight holder process, for real: shared host memory here, CUDA IPC on a GPU box.

A real `python -m vllm_guard.patches.holder` and this process as the engine (`patches.held`'s
client): a copy filled in chunks and sealed, mapped back with the same bytes; another key, a
write into the mapped weights (the sampled checksum) and a fill that broke off each leave the copy
stale; RETIRE is refused while an engine pid maps it; the runtime's `HolderProcess` restarts it
on the same socket, and a fresh holder takes a new copy. The CUDA case is skipped without a GPU
(VLLM_GUARD_REQUIRE_GPU=1 makes that a failure on the GPU box).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from vllm_guard.core import holder as contract
from vllm_guard.patches.held import HolderClient
from vllm_guard.runtime.child.holder import HolderProcess

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device_ok(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        if os.environ.get("VLLM_GUARD_REQUIRE_GPU") == "1":
            pytest.fail("VLLM_GUARD_REQUIRE_GPU=1 but torch sees no CUDA device")
        pytest.skip("no CUDA device")


@pytest.fixture(params=DEVICES)
def holder(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HolderProcess]:
    device = request.param
    _device_ok(device)
    h = HolderProcess(0, tmp_path, sys.executable, dict(os.environ), device)
    assert asyncio.run(h.ensure()), h.error
    yield h
    asyncio.run(h.stop())


def client(h: HolderProcess) -> HolderClient:
    return HolderClient(str(h.path), bytes.fromhex(h.key), wait_s=30)


def weights(device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16).to(device),
            "b.weight": torch.randn(3000, generator=g).to(device),
            "b.cache": torch.arange(10, dtype=torch.int64).to(device)}


def fill(h: HolderProcess, key: str, src: dict[str, Any]) -> dict[str, Any]:
    """As an engine that loaded from disk: two chunks, copy, seal; returns the holder's tensors."""
    c = client(h)
    names = list(src)
    got: dict[str, Any] = {}
    for i, chunk in enumerate((names[:1], names[1:])):
        specs = tuple(contract.TensorSpec(name=n, shape=tuple(src[n].shape), dtype=str(src[n].dtype)[6:],
                                          kind="buffer" if n.endswith("cache") else "param") for n in chunk)
        reply, payload = c.ask(contract.HolderRequest(op=contract.Op.ALLOC, key=key, specs=specs, append=i > 0,
                                                      generation=1))
        assert reply.ok and payload is not None, reply
        for n in chunk:
            payload["tensors"][n].copy_(src[n])
            got[n] = payload["tensors"][n]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    reply, _ = c.ask(contract.HolderRequest(op=contract.Op.SEAL, key=key, aliases={"tied.weight": "a.weight"}))
    assert reply.ok and reply.state.state == "held", reply
    c.close()
    return got


def get(h: HolderProcess, key: str) -> tuple[contract.HolderReply, Any]:
    c = client(h)
    try:
        return c.ask(contract.HolderRequest(op=contract.Op.GET, key=key, generation=2))
    finally:
        c.close()


def test_a_filled_copy_is_mapped_back_byte_for_byte(holder: HolderProcess) -> None:
    src = weights(holder.device)
    fill(holder, "k1", src)
    reply, payload = get(holder, "k1")
    assert reply.miss == "" and payload is not None, reply
    assert set(payload["tensors"]) == set(src) and payload["aliases"] == {"tied.weight": "a.weight"}
    assert payload["kinds"]["b.cache"] == "buffer" and payload["kinds"]["a.weight"] == "param"
    for n, t in src.items():
        assert payload["tensors"][n].device.type == t.device.type
        assert torch.equal(payload["tensors"][n].cpu(), t.cpu()), n
    st = reply.state
    assert st.tensors == 3 and st.bytes == sum(t.numel() * t.element_size() for t in src.values())
    assert st.handed == 1 and st.filled_by == 1 and st.mappers == []  # this test process gave no pid


def test_another_key_a_write_into_the_weights_and_a_broken_fill_each_leave_it_stale(holder: HolderProcess) -> None:
    src = weights(holder.device)
    fill(holder, "k1", src)
    reply, _ = get(holder, "k2")
    assert "stale" in reply.miss and "another key" in reply.state.stale, reply
    assert asyncio.run(holder.retire())  # no engine pid maps it

    asyncio.run(holder.restart("test"))
    assert asyncio.run(holder.ensure())
    fill(holder, "k1", src)
    reply, payload = get(holder, "k1")
    assert reply.miss == ""
    payload["tensors"]["b.weight"].add_(1.0)  # an engine that writes into the weights it maps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    reply, payload = get(holder, "k1")
    assert payload is None and "checksum" in reply.state.stale, reply

    asyncio.run(holder.restart("test"))
    assert asyncio.run(holder.ensure())
    c = client(holder)
    spec = contract.TensorSpec(name="x", shape=(4,), dtype="float32", kind="param")
    reply, _ = c.ask(contract.HolderRequest(op=contract.Op.ALLOC, key="k3", specs=(spec,)))
    assert reply.ok
    c.close()  # went away before it sealed
    deadline = time.monotonic() + 10
    while (st := asyncio.run(holder.stat())) is not None and st.state != "stale" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st is not None and st.state == "stale" and "before it sealed" in st.stale, st


def engine_that_maps(h: HolderProcess, request: str) -> subprocess.Popen[bytes]:
    """Another process that asks the holder `request` (a `HolderRequest(...)` expression over `c`,
    with its own pid), keeps what it mapped, and says `mapped`."""
    code = ("import os,sys,time\n"
            "from vllm_guard.core import holder as c\n"
            "from vllm_guard.patches.held import HolderClient\n"
            "cl=HolderClient(sys.argv[1], bytes.fromhex(sys.argv[2]))\n"
            f"r,p=cl.ask({request})\n"
            "assert p is not None, r\n"
            "print('mapped', flush=True)\n"
            "time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(h.path), h.key], stdout=subprocess.PIPE)


def test_retire_waits_for_every_engine_that_maps_the_copy(holder: HolderProcess, tmp_path: Path) -> None:
    fill(holder, "k1", weights(holder.device))
    engine = engine_that_maps(holder, "c.HolderRequest(op=c.Op.GET,key='k1',pid=os.getpid())")
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == b"mapped"
        st = asyncio.run(holder.stat())
        assert st is not None and engine.pid in st.mappers, st
        assert not asyncio.run(holder.retire()), "retired while an engine maps the copy"
    finally:
        engine.kill()
        engine.wait()
    assert asyncio.run(holder.retire())  # its one engine is gone
    reply, payload = get(holder, "k1")
    assert payload is None and reply.state.state == "retiring" and "restarting" in reply.miss


def test_a_restart_keeps_the_socket_and_key_and_starts_empty(holder: HolderProcess) -> None:
    fill(holder, "k1", weights(holder.device))
    pid, key, path = holder.pid, holder.key, holder.path
    asyncio.run(holder.restart("recycle --strategy cold"))
    assert asyncio.run(holder.ensure())
    assert holder.pid != pid and holder.key == key and holder.path == path
    st = holder.status()
    assert st.state == "empty" and st.drops == 1 and st.last_drop == "recycle --strategy cold", st
    reply, payload = get(holder, "k1")
    assert payload is None and reply.miss == "nothing held yet"


def test_a_bad_authkey_gets_nothing(holder: HolderProcess) -> None:
    from multiprocessing import AuthenticationError

    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        HolderClient(str(holder.path), secrets.token_bytes(16))


def test_the_drop_rules() -> None:
    assert contract.drop_reason(command="recycle", strategy="cold") == "recycle --strategy cold"
    assert contract.drop_reason(command="recycle", strategy="gated") is None
    assert contract.drop_reason(command="recycle", reason="xid") is None  # a recycle is not the Xid action
    assert contract.drop_reason(command="restart", reason="xid") == "restart for xid"
    assert contract.drop_reason(command="hold", reason="xid") == "hold for xid"
    assert contract.drop_reason(command="restart", reason="hang") is None
    assert contract.drop_reason(death_cause="RuntimeError: CUDA error: an illegal memory access was encountered")
    assert contract.drop_reason(death_cause="killed by SIGKILL") is None


def test_the_key_changes_with_what_decides_the_tensors(tmp_path: Path) -> None:
    base = {"model": "/m", "dtype": "torch.bfloat16", "files": [["a.safetensors", 10, 1]]}
    k = contract.weights_key(base)
    assert contract.weights_key(dict(base)) == k
    assert contract.weights_key({**base, "dtype": "torch.float16"}) != k
    assert contract.weights_key({**base, "files": [["a.safetensors", 11, 1]]}) != k
    (tmp_path / "model.safetensors").write_bytes(b"x" * 8)
    fp = contract.files_fingerprint(tmp_path)
    assert fp and fp[0][0] == "model.safetensors" and fp[0][1] == 8


def test_auto_holds_only_where_vllms_start_check_leaves_room_for_the_weights(tmp_path: Path) -> None:
    from vllm_guard.runtime.replica.plan import holder_room

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (8 + 2 * 2**20))  # a header-less 2 MiB file
    model = str(tmp_path)
    assert holder_room(["--gpu-memory-utilization", "0.16"], model, 81_559.0) is None
    why = holder_room([], model, 81_559.0)  # vLLM's default 0.9 leaves 8 GiB: room for 2 MiB + context
    assert why is None
    why = holder_room(["--gpu-memory-utilization", "0.99"], model, 81_559.0)
    assert why is not None and "start check" in why, why
    assert holder_room([], model, None) is not None  # no NVML total: no holder by default
