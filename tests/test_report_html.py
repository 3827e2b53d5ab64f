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
from typing import Any

import numpy as np
import pytest
from matplotlib import image as mpimg

from conftest import GUARD, ROOT
from vllm_guard.core import ledger as L
from vllm_guard.core.samples import HostReading, NvmlRecord, ProcReading, StatusBrief
from vllm_guard.core.timefmt import iso
from vllm_guard.loadgen.params import SoakParams
from vllm_guard.loadgen.store import MemoryRow, RequestRow, SoakStore

BASE = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
MPL_COLORS = {"tab:blue": (31, 119, 180), "tab:orange": (255, 127, 14), "tab:red": (214, 39, 40)}
PRICES = ROOT / "docs" / "examples" / "prices-field-report.toml"


def _iso(s: float) -> str:
    return iso(BASE + dt.timedelta(seconds=s))


def make_ledger(path: Path, gpu: str, leak_mb: float) -> None:
    """Two generations with a recycle, soak requests, soak memory samples, watchdog NVML ticks.
    The ledger ends about now: the open generation counts up to now, so BASE is taken here (at
    import it would be as old as the test session)."""
    global BASE
    BASE = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    conn = L.connect(path)
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, ended_at, end_class, end_reason, "
                 "boot_id, gpu_name, model) VALUES (1, ?, ?, ?, 'scheduled', 'max_requests', 'b', ?, 'tiny')",
                 (_iso(0), _iso(60), _iso(3600), gpu))
    conn.execute("INSERT INTO generations (generation, started_at, ready_at, boot_id, gpu_name, model) "
                 "VALUES (2, ?, ?, 'b', ?, 'tiny')", (_iso(3610), _iso(3660), gpu))
    conn.execute("INSERT INTO recycles (generation, trigger, class, started_at, in_flight, duration_s) "
                 "VALUES (1, 'max_requests', 'scheduled', ?, 2, 60)", (_iso(3590),))
    conn.execute("INSERT INTO failures (generation, kind, class, at, exit_code, detail, restored_at) "
                 "VALUES (2, 'crash', 'unplanned', ?, -9, 'engine process died', ?)", (_iso(6000), _iso(6060)))
    rng = np.random.default_rng(0)
    host = HostReading(mem_total_mb=64000.0, mem_available_mb=50000.0, swap_used_mb=0.0)
    for i in range(240):  # one watchdog tick per 30 s, one row per source, records of core.samples
        t = 30.0 * i
        at = _iso(t)
        hot = 0x20 if 4000 < t < 5000 else 0
        gen = 1 if t < 3600 else 2
        req = max(0, int((t - (60 if gen == 1 else 3660)) / 4.7))
        pid = 100 + gen
        nvml = NvmlRecord.model_validate({"at_s": (BASE + dt.timedelta(seconds=t)).timestamp(), "gpus": [{
            "index": 0, "uuid": "GPU-1", "name": gpu, "temp_c": 60 + 20 * (hot > 0) + rng.normal(0, 1),
            "sm_clock_mhz": 1980 - 300 * (hot > 0), "sm_clock_max_mhz": 1980, "clock_reasons": hot,
            "power_w": 300.0 + 50 * (hot > 0), "mem_total_mb": 81559.0, "mem_used_mb": 40000.0 + 0.1 * req,
            "processes": [{"pid": pid, "used_mb": 30000.0 + 0.1 * req}]}]})
        procs = {str(pid): ProcReading.model_validate({"role": "engine_core", "rss_mb": 700 + leak_mb * req
                                                       + rng.normal(0, 1)})}
        status = StatusBrief(state="serving", generation=gen, requests_total=req, requests_generation=req,
                             in_flight=0, queued=0, failures=0, completed=req + 750 * (gen - 1))
        for src, rec in (("nvml", nvml), ("host", host), ("status", status)):
            conn.execute("INSERT INTO samples (at, source, data) VALUES (?, ?, ?)", (at, src, rec.model_dump_json()))
        conn.execute("INSERT INTO samples (at, source, data) VALUES (?, 'procs', ?)",
                     (at, json.dumps({k: v.model_dump(mode="json") for k, v in procs.items()})))
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


def color_pixels(img: np.ndarray, rgb: tuple[int, int, int]) -> int:
    """Pixels of `rgb` drawn over the white background at any opacity of 30 % or more (scatter
    points are half transparent: only where several overlap is the colour itself reached)."""
    white, c = np.array([255.0, 255.0, 255.0]), np.array(rgb, float)
    d = img.astype(float) - white
    a = (d @ (c - white)) / ((c - white) @ (c - white))  # opacity along white -> colour
    off = np.abs(d - a[..., None] * (c - white)).sum(axis=2)  # distance from that line
    return int(((a >= 0.3) & (a <= 1.05) & (off <= 18)).sum())


PROBE = """<script>
window.addEventListener("load", () => {
  const v = document.getElementById("verdict");
  const r = v.getBoundingClientRect();
  const plots = [...document.querySelectorAll("img.plot")].map(i => {
    const b = i.getBoundingClientRect();
    return {alt: i.alt, w: i.naturalWidth, h: i.naturalHeight, shown_w: b.width, top: b.top};
  });
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({verdict: v.innerText, verdict_top: r.top, verdict_bottom: r.bottom,
                                    plots: plots, missing: [...document.querySelectorAll(".plot-missing")]
                                    .map(p => p.innerText)});
  document.body.appendChild(out);
});
</script>"""


def seen(page: Path, tmp: Path) -> dict[str, Any]:
    """What a reader's browser lays out: the verdict's text and place, each plot's size. A copy of
    the page gets a probe script (the report itself has none); Chromium runs it and dumps the DOM."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium not installed (apt-get install -y chromium): this test needs a real browser"
    probed = tmp / ("probed-" + page.name)
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp / 'chrome-profile'}",
           "--window-size=1200,900", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.S)
    assert m, f"no probe output: rc={out.returncode} {out.stderr[-2000:]}"
    return dict(json.loads(html_unescape(m.group(1))))


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)


def plot_images(page: Path) -> list[np.ndarray]:
    """The embedded PNGs, decoded (RGB 0-255)."""
    import base64
    import io

    out = []
    for b64 in re.findall(r'<img class="plot"[^>]*src="data:image/png;base64,([^"]+)"', page.read_text()):
        img = mpimg.imread(io.BytesIO(base64.b64decode(b64)), format="png")
        out.append((img[..., :3] * 255).round().astype(int))
    return out


def test_a_reader_sees_the_verdict_first_and_four_drawn_plots(tmp_path: Path) -> None:
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA A100-SXM4-80GB", 0.2)  # the price file's A100 box
    page = tmp_path / "report.html"
    report("--db", str(db), "--format", "html", "--out", str(page), "--prices", str(PRICES))
    text = page.read_text()
    assert "<script" not in text and "http://" not in text.replace("http://x", "")  # self-contained
    v = seen(page, tmp_path)
    verdict = v["verdict"]
    assert v["verdict_top"] < 200 and v["verdict_bottom"] < 900, v  # on the first screen
    for says in ("MTBF 1.97 h (90 % interval", "planned downtime (recycles) 60 s", "Leak EngineCore host RSS: +20 MB/100",
                 "Leak EngineCore GPU: +10 MB/100", "out of memory in", "SLA: ", "interactive", "TTFT p50",
                 "throttled 13.8 %", "clock drop 15.2 %", "output tokens/kWh", "/M tokens", "3-year TCO"):
        assert says in verdict, (says, verdict)
    alts = [p["alt"] for p in v["plots"]]
    assert alts == ["GPU memory per process", "host memory per process", "latency over time",
                    "GPU temperature and clocks"], alts
    assert not v["missing"]
    for p in v["plots"]:
        assert p["w"] >= 800 and p["h"] >= 250 and p["shown_w"] >= 800, p  # decoded and laid out full width
    imgs = plot_images(page)
    for img, alt, color in zip(imgs, alts, ("tab:orange", "tab:orange", "tab:blue", "tab:red")):
        inked = (img.sum(axis=2) < 600).mean()
        assert inked > 0.02, (alt, inked)  # more than a frame: lines and points were drawn
        assert color_pixels(img, MPL_COLORS[color]) > 100, (alt, color)
    widths = {img.shape[1] for img in imgs}
    assert len(widths) == 1  # one size, one margin: the time axes line up


def test_compare_page_answers_first(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make_ledger(a, "NVIDIA GeForce RTX 4090", 0.3)
    make_ledger(b, "NVIDIA A100-SXM4-80GB", 0.1)
    page = tmp_path / "c.html"
    report("--compare", str(a), str(b), "--format", "html", "--out", str(page), "--prices", str(PRICES))
    v = seen(page, tmp_path)
    first = v["verdict"].splitlines()[0]
    assert first.startswith("B (NVIDIA A100-SXM4-80GB) is better"), first
    assert "leak engine_core host RSS: B grows slower (significant" in v["verdict"]
    assert "unplanned failures: no significant difference" in v["verdict"]
    assert not re.search(r"\([:,]", v["verdict"]), v["verdict"]  # every "(" opens words, not "(: " or "(, "
    assert v["verdict_top"] < 200
    assert len(v["plots"]) == 8 and all(p["w"] >= 800 for p in v["plots"])


def test_json_keeps_every_documented_key(tmp_path: Path) -> None:
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA H200", 0.2)
    f = json.loads(report("--db", str(db), "--format", "json"))
    doc = (ROOT / "docs" / "REPORTS.md").read_text()
    section = doc[doc.index("### JSON keys"):]
    section = section[:section.index("\n### ", 5)]
    keys = re.findall(r"^\| `([a-z0-9_.\[\]]+)` \|", section, re.M)
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
    assert c["verdict"]["overall"].startswith("B (NVIDIA A100-SXM4-80GB) is better")


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
