"""`vllm-guard patches list [--json] [--vllm-root DIR]`: what would apply, without starting vLLM.

Shapes are read from the vLLM source tree (no import, no torch), so the same command describes
the installed vLLM or an unpacked tree of another version. The registry and `rich` are
imported inside the handler, so `vllm-guard --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_guard.core.errors import UsageError

Handler = Callable[[argparse.Namespace, list[str]], int]


def table(root: Path) -> dict[str, Any]:
    """The deterministic `patches list` table for the vLLM tree at `root` (committed in docs/patches/)."""
    from . import defs, registry

    version = registry.tree_version(root)
    rows = []
    for d in defs.ALL:
        why = registry.evaluate(d, version, lambda t: registry.static_check(root, t))
        rows.append({
            "id": d.id, "state": "applies" if why is None else "skipped", "reason": why or "",
            "versions": f">={d.min_version},<{d.max_version}", "roles": list(d.roles),
            "fixes": d.fixes, "targets": [t.describe() for t in d.targets],
        })
    return {"vllm_version": version, "patches": rows}


def render(data: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"vllm-guard patches for vLLM {data['vllm_version']}")
    for col in ("patch", "state", "versions", "roles", "fixes / reason"):
        t.add_column(col, overflow="fold")
    for r in data["patches"]:
        t.add_row(r["id"], r["state"], r["versions"], ", ".join(r["roles"]),
                  r["reason"] if r["state"] != "applies" else r["fixes"])
    with open("/dev/null", "w") as sink:
        console = Console(width=140, record=True, file=sink)
        console.print(t)
    return console.export_text()


def cmd_patches(args: argparse.Namespace, _: list[str]) -> int:
    from . import registry

    root = Path(args.vllm_root) if args.vllm_root else registry.vllm_root()
    if root is None or not (root / "v1").is_dir():
        raise UsageError(f"patches list: no vLLM tree at {args.vllm_root or '(vllm not installed)'}")
    data = table(root)
    sys.stdout.write(json.dumps(data, indent=2) + "\n" if args.json else render(data))
    return 0


def add_commands(sub: Any) -> dict[str, Handler]:
    p = sub.add_parser("patches", help="the vLLM patches plugin: what would apply to the installed vLLM")
    ps = p.add_subparsers(dest="patches_cmd", required=True, metavar="SUBCOMMAND")
    lst = ps.add_parser("list", help="every patch, its version range, and whether it applies here")
    lst.add_argument("--json", action="store_true", help="the table as JSON (as committed in docs/patches/)")
    lst.add_argument("--vllm-root", default=None, metavar="DIR",
                     help="a vllm package dir to read instead of the installed one (e.g. an unpacked wheel)")
    return {"patches": cmd_patches}
