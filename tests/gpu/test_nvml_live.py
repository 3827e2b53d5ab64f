"""The live NVML session on a real GPU: every field it claims is read, every sample is a valid
`NvmlRecord`, a trace replays through the watchdog's replay with the same interface.

Skipped without NVML; VLLM_GUARD_REQUIRE_GPU=1 turns the skip into a failure (the GPU box).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from vllm_guard.core.nvml import FIELDS, NvmlSession
from vllm_guard.core.samples import NvmlRecord
from vllm_guard.watchdog.trace import ReplayNvml, TraceWriter

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sampler() -> Iterator[NvmlSession]:
    s = NvmlSession(timeout_s=5.0)
    if not s.available:
        if os.environ.get("VLLM_GUARD_REQUIRE_GPU") == "1":
            pytest.fail(f"VLLM_GUARD_REQUIRE_GPU=1 but {s.error}")
        pytest.skip(s.error)
    yield s
    s.close()


def test_every_claimed_field_is_read(sampler: NvmlSession) -> None:
    rec = sampler.sample()
    assert rec["error"] is None, rec["error"]
    NvmlRecord.model_validate(rec)  # what the watchdog and the ledger read
    assert rec["gpus"] and sampler.driver
    caps = sampler.capability_table()["gpus"]
    names = {"memory": "mem_used_mb", "temperature": "temp_c", "sm_clock": "sm_clock_mhz",
             "clock_reasons": "clock_reasons", "power": "power_w", "power_limit": "power_limit_w",
             "utilization": "util_pct", "ecc": "ecc_uncorrected", "remapped_rows": "remapped_rows",
             "persistence": "persistence", "sm_clock_max": "sm_clock_max_mhz",
             "temp_thresholds": "temp_slowdown_c"}
    for g in rec["gpus"]:
        cap = caps[g["uuid"]]
        assert set(cap) >= set(FIELDS)
        for field, key in names.items():
            if cap[field]:  # claimed: it must hold a value of the right kind
                assert g[key] is not None, f"{field} claimed but {key} is None"
        assert cap["memory"] and 0 < g["mem_used_mb"] <= g["mem_total_mb"]
        if cap["temperature"]:
            assert 10 <= g["temp_c"] <= 110
        if cap["sm_clock"] and cap["sm_clock_max"]:
            assert 0 < g["sm_clock_mhz"] <= g["sm_clock_max_mhz"]
        assert g["uuid"].startswith("GPU-")
    assert all(s["mem_total_mb"] and s["mem_total_mb"] > 1024 for s in sampler.static)  # hold_weights = "auto"


def test_per_process_memory_of_a_real_cuda_process(sampler: NvmlSession) -> None:
    torch_ok = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                              capture_output=True).returncode == 0
    if not torch_ok:
        pytest.skip("torch with CUDA is not importable here")
    code = ("import torch,sys; x=torch.empty(512*2**20,dtype=torch.uint8,device='cuda').fill_(1);"
            "torch.cuda.synchronize(); print('up',flush=True); sys.stdin.readline()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        seen = None
        for _ in range(20):
            rec = sampler.sample()
            seen = [pr for g in rec["gpus"] for pr in g["processes"] if pr["pid"] == p.pid]
            if seen:
                break
            time.sleep(0.25)
        assert seen, "NVML does not list the CUDA process"
        assert seen[0]["used_mb"] >= 512  # the tensor plus the CUDA context
    finally:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.close()
        p.wait(timeout=30)


def test_trace_records_and_replays(sampler: NvmlSession, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, sampler.meta())
    for _ in range(3):
        w.write(sampler.sample())
        time.sleep(0.2)
    w.close()
    r = ReplayNvml(path)
    assert r.available and len(r.samples) == 3 and r.names() == sampler.names()
    assert [g.uuid for g in NvmlRecord.model_validate(r.sample()).gpus] == [s["uuid"] for s in sampler.static]
    assert r.process_memory_mb().keys() <= {p["pid"] for g in r.samples[0]["gpus"] for p in g["processes"]}
