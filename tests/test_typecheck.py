"""mypy over the product code, configured in pyproject.toml, with zero errors.

The packages live in top-level folders mapped to `vllm_guard.<name>` (see pyproject), which an
editable install resolves with an import hook mypy cannot follow; so the check runs on a tree
of symlinks, `vllm_guard/<name> -> ../../<name>`, built fresh in a temp dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "cli", "runtime", "patches", "watchdog", "loadgen", "report", "systemd")


def test_mypy_finds_no_errors(tmp_path: Path) -> None:
    pkg = tmp_path / "vllm_guard"
    pkg.mkdir()
    for name in PACKAGES:
        (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
         str(tmp_path / "cache"), "-p", "vllm_guard"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={"MYPYPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
