"""Real ledgers for the example reports: the guard, the watchdog and the soak on one box.

Each box is `vllm-guard serve` (an injected EngineCore host leak, `--max-requests` recycles), a
`vllm-guard watchdog` beside it (its memory forecast may recycle too), and `vllm-guard soak`
driving open-loop load into the ledger. During the soak a client cancels streams for a while
(client disconnects, for the leak attribution) and, on boxes that ask for it, the EngineCore is
killed once (a real crash: an unplanned failure). Then the reports and their screenshots:

    flock /tmp/vllm-guard-cpu.lock .venv/bin/python bench/make_example_ledgers.py \
        [--model DIR] [--out docs/examples] [--keep DIR]

Without `--model` the embedded tiny model is built into a temporary dir. On a GPU box pass
`--model` and `--vllm-args` for the real model; the ledgers are copied to `--keep` (default: a
temporary dir, printed). The steady box has no injected leak (its report must forecast no out of
memory); the leaky one leaks 0.4 MB per request in EngineCore (its report must). Writes `<out>/report-<box>.{html,txt,json,png}` and
`<out>/compare.{html,txt,json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinymodel import tiny_model  # noqa: E402

BIN = Path(sys.executable).parent
GUARD = [str(BIN / "vllm-guard")] if (BIN / "vllm-guard").exists() else [sys.executable, "-m", "vllm_guard.cli"]
CPU_VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16"]
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Box:
    name: str
    leak_mb: float  # injected EngineCore host leak per finished request
    max_requests: int
    crash_at: float | None  # kill -9 the EngineCore after this share of the soak's requests
    rate: float  # soak requests per second
    requests: int
    cancel_window: tuple[float, float] = (0.3, 0.55)  # share of the soak during which a client cancels


# Sized for a 2-core box shared with other work: both boxes, reports and screenshots in ~20 min.
BOXES = (
    Box("leaky", leak_mb=0.4, max_requests=350, crash_at=0.7, rate=4.0, requests=900),
    Box("steady", leak_mb=0.0, max_requests=700, crash_at=None, rate=4.0, requests=900),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(state: Path) -> dict[str, Any]:
    out = subprocess.run([*GUARD, "status", "--state-dir", str(state), "--json"], capture_output=True, text=True,
                         timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(1.0)
    raise TimeoutError(what)


def watchdog_toml(path: Path, port: int) -> None:
    path.write_text("[watchdog]\n"
                    'interval = "1s"\n'
                    'drift_every = "5s"\n'
                    'kernel = "off"\n'
                    'probe_interval = "15s"\n'
                    f"prometheus_port = {port}\n")


async def canceller(url: str, stop_at: float, concurrency: int = 2) -> int:
    """Streams that the client closes after the first chunk: client disconnects in the ledger."""
    import aiohttp

    done = 0
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(i: int) -> None:
            nonlocal done
            body = {"model": model, "prompt": f"cancel me {i}", "max_tokens": 64, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            try:
                async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    async for _ in r.content:
                        break  # the first chunk: hang up
                done += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass

        i = 0
        while time.monotonic() < stop_at:
            await asyncio.gather(*(one(i + k) for k in range(concurrency)))
            i += concurrency
            await asyncio.sleep(0.2)
    return done


def soak_requests_done(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return int(c.execute("SELECT COUNT(*) FROM requests").fetchone()[0])
    except sqlite3.Error:
        return 0


def run_box(box: Box, model: str, vllm_args: list[str], root: Path) -> Path:
    state = root / box.name
    state.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **CHILD_ENV, "VLLM_GUARD_INJECT": f"host_leak_mb_per_request={box.leak_mb}"}
    logs = {n: open(state / f"{n}.log", "ab") for n in ("guard", "watchdog", "soak")}  # noqa: SIM115
    guard = subprocess.Popen([*GUARD, "serve", "--model", model, "--port", str(port), "--state-dir", str(state),
                              "--max-requests", str(box.max_requests), "--", *vllm_args],
                             stdout=logs["guard"], stderr=subprocess.STDOUT, env=env)
    procs = [guard]
    try:
        wait_until(lambda: status(state).get("state") == "serving", 900, f"{box.name}: not serving")
        wd_cfg = state / "watchdog.toml"
        watchdog_toml(wd_cfg, free_port())
        procs.append(subprocess.Popen([*GUARD, "watchdog", "--config", str(wd_cfg), "--state-dir", str(state)],
                                      stdout=logs["watchdog"], stderr=subprocess.STDOUT, env=env))
        time.sleep(5)
        db = state / "ledger.sqlite"
        soak = subprocess.Popen([*GUARD, "soak", "--url", url, "--db", str(db), "--state-dir", str(state),
                                 "--scenario", "custom", "--prompt-tokens", "48", "--output-tokens", "12",
                                 "--rate", str(box.rate), "--requests", str(box.requests), "--concurrency", "8",
                                 "--duration", "2h", "--no-progress", "--seed", "1"],
                                stdout=logs["soak"], stderr=subprocess.STDOUT, env=env)
        procs.append(soak)
        lo, hi = box.cancel_window
        wait_until(lambda: soak_requests_done(db) >= lo * box.requests or soak.poll() is not None, 3600, "cancel")
        n = asyncio.run(canceller(url, time.monotonic() + (hi - lo) * box.requests / box.rate))
        print(f"{box.name}: {n} streams cancelled by the client", flush=True)
        if box.crash_at is not None:
            wait_until(lambda: soak_requests_done(db) >= box.crash_at * box.requests or soak.poll() is not None,
                       3600, "crash point")
            st = status(state)
            eng = [c["pid"] for c in st.get("children", []) if c["role"] == "engine_core"]
            if eng:
                os.kill(eng[0], signal.SIGKILL)
                print(f"{box.name}: killed EngineCore pid {eng[0]} in generation {st['generation']}", flush=True)
        soak.wait(3 * 3600)
        time.sleep(5)  # a few more watchdog ticks
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in logs.values():
            f.close()
    out = root / f"{box.name}.sqlite"
    with sqlite3.connect(state / "ledger.sqlite") as src, sqlite3.connect(out) as dst:
        src.backup(dst)  # one file, WAL folded in
    return out


def report(out: Path, name: str, *args: str) -> None:
    for fmt in ("html", "json", "text"):
        ext = "txt" if fmt == "text" else fmt
        subprocess.run([*GUARD, "report", *args, "--format", fmt, "--out", str(out / f"{name}.{ext}")], check=True)
    screenshot(out / f"{name}.html", out / f"{name}.png")


def screenshot(page: Path, png: Path, height: int = 2200) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium: no screenshot", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as prof:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--no-first-run", f"--user-data-dir={prof}", f"--window-size=1200,{height}",
                        f"--screenshot={png}", page.resolve().as_uri()], capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model dir (default: $VLLM_GUARD_TINY_MODEL, else the embedded tiny model, built now)")
    ap.add_argument("--vllm-args", default=" ".join(CPU_VLLM_ARGS), help="arguments for vLLM (one string)")
    ap.add_argument("--out", default="docs/examples")
    ap.add_argument("--keep", default=None, help="where the ledgers go (default: a new temporary dir)")
    ap.add_argument("--boxes", default=",".join(b.name for b in BOXES))
    ap.add_argument("--reports-only", action="store_true", help="reuse the ledgers in --keep")
    ap.add_argument("--prices", default="docs/examples/prices-field-report.toml")
    a = ap.parse_args()
    if not a.reports_only:
        a.model = tiny_model(a.model)
    root = Path(a.keep or tempfile.mkdtemp(prefix="vllm-guard-example-"))
    root.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.boxes.split(",")
    dbs = []
    for box in BOXES:
        if box.name not in names:
            continue
        db = root / f"{box.name}.sqlite"
        if not a.reports_only:
            t0 = time.monotonic()
            db = run_box(box, a.model, a.vllm_args.split(), root)
            print(f"{box.name}: ledger {db} in {time.monotonic() - t0:.0f} s", flush=True)
        dbs.append(db)
    prices = ["--prices", a.prices] if a.prices and Path(a.prices).exists() else []
    for name, db in zip([b.name for b in BOXES if b.name in names], dbs):
        report(out, f"report-{name}", "--db", str(db), *prices)
    if len(dbs) == 2:
        report(out, "compare", "--compare", str(dbs[0]), str(dbs[1]), *prices)
    print(f"ledgers in {root}; reports in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
