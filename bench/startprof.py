#!/usr/bin/env python3
"""Read the samples of `bench/startprof/` for one window of a start: where its seconds went.

    python3 bench/startprof.py PROF_DIR --log SERVER_LOG [--generation N] [--top 40]
    python3 bench/startprof.py PROF_DIR --since T0 --until T1 [--pid PID ...]

With `--log` (the guard's JSON log) the window is a gated generation's `gate_opened` →
`generation_ready` and the processes are that generation's (its API server and EngineCore, from
`generation_ready`'s children). Per process: inclusive seconds per function (file:function),
the innermost vLLM frame per 100 ms as a timeline, and `PID.collapsed` (flame-graph input) in
PROF_DIR. Each sampling interval goes to the stack seen at its start.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from datetime import datetime
from pathlib import Path


def load(path: Path) -> tuple[str, dict[int, list[str]], list[tuple[float, int]]]:
    head, stacks, samples = "", {}, []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("#"):
            head = line
        elif line.startswith("S "):
            _, sid, text = line.split(" ", 2)
            stacks[int(sid)] = text.split(";")
        elif line:
            t, sid = line.split()
            samples.append((float(t), int(sid)))
    return head, stacks, samples


def window(samples: list[tuple[float, int]], t0: float, t1: float) -> list[tuple[float, int]]:
    """(seconds, stack id) per interval inside [t0, t1]."""
    out = []
    for (ta, sid), (tb, _) in zip(samples, samples[1:]):
        a, b = max(ta, t0), min(tb, t1)
        if b > a:
            out.append((b - a, sid))
    return out


def func(frame: str) -> str:
    return frame.rsplit(":", 1)[0]


def inner_vllm(stack: list[str]) -> str:
    for frame in reversed(stack):
        if frame.startswith(("vllm/", "vllm_guard/")):
            return frame
    return stack[-1] if stack else "?"


def report(path: Path, t0: float, t1: float, top: int) -> None:
    head, stacks, samples = load(path)
    parts = window(samples, t0, t1)
    total = sum(w for w, _ in parts)
    print(f"\n== {path.name} {head[:200]}\n   sampled {total:.2f} s of the {t1 - t0:.2f} s window")
    incl: dict[str, float] = defaultdict(float)
    collapsed: dict[str, float] = defaultdict(float)
    for w, sid in parts:
        st = stacks[sid]
        for name in {func(f) for f in st}:
            incl[name] += w
        collapsed[";".join(func(f) for f in st)] += w
    for name, w in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {w:7.3f} s  {name}")
    (path.parent / f"{path.stem}.collapsed").write_text(
        "".join(f"{k} {int(v * 1e6)}\n" for k, v in sorted(collapsed.items())))
    print("   timeline (innermost vLLM frame, 100 ms bins; s after the window's start):")
    last, since = None, 0.0
    bins: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    t = t0
    for (ta, sid), (tb, _) in zip(samples, samples[1:]):
        a, b = max(ta, t0), min(tb, t1)
        if b > a:
            bins[int((a - t0) * 10)][inner_vllm(stacks[sid])] += b - a
    for i in sorted(bins):
        name = max(bins[i].items(), key=lambda kv: kv[1])[0]
        if name != last:
            if last is not None:
                print(f"   {since:6.1f}-{i / 10:5.1f}  {last}")
            last, since = name, i / 10
    if last is not None:
        print(f"   {since:6.1f}-{t1 - t0:5.1f}  {last}")
    del t


def iso(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prof_dir", type=Path)
    ap.add_argument("--log", type=Path, help="the guard's JSON log")
    ap.add_argument("--generation", type=int, action="append")
    ap.add_argument("--since", type=float)
    ap.add_argument("--until", type=float)
    ap.add_argument("--pid", type=int, action="append")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.log:
        gates: dict[int, float] = {}
        for line in a.log.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            if ev.get("event") == "gate_opened":
                gates[int(ev["generation"])] = iso(ev["timestamp"])
            if ev.get("event") == "generation_ready" and int(ev["generation"]) in gates:
                g = int(ev["generation"])
                if a.generation and g not in a.generation:
                    continue
                t0, t1 = gates[g], iso(ev["timestamp"])
                print(f"\n#### generation {g}: gate opened → ready {t1 - t0:.2f} s")
                for child in ev.get("children", []):
                    p = a.prof_dir / f"{child['pid']}.prof"
                    if p.exists():
                        print(f"--- {child['role']}")
                        report(p, t0, t1, a.top)
        return 0
    if a.since is None or a.until is None:
        ap.error("give --log, or --since and --until")
    for pid in a.pid or [int(p.stem) for p in a.prof_dir.glob("*.prof")]:
        report(a.prof_dir / f"{pid}.prof", a.since, a.until, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
