"""One report for a fleet: `--db A --db B ...` (or a directory of ledgers) pools up time,
failures and downtime per GPU model, gives the pooled MTBF its chi-square bounds (the core's),
and says per pair of GPU models which is better, on pooled data; text, JSON, HTML in Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import GUARD
from ledgers import Box, runtime_ledger
from test_report_html import seen
from vllm_guard.core.reliability import mtbf

A100, RTX = "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GUARD, "report", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two A100 boxes (one crash between them) and two 4090 boxes (a crash each, TTFT 50 %
    slower), each a ledger of the runtime's own rows."""
    d = tmp_path_factory.mktemp("fleet")
    for name, box in (("a100-1", Box(gpu=A100, seed=1)), ("a100-2", Box(gpu=A100, seed=2, crash=False)),
                      ("rtx-1", Box(gpu=RTX, ttft_s=0.06, seed=3)), ("rtx-2", Box(gpu=RTX, ttft_s=0.06, seed=4))):
        runtime_ledger(d / f"{name}.sqlite", box)
    return d


def test_pooled_per_gpu_model_with_the_cores_bounds(fleet_dir: Path) -> None:
    dbs = sorted(str(p) for p in fleet_dir.glob("*.sqlite"))
    out = report(*[x for db in dbs for x in ("--db", db)], "--format", "json")
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)
    assert f["schema"] == "vllm-guard-fleet/1" and len(f["boxes"]) == 4
    models = {m["label"]: m for m in f["models"]}
    assert set(models) == {A100, RTX} and models[A100]["boxes"] == 2
    for label, fails in ((A100, 1), (RTX, 2)):
        m = models[label]
        boxes = [b for b in f["boxes"] if b["label"] == label]
        up = sum(b["up_h"] for b in boxes)
        assert m["failures_unplanned"] == fails == sum(b["failures_unplanned"] for b in boxes)
        assert m["up_h"] == pytest.approx(up, abs=1e-3)
        core = mtbf(m["up_h"], fails, 0.90)
        assert m["mtbf"]["mtbf_h"] == pytest.approx(core.mtbf_h)
        assert m["mtbf"]["two_sided_low_h"] == pytest.approx(core.two_sided_low_h)
        assert m["mtbf"]["two_sided_high_h"] == pytest.approx(core.two_sided_high_h)
        assert m["downtime_planned_s"] == pytest.approx(sum(b["downtime_planned_s"] for b in boxes))
    [v] = f["verdicts"]
    assert v["better"] == A100 and v["overall"].startswith(f"{A100} is better than {RTX}: on TTFT median"), v
    fails = next(x for x in v["lines"] if x["figure"] == "unplanned failures")
    assert fails["better"] is None  # 1 in ~4 h vs 2 in ~4 h: no difference


def test_a_directory_of_ledgers_text_and_html(fleet_dir: Path, tmp_path: Path) -> None:
    text = report("--db", str(fleet_dir))
    assert text.returncode == 0, text.stderr
    assert "4 boxes, 2 GPU model(s)" in text.stdout and f"{A100}: 2 boxes, MTBF " in text.stdout
    assert f"{A100} is better than {RTX}" in text.stdout
    page = tmp_path / "fleet.html"
    out = report("--db", str(fleet_dir), "--format", "html", "--out", str(page))
    assert out.returncode == 0, out.stderr
    v = seen(page, tmp_path)
    assert f"{A100} is better than {RTX}" in v["verdict"] and f"{RTX}: 2 boxes, MTBF" in v["verdict"]
    assert v["sections"] == ["models", "boxes"]
    tables = {t["cls"].split()[-1]: t["rows"] for t in v["tables"]}
    assert tables == {"models": 3, "boxes": 5}, tables


def test_fleet_inputs_that_cannot_work_are_one_line(fleet_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    out = report("--db", str(empty))
    assert out.returncode == 2 and "a directory with no ledger in it" in out.stderr and len(out.stderr.splitlines()) == 1
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(next(fleet_dir.glob("*.sqlite")), one / "x.sqlite")
    out = report("--db", str(one))
    assert out.returncode == 2 and "two or more ledgers" in out.stderr, out.stderr
    a = str(next(fleet_dir.glob("*.sqlite")))
    out = report("--db", a, "--db", a, "--compare", a, a)
    assert out.returncode == 2 and "not with --compare" in out.stderr, out.stderr
