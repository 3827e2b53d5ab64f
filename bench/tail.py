"""The slowest first tokens at the front door, each beside what the runtime was doing then.

Is a run's TTFT tail the guard's or the traffic's? This reads a ledger the runtime wrote (every
request at the proxy, `edge_requests`; each generation with its start phases; recycles; crashes)
and, for the slowest requests, says what each one's wait (arrival to first token) overlapped:

- `gap`: a time without a serving generation (a gated or cold recycle's gap, or a crash until
  the service was restored);
- `switch`: an overlap's switch, from the moment new requests went to the new generation until
  the old generation's processes were gone (the two compute at once there);
- `standby`: another generation of the replica computing its start on the GPU beside the serving
  one (from its weights on until its engine is up), with the part it was in
  (`runtime/child/anatomy.py`: "compiling and profiling" is vLLM's profile run, "warming up" its
  graph capture);
- `beside`: the rest of such a start, with no GPU work of its own (imports and the API server
  before, parked at its gate, the API server after);
- `none`: none of these (the load, or vLLM itself).

The same shares over all requests are printed beside, so a kind of moment that is over-represented
in the tail stands out. Runs on a fresh clone against a committed GPU run (docs/BENCHMARKS.md,
eleventh series):

    .venv/bin/python bench/tail.py docs/results/h100-2026-12-07d/overlap80/ledger.sqlite.xz
    .venv/bin/python bench/tail.py LEDGER [--top N | --quantile 0.99] [--json]
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import lzma
import sqlite3
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_guard.runtime.child.anatomy import UNDER_WAY

KINDS = ("gap", "switch", "standby", "beside", "none")  # the order a request's wait is labelled in
GPU_FROM, GPU_TO = ("model_load_started", "weights_loaded"), "engine_up"  # a start's own GPU work


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    kind: str
    replica: int
    what: str
    phase: str = ""  # a start's part (standby, beside)


@dataclass(frozen=True)
class Slow:
    at: str
    replica: int
    generation: int | None
    ttft_ms: float
    kind: str
    what: str
    phase: str


def _epoch(s: str | None) -> float | None:
    return None if not s else dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def open_ledger(path: Path) -> sqlite3.Connection:
    """Read-only; an `.xz` copy (as results are committed) is unpacked to a temporary file."""
    if path.suffix == ".xz":
        tmp = tempfile.NamedTemporaryFile(suffix=".sqlite", delete=False)
        tmp.write(lzma.decompress(path.read_bytes()))
        tmp.close()
        path = Path(tmp.name)
        atexit.register(path.unlink, missing_ok=True)
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def windows(conn: sqlite3.Connection) -> list[Window]:
    """Every recorded moment of the runtime that a request may have waited through."""
    out: list[Window] = []
    gens = {(r[0], r[1]): r for r in conn.execute(
        "SELECT replica, generation, started_at, ready_at, ended_at, start_phases FROM generations")}
    for g, rep, ready, down, strategy, ended_old in conn.execute(
            "SELECT r.generation, r.replica, r.ready_at, r.downtime_s, r.strategy, g.ended_at FROM recycles r "
            "LEFT JOIN generations g ON g.generation = r.generation AND g.replica = r.replica"):
        t = _epoch(ready)
        if t is None:
            continue
        if down:
            out.append(Window(t - down, t, "gap", rep, f"{strategy} recycle of generation {g}: {down:.2f} s"))
        elif (e := _epoch(ended_old)) is not None and strategy == "overlap":
            out.append(Window(t, e, "switch", rep, f"overlap switch from generation {g} ({e - t:.2f} s)"))
    for g, kind, at, restored in conn.execute("SELECT generation, kind, at, restored_at FROM failures"):
        a, b = _epoch(at), _epoch(restored)
        rep = next((k[0] for k in gens if k[1] == g), 0)
        if a is not None:
            out.append(Window(a, b if b is not None else a, "gap", rep, f"{kind} of generation {g}"))
    for (rep, g), (_, _, started, ready, ended, phases) in gens.items():
        t0 = _epoch(started)
        serving = [(_epoch(o[3]), _epoch(o[4])) for k, o in gens.items() if k[0] == rep and k[1] != g]
        if t0 is None or not phases or not any(a is not None and a <= t0 and (b is None or b > t0)
                                               for a, b in serving):
            continue  # a first start, or one after a gap: nothing served beside it
        live = _epoch(ready) or _epoch(ended) or float("inf")
        marks = sorted((t0 + off, name) for name, off in json.loads(phases))
        at = {name: t for t, name in marks}
        gpu_from = min((at[n] for n in GPU_FROM if n in at), default=float("inf"))
        gpu_to = at.get(GPU_TO, live)
        for (a, name), (b, _) in zip(marks, marks[1:]):
            if a < live and name not in ("ready", "first_request"):
                kind, part = "standby" if gpu_from <= a < gpu_to else "beside", UNDER_WAY.get(name, name)
                out.append(Window(a, min(b, live), kind, rep, f"generation {g} starting: {part}", part))
    return out


def label(a: float, b: float, rep: int, ws: list[Window]) -> tuple[str, str, str]:
    """The first kind (KINDS order) of moment that [a, b] overlapped, what it was, and the part
    of a start (the first one's, where the wait spanned two)."""
    hits = [w for w in ws if w.replica == rep and w.start <= b and w.end >= a]
    for kind in KINDS[:-1]:
        mine = [w for w in hits if w.kind == kind]
        if mine:
            return kind, "; ".join(dict.fromkeys(w.what for w in mine)), mine[0].phase
    return "none", "", ""


@dataclass(frozen=True)
class Part:
    kind: str
    part: str
    tail: int
    all: int


@dataclass(frozen=True)
class Tail:
    requests: int
    slowest: int
    threshold_ms: float
    tail: dict[str, int]
    all: dict[str, int]
    parts: list[Part]
    rows: list[Slow]


def tail(conn: sqlite3.Connection, top: int | None, quantile: float) -> Tail:
    rows = conn.execute("SELECT arrived, replica, generation, ttft_s FROM edge_requests "
                        "WHERE ttft_s IS NOT NULL ORDER BY ttft_s DESC").fetchall()
    if not rows:
        raise sqlite3.DatabaseError("no request with a first token in edge_requests")
    n = top if top is not None else max(1, round(len(rows) * (1.0 - quantile)))
    ws = windows(conn)
    labels = [label(a, a + t, rep or 0, ws) for a, rep, _, t in rows]
    slow = [Slow(_utc(a), rep or 0, g, round(t * 1000, 1), *lab) for (a, rep, g, t), lab in zip(rows[:n], labels)]
    every, kinds = Counter(k for k, _, _ in labels), Counter(s.kind for s in slow)
    parts_all = Counter((k, p) for k, _, p in labels if p)
    parts_tail = Counter((s.kind, s.phase) for s in slow if s.phase)
    return Tail(len(rows), len(slow), slow[-1].ttft_ms, {k: kinds[k] for k in KINDS}, {k: every[k] for k in KINDS},
                [Part(k, p, parts_tail[(k, p)], c) for (k, p), c in sorted(parts_all.items())], slow)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ledger", type=Path, help="a ledger (ledger.sqlite, or a committed .xz copy)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--top", type=int, help="the N slowest first tokens")
    g.add_argument("--quantile", type=float, default=0.99, help="those at or above this quantile (default 0.99)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not a.ledger.is_file():
        p.error(f"{a.ledger}: no such file")
    if a.top is not None and a.top < 1 or not 0.0 < a.quantile < 1.0:
        p.error("--top must be ≥ 1 and --quantile between 0 and 1")
    try:
        r = tail(open_ledger(a.ledger), a.top, a.quantile)
    except (sqlite3.DatabaseError, lzma.LZMAError) as e:
        p.error(f"{a.ledger}: not a ledger the runtime wrote ({e})")
    if a.json:
        print(json.dumps(asdict(r), indent=2))
        return
    n, tot = r.slowest, r.requests
    print(f"{n} slowest first tokens of {tot} (≥ {r.threshold_ms} ms), and what the runtime was doing while each waited:")
    for s in r.rows:
        print(f"  {s.at}  replica {s.replica} gen {s.generation}  {s.ttft_ms:7.1f} ms  {s.kind:8s} {s.what}")
    print("kind      tail            all requests")
    for k in KINDS:
        print(f"  {k:8s}{r.tail[k]:4d} ({100 * r.tail[k] / n:5.1f} %)  {r.all[k]:6d} ({100 * r.all[k] / tot:5.1f} %)")
    print("a start's part (standby, beside)")
    for x in r.parts:
        print(f"  {x.kind:8s}{x.tail:4d} ({100 * x.tail / n:5.1f} %)  {x.all:6d} ({100 * x.all / tot:5.1f} %)  {x.part}")


if __name__ == "__main__":
    main()
