"""`vllm-guard report`: argument parsing and wiring, nothing more.

numpy, scipy, matplotlib and pydantic are imported inside the handler, so `vllm-guard --help`
stays fast. A file that is not a ledger, a `--run-id` it lacks, or an `--out` that cannot be
written is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_guard.core.errors import ConfigError, UsageError

Handler = Callable[[argparse.Namespace, list[str]], int]


def add_commands(sub: Any) -> dict[str, Handler]:
    r = sub.add_parser("report", help="MTBF, leaks, thermals, latency and errors from a ledger",
                       description="Figures from a ledger (the runtime's, the watchdog's and the soak's tables) as "
                                   "text, JSON or one self-contained HTML file. Opens the ledger read-only.")
    r.add_argument("--db", action="append", default=None,
                   help="ledger file or state dir (default: the state dir's ledger); given more than once, or a "
                        "directory of ledgers: one fleet report (pooled per GPU model)")
    r.add_argument("--state-dir", default=None,
                   help="the guard's state dir (default: $VLLM_GUARD_STATE_DIR, the installed guard's, ./.state)")
    r.add_argument("--format", choices=["text", "json", "html"], default="text", help="output format (default text)")
    r.add_argument("--out", default=None, help="file to write (default: stdout)")
    r.add_argument("--compare", nargs=2, metavar=("A.db", "B.db"), default=None,
                   help="two ledgers side by side")
    r.add_argument("--run-id", type=int, default=None,
                   help="the soak run its section shows (default: all runs; the runtime's traffic is every request)")
    r.add_argument("--confidence", type=float, default=0.90,
                   help="level of the MTBF bounds and the --compare tests, in (0, 1) (default 0.90; leak "
                        "intervals are the leak rule's 95 %%)")
    r.add_argument("--prices", default=None,
                   help="price file (TOML: card, host, power price, operations) for $/M tokens and the TCO")
    r.add_argument("--sla", default=None, metavar="TIER=BOUND,...",
                   help="SLA tiers as P99 bounds, strictest first (default interactive=500ms,batch=5s,offline=none)")
    r.add_argument("--sla-latency", choices=["ttft", "e2e", "ttft_sched", "e2e_sched"], default="ttft",
                   help="the latency the SLA tiers bound (default ttft)")
    return {"report": cmd_report}


def _ledger(args: argparse.Namespace) -> str:
    if args.db:
        return str(args.db[0])
    from vllm_guard.core.ledger import LEDGER_NAME
    from vllm_guard.core.paths import resolve_state_dir

    return str(Path(resolve_state_dir(args.state_dir)[0]) / LEDGER_NAME)


def _is_fleet_dir(db: str) -> bool:
    """A directory that is not a state dir (no ledger.sqlite in it): a directory of ledgers."""
    from vllm_guard.core.ledger import LEDGER_NAME

    p = Path(db)
    return p.is_dir() and not (p / LEDGER_NAME).exists()


def _check_out(out: str | None) -> None:
    """An --out that cannot be written fails before the ledger is read (one line, exit 2)."""
    if out is None:
        return
    p = Path(out)
    parent = p.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"--out has value {out!r}: no directory {str(p.parent)!r}")
    if p.is_dir():
        raise UsageError(f"--out has value {out!r}: it is a directory (give a file name)")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"--out has value {out!r}: not writable by this user")


def _note_newer(paths: list[str]) -> None:
    """One line on stderr per ledger a newer vllm-guard wrote: read for what this version knows
    (the report's first summary line says it too, for whoever reads the report later)."""
    from vllm_guard.core import ledger

    for p in paths:
        v = ledger.file_version(p)
        if v is not None and v > ledger.SCHEMA_VERSION:
            print(f"vllm-guard: note: {ledger.newer_line(ledger.db_path(p), v)}: reported from what schema "
                  f"{ledger.SCHEMA_VERSION} knows", file=sys.stderr)


def cmd_report(args: argparse.Namespace, _: list[str]) -> int:
    from vllm_guard.core.ledger import LedgerError

    from . import build

    if not 0 < args.confidence < 1:
        raise ConfigError(f"--confidence has value {args.confidence!r}: must be in (0, 1)")
    _check_out(args.out)
    if args.compare and args.run_id is not None:
        raise UsageError("--run-id selects a soak run of one ledger: not with --compare")
    fleet_mode = bool(args.db) and (len(args.db) > 1 or _is_fleet_dir(args.db[0]))
    if fleet_mode and (args.compare or args.run_id is not None):
        raise UsageError("--db given for a fleet (several ledgers, or a directory of them): not with --compare or "
                         "--run-id")
    from .cost import load_prices
    from .sla import parse_tiers

    opts = build.Options(confidence=args.confidence, tiers=parse_tiers(args.sla), sla_latency=args.sla_latency,
                         prices=load_prices(args.prices) if args.prices else None)
    try:
        if fleet_mode:
            from . import fleet

            text = fleet.render(args.db, args.format, opts)
        elif args.compare:
            text = build.render_compare(args.compare, args.format, opts)
        else:
            text = build.render(_ledger(args), args.format, opts, args.run_id)
    except LedgerError as e:
        raise UsageError(str(e)) from e
    _note_newer(fleet.ledgers_of(args.db) if fleet_mode else args.compare or [_ledger(args)])
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        raise UsageError(f"--out has value {args.out!r}: cannot write it ({e.strerror})") from e
    return 0
