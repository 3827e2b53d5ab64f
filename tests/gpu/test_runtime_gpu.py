"""The guard on a real GPU with real vLLM (0.25.1 on the lent H200): recycling under streaming
load with 0 failed requests, and NVML shows the old generation's memory gone before the next
one starts. Skipped without CUDA; VLLM_GUARD_REQUIRE_GPU=1 turns the skip into a failure."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GuardServer
from streams import run_load, summarize

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
RESULTS = Path(os.environ.get("VLLM_GUARD_RESULTS", "/tmp/vllm-guard-results"))
# torch.compile on: generation 1 compiles into an empty cache in the state dir, later ones reuse it
GPU_ARGS = ["--max-model-len", "1024", "--gpu-memory-utilization", "0.15"]


def _gpu_or_skip() -> Any:
    why = ""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() > 0:
            return pynvml
        why = "NVML sees no GPU"
    except Exception as e:  # noqa: BLE001 - any NVML failure means "no GPU here"
        why = f"NVML unavailable: {e}"
    if os.environ.get("VLLM_GUARD_REQUIRE_GPU") == "1":
        pytest.fail(f"VLLM_GUARD_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


def _t(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class GpuWatcher:
    """Samples NVML's compute processes every 100 ms: which pids hold GPU memory, and when."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        h = self.nvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.is_set():
            procs = {}
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                try:  # a generation is one process group led by its API server (ledger `pid`)
                    procs[p.pid] = os.getpgid(p.pid)
                except ProcessLookupError:
                    procs[p.pid] = -1
            self.samples.append((time.time(), procs))
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)


@pytest.fixture(scope="module")
def gpu_guard(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GuardServer, GpuWatcher]]:
    nvml = _gpu_or_skip()
    watcher = GpuWatcher(nvml)
    srv = GuardServer(tiny_model, tmp_path_factory.mktemp("gpu"), vllm_args=GPU_ARGS,
                      args=["--max-requests", "100", "--max-requests-jitter", "10", "--probe-interval", "5s",
                            # what this test proves is the stop-then-start order (one holder at a
                            # time); on an H200 `auto` would overlap two tiny generations
                            "--recycle-strategy", "cold"])
    srv.start()
    try:
        srv.wait_serving(1, 600)
        yield srv, watcher
    finally:
        srv.stop(180)
        watcher.stop()


def test_recycling_on_gpu_loses_nothing_and_releases_memory_first(gpu_guard: tuple[GuardServer, GpuWatcher]) -> None:
    srv, watcher = gpu_guard
    first = srv.status()
    t0 = time.time()
    results = asyncio.run(run_load(srv.url, srv.model, 230, 16, 32))
    st = srv.wait_for(lambda s: s["state"] == "serving", 600, "serving")
    summary = summarize(results, 32)
    assert summary.ok == len(results), summary.errors[:5]
    assert st["requests"]["failed"] == 0 and st["failures"] == 0
    assert st["generation"] >= 3
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    gens = db.execute("SELECT generation, pid, started_at, ready_at, ended_at, gpu_name, vllm_version "
                      "FROM generations ORDER BY generation").fetchall()
    # NVML: at no sample did two of this guard's generations hold GPU memory at once (other
    # processes on the GPU, e.g. a benchmark beside us, are told apart by process group).
    groups = {g[1] for g in gens}
    holders = [{pg for pg in p.values() if pg in groups} for _, p in watcher.samples]
    holders = [h for h in holders if h]
    assert holders, "NVML never saw a process of this guard holding GPU memory"
    assert max(len(h) for h in holders) == 1, [h for h in holders if len(h) > 1][:3]
    distinct = []
    for h in holders:
        if not distinct or distinct[-1] != h:
            distinct.append(h)
    assert len(distinct) >= st["generation"] - first["generation"] + 1
    events = srv.events()
    assert not [e for e in events if e.get("event") == "gpu_memory_not_released"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_runtime.json").write_text(json.dumps({
        "requests": len(results), "failed": len(results) - summary.ok, "generations": st["generation"],
        "recycles": st["recycles"], "gpu": st["gpu_name"], "vllm": st["vllm_version"],
        "ledger_generations": gens, "nvml_holder_sequence": [sorted(h) for h in distinct],
        "max_concurrent_holders": max(len(h) for h in holders), "load_s": round(time.time() - t0, 1),
        "patches": st["patches"],
        "cold_start_s": {g[0]: round((_t(g[3]) - _t(g[2])), 1) for g in gens if g[3]},
    }, indent=2, default=str))
