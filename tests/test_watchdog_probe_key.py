"""The watchdog probes with the server's API key: a guarded server started with
`-- --api-key SECRET`, and `vllm-guard watchdog --once --json` beside it. With the key from
guard.toml (`[server] vllm_args`) the probe's 1-token completion succeeds; with a wrong key
it gets 401, which is reported (hang: degraded) and never taken for a hang.

The probe goes to the backend the runtime's typed status names for each replica
(`replicas[].backend_url`), with the model it says it serves (`served_model`), and an
X-Request-Id the plugin knows as a probe.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GUARD_CMD, VLLM_ARGS, GuardServer
from vllm_guard.core import admin
from vllm_guard.core.protocol import RuntimeState, StatusSnapshot

pytestmark = pytest.mark.slow

KEY = "SECRET-7f3a"


def typed_status(server: GuardServer) -> StatusSnapshot:
    return asyncio.run(admin.fetch_status(server.state_dir, 30))


def wait_serving(server: GuardServer, timeout: float = 600) -> StatusSnapshot:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"guard exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            st = typed_status(server)
            if st.state is RuntimeState.SERVING:
                return st
        except admin.AdminError:
            pass
        time.sleep(1)
    raise TimeoutError(f"not serving after {timeout}s:\n{server.tail()}")


@pytest.fixture(scope="module")
def keyed(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    server = GuardServer(tiny_model, tmp_path_factory.mktemp("keyed") / "state",
                         vllm_args=[*VLLM_ARGS, "--api-key", KEY]).start()
    try:
        wait_serving(server)
        yield server
    finally:
        server.stop()


def once(server: GuardServer, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    out = subprocess.run([*GUARD_CMD, "watchdog", "--once", "--json", "--kernel", "off", *extra],
                         capture_output=True, text=True, timeout=300, env={**base, **(env or {})})
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def _probe(doc: dict[str, Any]) -> dict[str, Any]:
    """The probe of the one replica (the watchdog probes every replica the status lists)."""
    reps = doc["sample"]["replicas"]
    assert [r["index"] for r in reps] == [0], reps
    return reps[0]["probe"]  # type: ignore[no-any-return]


def _hang(doc: dict[str, Any]) -> dict[str, Any]:
    return [v for v in doc["verdicts"] if v["name"] == "hang"][0]


def test_probe_with_the_key_from_guard_toml_succeeds(keyed: GuardServer, tmp_path: Path) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text(f'[server]\nstate_dir = "{keyed.state_dir}"\nvllm_args = ["--api-key", "{KEY}"]\n'
                   '[watchdog]\nprobe_timeout = "120s"\n')
    doc = once(keyed, "--config", str(cfg))
    probe = _probe(doc)
    assert probe is not None and probe["ok"] is True, probe
    assert _hang(doc)["health"] == "healthy"
    st = typed_status(keyed)
    assert doc["sample"]["status"]["backend_url"] == st.backend_url == doc["sample"]["replicas"][0]["url"]


def test_probe_with_the_key_from_the_environment_succeeds(keyed: GuardServer) -> None:
    doc = once(keyed, "--state-dir", str(keyed.state_dir), "--dry-run", env={"VLLM_API_KEY": KEY})
    assert _probe(doc)["ok"] is True, _probe(doc)


def test_probe_with_a_wrong_key_gets_401_and_is_not_a_hang(keyed: GuardServer) -> None:
    """The same run with a wrong key fails: the test above can fail."""
    doc = once(keyed, "--state-dir", str(keyed.state_dir), "--dry-run", env={"VLLM_API_KEY": "wrong"})
    probe = _probe(doc)
    assert probe["ok"] is False and probe["error"].startswith("HTTP 401"), probe
    hang = _hang(doc)
    assert hang["health"] == "degraded" and "HTTP 401" in hang["reason"] and hang["findings"] == []
    assert typed_status(keyed).state is RuntimeState.SERVING  # nothing was restarted
