#!/usr/bin/env python3
"""Each request's first token, by what the replica's next generation was doing when it waited.

    python3 bench/ttft_by_phase.py RUN=DIR...

Each DIR holds one guarded run's ledger (`ledger.sqlite`, or `ledger.sqlite.xz` as docs/results/
keeps them). The runtime records every request's wait for its first token at the front door and
where each generation's start went; the report labels each wait with the moment it overlapped
(`report/tail.py`: a gap, an overlap's switch, a start beside the serving engine and its part).
`vllm-guard report` counts only the slowest 1 % by label. This prints every label's count and
TTFT p50 / p90 / p99, so two runs of one series can be set side by side part by part: did a lever
move the whole run, or one part of the start?
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np

from series_compare import named  # bench/, beside this script: NAME=DIR, one rule for both
from vllm_guard.report import ledgerread, tail

QUANTILES = (50, 90, 99)


def _die(msg: str) -> NoReturn:
    """A bad input: one line, exit 2 (as every usage error)."""
    print(f"ttft_by_phase: {msg}", file=sys.stderr)
    sys.exit(2)


def ledger_of(path: Path, scratch: Path) -> Path:
    """The run's ledger as a file sqlite can open (an .xz one is unpacked into `scratch`)."""
    for f in ([path] if path.is_file() else [path / "ledger.sqlite", path / "ledger.sqlite.xz"]):
        if f.is_file():
            if f.suffix != ".xz":
                return f
            out = scratch / f"{len(list(scratch.iterdir()))}.sqlite"
            with lzma.open(f) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            return out
    _die(f"{path}: no ledger.sqlite or ledger.sqlite.xz")


def by_phase(ledger: Path) -> dict[str, dict[str, float]]:
    """Label -> {n, p50, p90, p99} in ms; "all" is the whole run."""
    d = ledgerread.load(ledger)
    w = d.waits
    if w.ttft_s.size == 0:
        _die(f"{ledger}: no request with a first token recorded")
    kind, part, _, _ = tail.kinds_and_parts(w, d.runtime)  # the report's labels, per request
    key = np.array([f"{k}: {p}" if p else k for k, p in zip(kind.tolist(), part.tolist())])
    ttft = w.ttft_s * 1000.0

    def figures(x: np.ndarray) -> dict[str, float]:
        return {"n": int(x.size), **{f"p{q}": round(float(np.percentile(x, q)), 1) for q in QUANTILES}}

    out = {"all": figures(ttft)}
    for k in sorted(set(key.tolist())):
        out[k] = figures(ttft[key == k])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=named, metavar="RUN=DIR")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: by_phase(ledger_of(path, Path(tmp))) for name, path in a.runs}
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, rows in result.items():
        print(f"{name}: the guard's TTFT in ms, by what the next generation was doing")
        for label, f in rows.items():
            print(f"  {label:42s} n {f['n']:5d}   p50 {f['p50']:6.1f}   p90 {f['p90']:6.1f}   p99 {f['p99']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
