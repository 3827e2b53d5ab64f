"""`vllm-guard report` on bad input: one line on stderr, exit 2, nothing on stdout, no file
written. Complements test_report_contracts.py (not a ledger, --run-id, --out dir, --confidence)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import GUARD, ROOT
from vllm_guard.core import ledger as L
from vllm_guard.report.cost import load_prices

EXAMPLE = ROOT / "docs" / "examples" / "prices-field-report.toml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GUARD, "report", *args], capture_output=True, text=True, timeout=300)


def good_ledger(tmp: Path) -> Path:
    db = tmp / "l.sqlite"
    conn = L.connect(db)
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, requests_served) VALUES "
                 "(1, '2026-03-01T00:00:00.000Z', '2026-03-01T00:01:00.000Z', 10)")
    conn.close()
    return db


def prices(tmp: Path, name: str, text: str) -> str:
    p = tmp / name
    p.write_text(text)
    return str(p)


def test_bad_inputs_are_one_line_exit_2(tmp_path: Path) -> None:
    good = good_ledger(tmp_path)
    empty = tmp_path / "empty.sqlite"
    L.connect(empty).close()  # a ledger with its tables and no rows
    base = EXAMPLE.read_text()
    cases = {
        "empty ledger": (["--db", str(empty)], "the ledger is empty"),
        "empty in compare": (["--compare", str(good), str(empty)], "the ledger is empty"),
        "out is a dir": (["--db", str(good), "--out", str(tmp_path)], "is a directory"),
        "out unwritable": (["--db", str(good), "--out", "/proc/report.txt"], "--out has value '/proc/report.txt'"),
        "run id with compare": (["--compare", str(good), str(good), "--run-id", "1"], "--run-id"),
        "prices missing": (["--db", str(good), "--prices", str(tmp_path / "none.toml")], "cannot read it"),
        "prices not toml": (["--db", str(good), "--prices", prices(tmp_path, "a.toml", "currency = [\n")], "not TOML"),
        "prices bad value": (["--db", str(good), "--prices", prices(tmp_path, "b.toml", base.replace(
            "card_price = 13500", 'card_price = "cheap"'))], "[[box]] 2: card_price has value 'cheap': must be a number"),
        "prices unknown key": (["--db", str(good), "--prices", prices(tmp_path, "c.toml", base.replace(
            "years = 3", "yeras = 3"))], "yeras: unknown key"),
        "prices missing key": (["--db", str(good), "--prices", prices(tmp_path, "d.toml", base.replace(
            "power_price_per_kwh = 0.8\n", ""))], "power_price_per_kwh: missing"),
        "prices no box": (["--db", str(good), "--prices", prices(tmp_path, "e.toml", 'currency = "X"\n'
                                                                 "power_price_per_kwh = 1\n")], "box: missing"),
        "prices negative": (["--db", str(good), "--prices", prices(tmp_path, "f.toml", base.replace(
            "power_price_per_kwh = 0.8", "power_price_per_kwh = -1"))], "must be a finite number >= 0"),
        "prices zero cards": (["--db", str(good), "--prices", prices(tmp_path, "g.toml", base.replace(
            "cards = 4", "cards = 0"))], "cards has value 0: must be a whole number >= 1"),
        "sla syntax": (["--db", str(good), "--sla", "interactive:500ms"], "is not NAME=BOUND"),
        "sla bound": (["--db", str(good), "--sla", "interactive=fast"], "is not a duration"),
    }
    for name, (args, says) in cases.items():
        out = run(*args)
        assert out.returncode == 2, (name, out.returncode, out.stderr)
        assert out.stderr.count("\n") == 1 and says in out.stderr, (name, out.stderr)
        assert out.stdout == "", name
    assert not list(tmp_path.glob("*.txt"))


def test_the_example_price_file_loads_and_is_cited() -> None:
    p = load_prices(EXAMPLE)
    assert p.currency == "CNY" and p.power_price_per_kwh == 0.8 and p.years == 3
    assert [b.match for b in p.boxes] == ["A100", "4090"]
    a100 = p.box_for("NVIDIA A100-SXM4-80GB")
    assert a100 is not None and a100.capital == 2 * 280000 + 120000 + 8000
    assert "cited, not measured" in p.source and "NOT measurements" in EXAMPLE.read_text()


def test_sla_tiers_and_latency_are_configurable(tmp_path: Path) -> None:
    good = good_ledger(tmp_path)
    out = run("--db", str(good), "--format", "json", "--sla", "gold=100ms,silver=1s", "--sla-latency", "e2e")
    assert out.returncode == 0, out.stderr
    import json

    s = json.loads(out.stdout)["sla"]
    assert [t["name"] for t in s["tiers"]] == ["gold", "silver"] and s["latency"] == "e2e"
    assert s["tiers"][0]["bound_s"] == 0.1 and s["present"] is False  # no soak requests: said, not an error
