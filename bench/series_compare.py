#!/usr/bin/env python3
"""A run's TTFT tail against plain vLLM's, with the interval the sample size allows.

    python3 bench/series_compare.py --base plain=DIR [--base plain2=DIR] RUN=DIR...

Each DIR holds vLLM's benchmark result of one run (`vllm_bench.json` or `vllm_bench.json.xz`, as
`bench/gpu_serving.py` writes and docs/results/ keeps them). For every RUN against every base, and
against the bases pooled, it prints the ratio of the TTFT quantile (`--q`, default p99) and a
bootstrap interval of that ratio; the bases against each other are the A/A control.

Why an interval: at 10 req/s a run of 900-1 200 requests has its p99 in its 9-12 slowest, and two
runs of plain vLLM minutes apart on one card differed by 1.33x. An aim such as "p99 <= 1.1x plain"
is decided by one run only when the interval lies on one side of it.

Requests are not independent samples: those of the same few seconds share batches, a recycle, a
standby's start. So the bootstrap resamples blocks of `--block-s` seconds of arrival (default 5 s)
with replacement, each side on its own, `--boot` times (seeded), and reads the ratio's interval at
`--level` (default 0.95).
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np


@dataclass(frozen=True)
class Run:
    name: str
    ttft_ms: np.ndarray  # per completed request
    block: np.ndarray  # the arrival block of each request (int)


@dataclass(frozen=True)
class Ratio:
    a: str
    b: str
    qa: float
    qb: float
    ratio: float
    low: float
    high: float


def _die(msg: str) -> NoReturn:
    """A bad input: one line, exit 2 (as every usage error)."""
    print(f"series_compare: {msg}", file=sys.stderr)
    sys.exit(2)


def load(name: str, path: Path, block_s: float) -> Run:
    """One run's completed requests: TTFT and arrival block, from vLLM's benchmark result."""
    f = path / "vllm_bench.json" if path.is_dir() else path
    if not f.exists() and f.with_suffix(".json.xz").exists():
        f = f.with_suffix(".json.xz")
    if not f.exists():
        _die(f"{name}: no vllm_bench.json(.xz) at {path}")
    opener = lzma.open if f.suffix == ".xz" else open
    with opener(f, "rt") as fh:
        res = json.load(fh)
    ttfts = np.asarray(res.get("ttfts") or [], dtype=float)
    starts = np.asarray(res.get("start_times") or [], dtype=float)
    if len(ttfts) == 0 or len(starts) != len(ttfts):
        _die(f"{name}: {f} has no per-request ttfts and start_times (vLLM's benchmark with --save-detailed)")
    done = ttfts > 0  # vLLM's benchmark writes 0 for a request that failed
    blocks = np.floor((starts - starts.min()) / block_s).astype(int)
    return Run(name, ttfts[done] * 1000.0, blocks[done])


def boot_quantiles(run: Run, q: float, boot: int, rng: np.random.Generator) -> np.ndarray:
    """The quantile of `boot` block-resampled copies of the run."""
    ids = np.unique(run.block)
    groups = [run.ttft_ms[run.block == i] for i in ids]
    out = np.empty(boot)
    for k in range(boot):
        pick = rng.integers(0, len(groups), len(groups))
        out[k] = np.percentile(np.concatenate([groups[i] for i in pick]), q)
    return out


def ratio(a: Run, b: Run, q: float, boot: int, level: float, rng: np.random.Generator) -> Ratio:
    qa, qb = float(np.percentile(a.ttft_ms, q)), float(np.percentile(b.ttft_ms, q))
    r = boot_quantiles(a, q, boot, rng) / boot_quantiles(b, q, boot, rng)
    lo, hi = np.percentile(r, [50 * (1 - level), 50 * (1 + level)])
    return Ratio(a.name, b.name, qa, qb, qa / qb, float(lo), float(hi))


def pooled(runs: list[Run]) -> Run:
    """Several runs as one sample; their blocks kept apart."""
    off, blocks = 0, []
    for r in runs:
        blocks.append(r.block + off)
        off += int(r.block.max()) + 1
    return Run("+".join(r.name for r in runs), np.concatenate([r.ttft_ms for r in runs]), np.concatenate(blocks))


def named(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {spec!r}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=named, metavar="RUN=DIR")
    p.add_argument("--base", action="append", type=named, required=True, metavar="NAME=DIR",
                   help="plain vLLM's run(s) of the same series; give two for the A/A control")
    p.add_argument("--q", type=float, default=99.0, help="the TTFT quantile, in percent (default 99)")
    p.add_argument("--block-s", type=float, default=5.0, help="seconds of arrival per bootstrap block")
    p.add_argument("--boot", type=int, default=2000)
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--aim", type=float, default=1.1, help="the ratio an aim allows (default 1.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = p.parse_args(argv)
    if not 0 < a.q < 100 or not 0 < a.level < 1 or a.block_s <= 0 or a.boot < 100:
        p.error("--q in (0, 100), --level in (0, 1), --block-s > 0, --boot >= 100")
    rng = np.random.default_rng(a.seed)
    bases = [load(n, d, a.block_s) for n, d in a.base]
    runs = [load(n, d, a.block_s) for n, d in a.runs]
    controls: list[Ratio] = []
    for i, first in enumerate(bases):
        for later in bases[i + 1:]:
            controls.append(ratio(later, first, a.q, a.boot, a.level, rng))
    pairs: list[Ratio] = []
    against = bases + ([pooled(bases)] if len(bases) > 1 else [])
    for run in runs:
        for base in against:
            pairs.append(ratio(run, base, a.q, a.boot, a.level, rng))
    if a.json:
        print(json.dumps({"q": a.q, "level": a.level, "block_s": a.block_s, "aim": a.aim,
                          "n": {r.name: len(r.ttft_ms) for r in bases + runs},
                          "controls": [vars(x) for x in controls], "ratios": [vars(x) for x in pairs]}, indent=1))
        return 0
    print(f"TTFT p{a.q:g}, {a.level:.0%} interval of the ratio (block bootstrap, {a.block_s:g} s blocks, "
          f"{a.boot} replicates); requests: " + ", ".join(f"{r.name} {len(r.ttft_ms)}" for r in bases + runs))
    for x in controls:
        same = x.low <= 1.0 <= x.high
        print(f"  {x.a:>14} / {x.b:<14} {x.qa:7.1f} / {x.qb:7.1f} ms = {x.ratio:5.2f}x "
              f"[{x.low:4.2f}, {x.high:4.2f}]  A/A control: " + (
                  "within each run's own sampling" if same else
                  "the two plain runs differ beyond each run's sampling: read every interval below as too narrow"))
    for x in pairs:
        if x.high <= a.aim:
            verdict = f"<= {a.aim:g}x: met"
        elif x.low > a.aim:
            verdict = f"> {a.aim:g}x: missed"
        else:
            verdict = f"{a.aim:g}x inside the interval: this sample cannot tell"
        print(f"  {x.a:>14} / {x.b:<14} {x.qa:7.1f} / {x.qb:7.1f} ms = {x.ratio:5.2f}x "
              f"[{x.low:4.2f}, {x.high:4.2f}]  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
