"""`vllm-guard`: the one command line, composed from every package's subcommands.

This is the composition root: the only module that imports the sibling packages (each one
imports only `vllm_guard.core`). Each package's `cli` module adds its subcommands through
`add_commands(subparsers) -> {command: handler(args, vllm_args) -> exit code}` and keeps its
heavy imports inside the handlers, so `--help` and `--version` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, NoReturn, Sequence

from vllm_guard.core import __version__
from vllm_guard.core.errors import EXIT_INTERRUPTED, EXIT_USAGE, GuardError, UsageError

Handler = Callable[[argparse.Namespace, list[str]], int]

# Every package that adds subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "vllm_guard.runtime.cli",
    "vllm_guard.watchdog.cli",
    "vllm_guard.loadgen.cli",
    "vllm_guard.report.cli",
    "vllm_guard.patches.cli",
    "vllm_guard.systemd.cli",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    p = _Parser(prog="vllm-guard", description="A reliability-guarded runtime for vLLM.")
    p.add_argument("--version", action="version", version=f"vllm-guard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    handlers: dict[str, Handler] = {}
    for name in COMMAND_MODULES:
        try:
            module: Any = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # a package that is there but broken must say so, not vanish from --help
            continue  # a build without that package
        handlers.update(module.add_commands(sub))
    return p, handlers


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, vllm_args = argv[:cut], argv[cut + 1:]
    try:
        parser, handlers = build_parser()
        args = parser.parse_args(argv)
        if vllm_args and args.command != "serve":
            raise UsageError(f"vllm-guard {args.command}: arguments after -- are only for serve")
        return handlers[args.command](args, vllm_args)
    except GuardError as e:
        print(f"vllm-guard: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


__all__ = ["EXIT_USAGE", "build_parser", "main"]
