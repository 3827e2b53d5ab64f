"""The report's three formats on one synthetic-but-complete ledger: the HTML opens in headless
Chromium and its plots render (pixels checked); the JSON keeps the keys docs/REPORTS.md lists;
--compare puts two ledgers side by side. A missing browser fails, it does not skip."""

from __future__ import annotations

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
from ledgers import Box, add_soak, add_watchdog, runtime_ledger
from vllm_guard.core import ledger as L

MPL_COLORS = {"tab:blue": (31, 119, 180), "tab:orange": (255, 127, 14), "tab:red": (214, 39, 40),
              "tab:green": (44, 160, 44)}
PRICES = ROOT / "docs" / "examples" / "prices-field-report.toml"


def make_ledger(path: Path, gpu: str, leak_mb: float, soak: bool = True, watchdog: bool = True,
                ttft_s: float = 0.04, seed: int = 0) -> None:
    """The runtime's rows (two generations, a recycle, a crash, every request at the proxy, its
    memory readings), with the watchdog's ticks and a soak unless told not to."""
    box = Box(gpu=gpu, leak_mb=leak_mb, gpu_leak_mb=leak_mb / 2, ttft_s=ttft_s, seed=seed)
    base = runtime_ledger(path, box)
    if watchdog:
        add_watchdog(path, base, box)
    if soak:
        add_soak(path, base, box)


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
                                    .map(p => p.innerText),
                                    sections: [...document.querySelectorAll("h2[id]")].map(h => h.id),
                                    tables: [...document.querySelectorAll("table.figures")].map(
                                      t => ({cls: t.className, rows: t.rows.length})),
                                    text: document.body.innerText});
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


def _drawn(img: np.ndarray, alt: str, color: str) -> None:
    inked = (img.sum(axis=2) < 600).mean()
    assert inked > 0.02, (alt, inked)  # more than a frame: lines and points were drawn
    assert color_pixels(img, MPL_COLORS[color]) > 100, (alt, color)


PLOTS = {"GPU memory per process": "tab:orange", "host memory per process": "tab:orange",
         "latency over time": "tab:blue", "throughput over time": "tab:blue", "GPU temperature and clocks": "tab:red"}
SECTIONS = ["reliability", "memory", "sla", "latency", "tail", "throughput", "cost", "thermals"]


def test_runtime_rows_alone_answer_every_section(tmp_path: Path) -> None:
    """No soak ever ran and no watchdog: the runtime's own rows (every request at its proxy, its
    memory readings, its generations) answer the five questions in the first lines, and every
    section has its figures and plots (thermals excepted: they are the watchdog's)."""
    db = tmp_path / "prod.sqlite"
    make_ledger(db, "NVIDIA A100-SXM4-80GB", 0.2, soak=False, watchdog=False)
    conn = L.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 0  # no soak
    assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0  # no watchdog
    conn.close()
    page = tmp_path / "prod.html"
    report("--db", str(db), "--format", "html", "--out", str(page), "--prices", str(PRICES))
    v = seen(page, tmp_path)
    lines = v["verdict"].splitlines()[1:]
    assert v["verdict_top"] < 200
    five = ("MTBF 1.97 h (90 % interval", "Availability ", "Leak EngineCore host RSS: leaks +20",
            "Out of memory: first EngineCore", "SLA: interactive in every hour (TTFT, runtime requests)",
            "Cost: ")
    at = [next((i for i, line in enumerate(lines) if line.startswith(says)), None) for says in five]
    assert None not in at and at == sorted(at) and at[-1] < 8, (at, lines)  # the five answers first, in order
    verdict = v["verdict"]
    for says in ("planned downtime (recycles) 60 s", "Leak EngineCore GPU: leaks +10", "per million output tokens",
                 "3-year TCO", "Traffic (runtime): ", "TTFT p50"):
        assert says in verdict, (says, verdict)
    assert "soak" not in v["text"].lower().replace("no soak ran on this ledger", "").replace("soak_", ""), (
        [x for x in v["text"].splitlines() if "soak" in x.lower()])
    assert "no soak ran on this ledger" not in verdict
    assert v["sections"] == SECTIONS, v["sections"]
    tables = {t["cls"].split()[-1]: t["rows"] for t in v["tables"]}
    assert tables["reliability"] >= 2 and tables["leaks"] >= 5 and tables["sla"] == 3 and tables["latency"] == 4
    alts = [p["alt"] for p in v["plots"]]
    assert alts == list(PLOTS)[:4], alts
    assert v["missing"] == ["GPU temperature and clocks: no watchdog samples table in this ledger"] or \
        v["missing"][0].startswith("GPU temperature and clocks: no"), v["missing"]
    for img, alt in zip(plot_images(page), alts):
        _drawn(img, alt, PLOTS[alt])
    f = json.loads(report("--db", str(db), "--format", "json", "--prices", str(PRICES)))
    assert f["traffic"]["source"] == "runtime" and f["leak"]["source"] == "runtime" and f["sla"]["source"] == "runtime"
    assert f["soak"]["present"] is False and f["traffic"]["output_tokens"] > 0
    assert f["cost"]["per_million_tokens"]["cost"] > 0 and "usage records" in f["cost"]["tokens_from"]


def test_a_reader_sees_the_verdict_first_and_every_plot_drawn(tmp_path: Path) -> None:
    """The runtime, the watchdog and a soak on one ledger: the soak is shown and labelled as
    the load generator's own view; thermals from the watchdog."""
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA A100-SXM4-80GB", 0.2)  # the price file's A100 box
    page = tmp_path / "report.html"
    report("--db", str(db), "--format", "html", "--out", str(page), "--prices", str(PRICES))
    text = page.read_text()
    assert "<script" not in text and "http://" not in text.replace("http://x", "")  # self-contained
    v = seen(page, tmp_path)
    verdict = v["verdict"]
    assert v["verdict_top"] < 200 and v["verdict_bottom"] < 1400, v  # it starts on the first screen
    for says in ("MTBF 1.97 h (90 % interval", "planned downtime (recycles) 60 s", "Leak EngineCore host RSS: leaks +20",
                 "Leak EngineCore GPU: leaks +10", "out of memory in", "SLA: ", "interactive", "TTFT p50",
                 "throttled 13.8 %", "clock drop 15.2 %", "output tokens/kWh", "per million output tokens",
                 "3-year TCO", "Soak (its own client view): 1500 requests"):
        assert says in verdict, (says, verdict)
    alts = [p["alt"] for p in v["plots"]]
    assert alts == list(PLOTS), alts
    assert not v["missing"]
    assert "soak" in v["sections"] or "Soak (the load generator's own view" in v["text"]
    for p in v["plots"]:
        assert p["w"] >= 800 and p["h"] >= 250 and p["shown_w"] >= 800, p  # decoded and laid out full width
    imgs = plot_images(page)
    for img, alt in zip(imgs, alts):
        _drawn(img, alt, PLOTS[alt])
    widths = {img.shape[1] for img in imgs}
    assert len(widths) == 1  # one size, one margin: the time axes line up


def test_compare_page_answers_first(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make_ledger(a, "NVIDIA GeForce RTX 4090", 0.3, ttft_s=0.06)
    make_ledger(b, "NVIDIA A100-SXM4-80GB", 0.1, seed=1)
    page = tmp_path / "c.html"
    report("--compare", str(a), str(b), "--format", "html", "--out", str(page), "--prices", str(PRICES))
    v = seen(page, tmp_path)
    first = v["verdict"].splitlines()[0]
    assert first.startswith("B (NVIDIA A100-SXM4-80GB) is better"), first
    assert "leak engine_core host RSS: B grows slower (both leak; significant" in v["verdict"]
    assert "TTFT median: B is better" in v["verdict"]
    assert "unplanned failures: no difference" in v["verdict"]
    assert not re.search(r"\([:,]", v["verdict"]), v["verdict"]  # every "(" opens words, not "(: " or "(, "
    assert v["verdict_top"] < 200
    assert len(v["plots"]) == 10 and all(p["w"] >= 800 for p in v["plots"])


def test_same_box_twice_is_no_difference(tmp_path: Path) -> None:
    """Two runs of one box (another random seed, TTFT 2 % apart): many minutes, so the block
    bootstrap may call tiny differences significant; they are not practical: no difference."""
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make_ledger(a, "NVIDIA H200", 0.0, soak=False, watchdog=False, ttft_s=0.040)
    make_ledger(b, "NVIDIA H200", 0.0, soak=False, watchdog=False, ttft_s=0.0408, seed=7)
    c = json.loads(report("--compare", str(a), str(b), "--format", "json"))
    assert c["verdict"]["overall"].startswith("No difference"), c["verdict"]
    ttft = next(x for x in c["verdict"]["lines"] if x["figure"] == "TTFT median")
    assert ttft["better"] is None and ttft["practical"] is False, ttft
    assert re.search(r"block bootstrap over 1[12]\d and 1[12]\d per-minute blocks", ttft["test"]), ttft
    assert abs(ttft["difference_pct"] - 2.0) < 1.5, ttft  # the true 2 %, not a bucket step


def test_the_same_gpu_example_says_no_difference() -> None:
    """24 GiB vs 80 GiB budgets on one H200, 1.8 minutes each (docs/examples/compare-24g-vs-80g-h200):
    a per-request Mann-Whitney called TTFT 39.3 vs 41.0 ms "significant"; minutes are the unit
    that can be resampled, and three per side tell nothing: no difference."""
    e = ROOT / "docs" / "results" / "h200-2026-11-30" / "example-ledgers"
    c = json.loads(report("--compare", str(e / "rtx4090-24g.sqlite"), str(e / "a100-80g.sqlite"), "--format", "json",
                          "--prices", str(PRICES)))
    assert c["verdict"]["overall"].startswith("No difference"), c["verdict"]["overall"]
    ttft = next(x for x in c["verdict"]["lines"] if x["figure"] == "TTFT median")
    assert "too few minutes to tell" in ttft["text"] and ttft["better"] is None
    shipped = (ROOT / "docs" / "examples" / "compare-24g-vs-80g-h200.txt").read_text()
    assert "\nNo difference at 90% and 5 % on any tested figure" in shipped


def test_json_keeps_every_documented_key(tmp_path: Path) -> None:
    db = tmp_path / "a.sqlite"
    make_ledger(db, "NVIDIA H200", 0.2)
    f = json.loads(report("--db", str(db), "--format", "json", "--prices", str(PRICES)))
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
    assert f["schema"] == "vllm-guard-report/2"
    assert f["service"]["recycles"]["list"][0]["trigger"] == "max_requests"
    eng = next(p for p in f["leak"]["processes"] if p["role"] == "engine_core" and p["metric"] == "rss_mb")
    assert eng["per_100_requests"]["slope"] == pytest.approx(20.0, rel=0.05) and eng["leak"] is True
    g = f["thermal"]["gpus"][0]
    assert g["throttled_share_by_reason"]["sw_thermal"] == pytest.approx(33 / 240, abs=0.01)
    assert g["max_temp_c"] > 75 and g["clock_drop_pct"] == pytest.approx(100 * (1 - 1680 / 1980), abs=0.1)
    assert f["soak"]["errors"] == {"http_503_recycle": 15} and f["soak"]["requests"] == 1500
    assert f["traffic"]["requests"] == 3540 + 3540 and f["traffic"]["source"] == "runtime"  # one per second served


def test_compare_two_ledgers_side_by_side(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make_ledger(a, "NVIDIA GeForce RTX 4090", 0.3, soak=False)
    make_ledger(b, "NVIDIA A100-SXM4-80GB", 0.1, soak=False, seed=1)
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
        make_ledger(db, "NVIDIA H200", 0.3, soak=False)
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
