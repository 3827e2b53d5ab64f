"""The package contract: every product package imports only `vllm_guard.core` (and itself);
the core imports none of them; only the CLI composition root imports them all. Checked on the
source (every import statement, top level or inside a function), so a lazy import cannot
hide a dependency. Also: the watchdog and the core never import vLLM or torch, and
`vllm-guard --help` / `--version` do not pull heavy modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "cli", "runtime", "patches", "watchdog", "loadgen", "report", "systemd")
HEAVY = ("vllm", "torch")


def _imports(pkg: str) -> list[tuple[str, int, str]]:
    """(file, line, imported module) for every import in a package, relative ones resolved."""
    out = []
    for f in sorted((ROOT / pkg).rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        rel = f.relative_to(ROOT / pkg).with_suffix("")
        here = ["vllm_guard", pkg, *rel.parts[:-1]]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(str(f.relative_to(ROOT)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                out.append((str(f.relative_to(ROOT)), node.lineno, mod))
    return out


def _sibling(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vllm_guard" else None


@pytest.mark.parametrize("pkg", [p for p in PACKAGES if p != "cli"])
def test_a_package_imports_only_the_core_and_itself(pkg: str) -> None:
    allowed = {pkg} if pkg == "core" else {pkg, "core"}
    bad = [f"{f}:{n} imports {m}" for f, n, m in _imports(pkg)
           if (s := _sibling(m)) is not None and s not in allowed]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pkg", ["core", "watchdog", "report", "loadgen", "systemd", "cli"])
def test_light_packages_never_import_vllm_or_torch(pkg: str) -> None:
    bad = [f"{f}:{n} imports {m}" for f, n, m in _imports(pkg) if m.split(".")[0] in HEAVY]
    assert not bad, "\n".join(bad)


def test_every_package_folder_is_declared_and_checked() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for pkg in PACKAGES:
        assert f'"vllm_guard.{pkg}" = "{pkg}"' in text, pkg


def test_help_and_version_are_fast_and_import_nothing_heavy() -> None:
    code = ("import sys, io, contextlib\n"
            "from vllm_guard.cli import main\n"
            "for argv in (['--help'], ['--version'], ['serve', '--help'], ['report', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "heavy = sorted(m for m in ('vllm', 'torch', 'numpy', 'scipy', 'matplotlib', 'aiohttp', 'pydantic', 'psutil')\n"
            "               if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"--help imported: {out.stdout.strip()}"


def test_version_flag_prints_the_version() -> None:
    from vllm_guard.core import __version__

    out = subprocess.run([sys.executable, "-m", "vllm_guard.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"vllm-guard {__version__}"
