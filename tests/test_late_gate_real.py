"""The late gate's engine side on real vLLM-CPU: a late-gated engine parks ready.

One real holder (shared memory) and real vLLM OpenAI servers started the way the runtime starts
a late-gated standby: the holder's address, `VLLM_GUARD_KV`, a gate with
`VLLM_GUARD_GATE_AT=ready`. With `held` its EngineCore loads the weights, maps the holder's KV
cache, finishes vLLM's KV set-up and only then parks; with `own` (where two whole generations
fit) it does the same on a KV cache of its own, mapping none of the holder's. The API server is
not up while it waits (vLLM's handshake waits for the engine). Opened, it serves a real
completion. On a GPU this is the step that leaves only the handshake, the API server and /health
after the gate.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from conftest import CHILD_ENV, VLLM_ARGS
from vllm_guard.core import plugin
from vllm_guard.runtime.child.holder import HolderProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from leakstorm import VllmServer  # noqa: E402

pytestmark = pytest.mark.slow
KV_BYTES = 256 * 2**20


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return None


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HolderProcess]:
    h = HolderProcess(0, tmp_path_factory.mktemp("late-holder"), sys.executable, dict(os.environ), "cpu")
    assert asyncio.run(h.ensure()), h.error
    yield h
    asyncio.run(h.stop())


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("kv_asked", [plugin.KV_HELD, plugin.KV_OWN])
def test_a_late_gated_engine_parks_ready_on_the_kv_cache_asked_for_and_serves_once_opened(
        tiny_model: str, holder: HolderProcess, tmp_path: Path, kv_asked: str) -> None:
    gate = plugin.gate_dir(tmp_path / "late", 1)  # VllmServer's state dir is root/name, generation 1
    env = {**CHILD_ENV, **holder.child_env(), plugin.KV_VAR: kv_asked}
    env = plugin.gate_env(env, gate, 900, at_ready=True)
    srv = VllmServer("late", Path(tiny_model), tmp_path, env,
                     (*VLLM_ARGS, "--kv-cache-memory-bytes", str(KV_BYTES)))
    srv.start()
    try:
        end = time.monotonic() + 900
        while (rep := plugin.read_gate(gate)) is None or rep.state != "parked":
            assert srv.proc is not None and srv.proc.poll() is None, (srv.proc.returncode, rep)
            assert rep is None or rep.state not in ("skipped", "timed_out"), rep
            assert time.monotonic() < end, "never parked"
            time.sleep(0.5)
        assert rep.stage.startswith("ready"), rep  # not before CUDA: after its KV set-up
        st = asyncio.run(holder.stat())
        assert srv.proc is not None
        tree = {p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)}
        assert rep.pid in tree, "the gate's engine is not this server's"
        reports = plugin.read_states(srv.state, 1)
        kv = [r.kv for r in reports.values() if r.kv is not None]
        assert kv and kv[0].source == kv_asked, kv
        if kv_asked == plugin.KV_HELD:
            # the worker that holds the cache maps it (vLLM-CPU sizes it by VLLM_CPU_KVCACHE_SPACE)
            assert st is not None and st.kv_bytes > 0 and st.kv_mappers and set(st.kv_mappers) <= tree, st
            assert kv[0].bytes == st.kv_bytes, kv
        else:  # its own: nothing of the holder's mapped, whatever another engine left there
            assert st is not None and not set(st.kv_mappers) & tree, st
        time.sleep(3)
        assert health(srv.url) is None, "the API server came up while its engine was parked"
        assert plugin.read_gate(gate).state == "parked"

        opened = time.monotonic()
        plugin.open_gate(gate, kv_asked)
        srv.wait_ready(600)
        after_gate = time.monotonic() - opened
        assert plugin.read_gate(gate).state == "opened"
        body = json.dumps({"model": tiny_model, "prompt": "The held cache", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 8, out
        print(f"late gate on vLLM-CPU ({kv_asked}): parked at {rep.stage!r}; ready {after_gate:.1f} s after the gate")
    finally:
        srv.stop()
    # its mapping ends with it: the holder keeps the buffers for the next generation
    end = time.monotonic() + 60
    while (st := asyncio.run(holder.stat())) is not None and st.kv_mappers and time.monotonic() < end:
        time.sleep(0.5)
    assert st is not None and not st.kv_mappers, st
    if kv_asked == plugin.KV_HELD:
        assert st.kv_bytes == kv[0].bytes, st
