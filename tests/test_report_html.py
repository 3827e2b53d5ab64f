"""The report's three formats on one synthetic-but-complete ledger: the HTML opens in headless
Chromium and its plots render (pixels checked); the JSON keeps the keys docs/REPORTS.md lists;
--compare puts two ledgers side by side. A missing browser fails, it does not skip."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from conftest import GUARD, ROOT
from vllm_guard.core import ledger as L
from vllm_guard.core.samples import HostReading, NvmlRecord
from vllm_guard.core.timefmt import iso
from vllm_guard.loadgen.params import SoakParams
from vllm_guard.loadgen.store import MemoryRow, RequestRow, SoakStore

BASE = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
MPL_COLORS = {"tab:blue": (31, 119, 180), "tab:orange": (255, 127, 14), "tab:red": (214, 39, 40)}


def _iso(s: float) -> str:
    return iso(BASE + dt.timedelta(seconds=s))


def make_ledger(path: Path, gpu: str, leak_mb: float) -> None:
    """Two generations with a recycle, soak requests, soak memory samples, watchdog NVML ticks."""
    conn = L.connect(path)
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, "
                 "boot_id, gpu_name, model) VALUES (1, ?, ?, ?, 'scheduled', 'max_requests', 'b', ?, 'tiny')",
                 (_iso(0), _iso(60), _iso(3600), gpu))
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, boot_id, gpu_name, model) "
                 "VALUES (2, ?, ?, 'b', ?, 'tiny')", (_iso(3610), _iso(3660), gpu))
    conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight, duration_s) "
                 "VALUES (1, 'max_requests', 'scheduled', ?, 2, 60)", (_iso(3590),))
    rng = np.random.default_rng(0)
    host = HostReading(mem_total_mb=64000.0, mem_available_mb=50000.0, swap_used_mb=0.0)
    for i in range(240):  # one watchdog tick per 30 s, one row per source, records of core.samples
        t = 30.0 * i
        at = _iso(t)
        hot = 0x20 if 4000 < t < 5000 else 0
        nvml = NvmlRecord.model_validate({"at_s": (BASE + dt.timedelta(seconds=t)).timestamp(), "gpus": [{
            "index": 0, "uuid": "GPU-1", "name": gpu, "temp_c": 60 + 20 * (hot > 0) + rng.normal(0, 1),
            "sm_clock_mhz": 1980 - 300 * (hot > 0), "sm_clock_max_mhz": 1980, "clock_reasons": hot,
            "processes": [{"pid": 100 + (t > 3600), "used_mb": 900.0}]}]})
        for src, rec in (("nvml", nvml), ("host", host)):
            conn.execute("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)", (at, src, rec.model_dump_json()))
    conn.close()
    store = SoakStore(path)
    params = SoakParams(url="http://x", model="tiny", max_model_len=512, scenario="S1", prompt_tokens=16,
                        output_tokens=16, concurrency=None, rate=0.2, burstiness=1.0, mode="steady",
                        burst_period_s=60.0, burst_duty=0.25, seed=0, duration_s=7200.0, timeout_s=600.0,
                        max_requests=None, state_dir=None)
    run = store.create_run("tok-" + gpu, params, "")
    rows = []
    for i in range(1500):
        t = 60 + i * 4.7
        gen = 1 if i < 750 else 2
        rows.append(MemoryRow(run_id=run, at=_iso(t), generation=gen, state="serving", requests_total=i,
                              role="engine_core", pid=100 + gen, requests_generation=(i if gen == 1 else i - 750),
                              rss_mb=700 + leak_mb * (i % 750) + rng.normal(0, 1), uss_mb=600.0, gpu_mb=0.0,
                              host_available_mb=50000.0))
        sent = (BASE + dt.timedelta(seconds=t)).timestamp()
        ttft = 0.03 + 0.02 * rng.random()
        store.put_request(RequestRow(run_id=run, seq=i, request_id=f"r{i}", sent_at=sent, scheduled_at=sent,
                                     ended_at=sent + 0.3, status=200, ttft_s=ttft, ttft_sched_s=ttft, e2e_s=0.3,
                                     e2e_sched_s=0.3, itl_mean_s=0.01, chunks=16, output_tokens=16,
                                     error=None if i % 100 else "http_503_recycle", segment=0))
    store.put_samples(rows[::3])
    store.close()


def report(*args: str) -> str:
    out = subprocess.run([GUARD, "report", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def screenshot(html: Path, png: Path, tmp: Path) -> np.ndarray:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium not installed (apt-get install -y chromium): this test needs a real browser"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp / 'chrome-profile'}",
           "--hide-scrollbars", "--window-size=1200,4200", f"--screenshot={png}", html.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), f"no screenshot: rc={out.returncode} {out.stderr[-2000:]}"
    img = mpimg.imread(str(png))
    return (img[..., :3] * 255).round().astype(int) if img.dtype != np.uint8 else img[..., :3].astype(int)


def color_pixels(img: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int((np.abs(img - np.array(rgb)).sum(axis=2) <= 12).sum())


def test_html_plots_render_in_headless_chromium(tmp_path: Path) -> None:
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA H200", 0.2)
    page = tmp_path / "report.html"
    report("--db", str(db), "--format", "html", "--out", str(page))
    text = page.read_text()
    assert "<script" not in text and "http://" not in text.replace("http://x", "")  # self-contained
    assert text.count('class="plot"') == 3
    blank = tmp_path / "blank.html"
    blank.write_text(re.sub(r'<img class="plot"[^>]*>', "", text))
    shot = screenshot(page, tmp_path / "report.png", tmp_path)
    empty = screenshot(blank, tmp_path / "blank.png", tmp_path)
    assert shot.std() > 20  # not a blank page
    for name, rgb in MPL_COLORS.items():  # the lines and points of the plots, drawn by the browser
        assert color_pixels(shot, rgb) > 300, name
        assert color_pixels(empty, rgb) < 20, name


def test_json_keeps_every_documented_key(tmp_path: Path) -> None:
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA H200", 0.2)
    f = json.loads(report("--db", str(db), "--format", "json"))
    doc = (ROOT / "docs" / "REPORTS.md").read_text()
    keys = re.findall(r"^\| `([a-z0-9_.\[\]]+)` \|", doc, re.M)
    assert len(keys) > 40
    for key in keys:
        cur = f
        for part in key.replace("[]", ".0").split("."):
            assert isinstance(cur, (dict, list)), key
            cur = cur[int(part)] if isinstance(cur, list) else cur[part]
    assert f["schema"] == "vllm-guard-report/1"
    assert f["service"]["recycles"]["list"][0]["trigger"] == "max_requests"
    eng = next(p for p in f["leak"]["processes"] if p["role"] == "engine_core" and p["metric"] == "rss_mb")
    assert eng["per_100_requests"]["slope"] == pytest.approx(20.0, rel=0.05)
    g = f["thermal"]["gpus"][0]
    assert g["throttled_share_by_reason"]["sw_thermal"] == pytest.approx(33 / 240, abs=0.01)
    assert g["max_temp_c"] > 75 and g["clock_drop_pct"] == pytest.approx(100 * (1 - 1680 / 1980), abs=0.1)
    assert f["latency"]["errors"] == {"http_503_recycle": 15} and f["latency"]["requests"] == 1500


def test_compare_two_ledgers_side_by_side(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make_ledger(a, "NVIDIA GeForce RTX 4090", 0.3)
    make_ledger(b, "NVIDIA A100-SXM4-80GB", 0.1)
    text = report("--compare", str(a), str(b))
    assert "RTX 4090" in text and "A100" in text
    c = json.loads(report("--compare", str(a), str(b), "--format", "json"))
    leak = next(r for r in c["rows"] if r["figure"] == "leak engine_core rss_mb MB/100req")
    assert leak["a"] == pytest.approx(30.0, rel=0.05) and leak["b"] == pytest.approx(10.0, rel=0.05)
    page = tmp_path / "c.html"
    report("--compare", str(a), str(b), "--format", "html", "--out", str(page))
    assert page.read_text().count('class="plot"') == 6


def test_compare_labels_budgets_emulated_on_one_gpu_by_profile(tmp_path: Path) -> None:
    """Two budgets on one H200: same GPU name, told apart by the profile the watchdog recorded in
    `meta` (`watchdog.<key>` rows, JSON values)."""
    dbs = []
    for name, profile, mb in (("a", "rtx4090", 24576), ("b", "a100", 81920)):
        db = tmp_path / f"{name}.sqlite"
        make_ledger(db, "NVIDIA H200", 0.3)
        conn = L.connect(db)
        conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                         [(f"watchdog.{k}", json.dumps(v)) for k, v in
                          {"gpu_profile": profile, "gpu_budget_mb": mb, "gpu_names": ["NVIDIA H200"]}.items()])
        conn.close()
        dbs.append(str(db))
    c = json.loads(report("--compare", *dbs, "--format", "json"))
    label = next(r for r in c["rows"] if r["figure"] == "label")
    assert label["a"] == "NVIDIA H200 · profile rtx4090 · 24 GiB budget"
    assert label["b"] == "NVIDIA H200 · profile a100 · 80 GiB budget"
    assert c["a"]["profile"] == {"gpu_profile": "rtx4090", "gpu_budget_mb": 24576}
