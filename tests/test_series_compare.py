"""bench/series_compare.py: a run's TTFT p99 against plain vLLM's, with a block-bootstrap interval."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "series_compare.py"


def _write(d: Path, ttft_ms: np.ndarray, xz: bool = False, rate: float = 10.0) -> Path:
    d.mkdir(parents=True)
    res = {"ttfts": [float(x) / 1000 for x in ttft_ms],
           "start_times": [100.0 + i / rate for i in range(len(ttft_ms))]}
    if xz:
        with lzma.open(d / "vllm_bench.json.xz", "wt") as f:
            json.dump(res, f)
    else:
        (d / "vllm_bench.json").write_text(json.dumps(res))
    return d


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_a_slower_tail_is_missed_an_equal_one_cannot_tell(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    base = rng.gamma(20, 1.1, 1200)
    plain = _write(tmp_path / "plain", base)
    plain2 = _write(tmp_path / "plain2", rng.permutation(base), xz=True)  # the same requests, reordered
    same = _write(tmp_path / "same", rng.permutation(base))
    slow = rng.permutation(base)
    slow[::25] *= 3  # every 25th request three times as long: the p99 far above plain's
    slower = _write(tmp_path / "slower", slow)
    p = _run("--base", f"plain={plain}", "--base", f"plain2={plain2}", f"same={same}", f"slower={slower}",
             "--json", "--boot", "300")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["n"] == {"plain": 1200, "plain2": 1200, "same": 1200, "slower": 1200}
    (aa,) = out["controls"]
    assert (aa["a"], aa["b"]) == ("plain2", "plain") and aa["low"] <= 1.0 <= aa["high"]
    by = {(r["a"], r["b"]): r for r in out["ratios"]}
    assert set(by) == {(a, b) for a in ("same", "slower") for b in ("plain", "plain2", "plain+plain2")}
    for b in ("plain", "plain2", "plain+plain2"):
        assert abs(by[("same", b)]["ratio"] - 1.0) < 1e-9 and by[("same", b)]["low"] < 1.0 < by[("same", b)]["high"]
        assert by[("slower", b)]["low"] > 1.1
        r = by[("slower", b)]
        assert r["low"] <= r["ratio"] <= r["high"] and abs(r["ratio"] - r["qa"] / r["qb"]) < 1e-9
    text = _run("--base", f"plain={plain}", f"slower={slower}", "--boot", "300")
    assert text.returncode == 0 and "> 1.1x: missed" in text.stdout


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path) -> None:
    plain = _write(tmp_path / "plain", np.full(50, 20.0))
    missing = _run("--base", f"plain={tmp_path / 'nowhere'}", f"x={plain}")
    assert missing.returncode == 2 and "no vllm_bench.json" in missing.stderr
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "vllm_bench.json").write_text(json.dumps({"ttfts": [0.02]}))
    bare = _run("--base", f"plain={plain}", f"x={tmp_path / 'bare'}")
    assert bare.returncode == 2 and "start_times" in bare.stderr
    assert _run("--base", "plain", f"x={plain}").returncode == 2
    assert _run("--base", f"plain={plain}", f"x={plain}", "--q", "100").returncode == 2
