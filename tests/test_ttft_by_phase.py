"""bench/ttft_by_phase.py: every request's TTFT by what the next generation was doing, from a ledger.

Driven on ledgers the runtime wrote on an H100 (docs/results/, kept xz-packed), and on one of them
unpacked.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ttft_by_phase.py"
RUNS = ROOT / "docs" / "results" / "h100-2026-12-08"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_an_overlap_runs_requests_are_labelled_by_the_start_beside_and_add_up() -> None:
    r = _run("--json", f"over={RUNS / 'overlap80'}", f"alone={RUNS / 'guarded'}")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    over, alone = out["over"], out["alone"]
    assert over["all"]["n"] == 1200 and alone["all"]["n"] == 1200
    # every request of the overlap run arrived while a next generation started or switched
    parts = {k: v for k, v in over.items() if k != "all"}
    assert sum(v["n"] for v in parts.values()) == 1200 and "none" not in parts
    assert {"beside: starting vLLM", "standby: compiling and profiling", "standby: warming up"} <= set(parts)
    # one generation with nothing beside it: every request is "none"
    assert set(alone) == {"all", "none"} and alone["none"] == alone["all"]
    for figures in (*over.values(), *alone.values()):
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"]


def test_a_plain_ledger_file_is_read_too_and_a_run_without_one_is_refused(tmp_path: Path) -> None:
    import lzma

    ledger = tmp_path / "run" / "ledger.sqlite"
    ledger.parent.mkdir()
    with lzma.open(RUNS / "guarded" / "ledger.sqlite.xz") as src, ledger.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM edge_requests").fetchone()[0] >= 1200
    r = _run(f"alone={ledger.parent}")
    assert r.returncode == 0, r.stderr
    assert "alone: the guard's TTFT in ms" in r.stdout and " none " in r.stdout
    missing = _run(f"x={tmp_path / 'nothing'}")
    assert missing.returncode == 2 and "no ledger.sqlite or ledger.sqlite.xz" in missing.stderr
    bad = _run("nameless")
    assert bad.returncode == 2 and "expected NAME=DIR" in bad.stderr
