"""`vllm-guard report`: argument parsing and wiring, nothing more.

numpy, scipy, matplotlib and pydantic are imported inside the handler, so `vllm-guard --help`
stays fast. A file that is not a ledger, a `--run-id` it lacks, or an `--out` that cannot be
written is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_guard.core.errors import ConfigError, UsageError

Handler = Callable[[argparse.Namespace, list[str]], int]


def add_commands(sub: Any) -> dict[str, Handler]:
    r = sub.add_parser("report", help="MTBF, leaks, thermals, latency and errors from a ledger",
                       description="Figures from a ledger (the runtime's, the watchdog's and the soak's tables) as "
                                   "text, JSON or one self-contained HTML file. Opens the ledger read-only.")
    r.add_argument("--db", default=None, help="ledger file or state dir (default: the state dir's ledger)")
    r.add_argument("--state-dir", default=None,
                   help="the guard's state dir (default: $VLLM_GUARD_STATE_DIR, the installed guard's, ./.state)")
    r.add_argument("--format", choices=["text", "json", "html"], default="text", help="output format (default text)")
    r.add_argument("--out", default=None, help="file to write (default: stdout)")
    r.add_argument("--compare", nargs=2, metavar=("A.db", "B.db"), default=None,
                   help="two ledgers side by side")
    r.add_argument("--run-id", type=int, default=None, help="soak run for latency and errors (default: all runs)")
    r.add_argument("--confidence", type=float, default=0.90,
                   help="level of the MTBF bounds and leak intervals, in (0, 1) (default 0.90)")
    return {"report": cmd_report}


def _ledger(args: argparse.Namespace) -> str:
    if args.db:
        return str(args.db)
    from vllm_guard.core.ledger import LEDGER_NAME
    from vllm_guard.core.paths import resolve_state_dir

    return str(Path(resolve_state_dir(args.state_dir)[0]) / LEDGER_NAME)


def cmd_report(args: argparse.Namespace, _: list[str]) -> int:
    from vllm_guard.core.ledger import LedgerError

    from . import build

    if not 0 < args.confidence < 1:
        raise ConfigError(f"--confidence has value {args.confidence!r}: must be in (0, 1)")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out has value {args.out!r}: no directory {str(Path(args.out).parent)!r}")
    try:
        if args.compare:
            text = build.render_compare(args.compare, args.format, args.confidence)
        else:
            text = build.render(_ledger(args), args.format, args.confidence, args.run_id)
    except LedgerError as e:
        raise UsageError(str(e)) from e
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        raise UsageError(f"--out has value {args.out!r}: cannot write it ({e.strerror})") from e
    return 0
