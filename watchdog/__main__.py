"""`python -m vllm_guard.watchdog ...`: the watchdog alone, without the other subcommands'
imports (what `vllm-guard watchdog` does, started faster; the systemd unit may use either)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from vllm_guard.core.errors import GuardError, UsageError

from .cli import add_commands


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def main(argv: list[str] | None = None) -> int:
    try:
        p = _Parser(prog="vllm-guard")
        sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
        handlers = add_commands(sub)
        args = p.parse_args(["watchdog", *(sys.argv[1:] if argv is None else argv)])
        return int(handlers["watchdog"](args, []))
    except GuardError as e:
        print(f"vllm-guard: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
