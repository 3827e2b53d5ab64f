"""The operator's install journey under a real systemd (PID 1), in the same Debian guest as
tests/vm/test_systemd_vm.py (systemd-nspawn --boot; that file says why not qemu here).

tests/vm/journey.sh, inside the guest: an interpreter in a sandbox-hidden place (a venv under
/tmp) is refused with its one line and exit 2; an interpreter the systemd-run check runs and finds
without vLLM is refused; a proper install returns after READY; the soak unit runs 5 minutes
(restarted once midway, `--resume-or-start` continues its run); `vllm-guard status` and
`vllm-guard report` with no flags find the installed service; uninstall keeps the ledger.

Run by hand (not in CI): `VLLM_GUARD_VM=1 .venv/bin/python -m pytest -q tests/vm/test_install_journey_vm.py`
(root, mmdebstrap and systemd-container; ~15 min).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_systemd_vm import HERE, VM_TIMEOUT_S, boot, image  # noqa: F401 - `image` is a fixture used below

STEPS = ("hidden_venv_refused", "no_vllm_refused_by_systemd_run", "install_ready", "soak_unit", "status_no_flags",
         "report_no_flags", "uninstall_keeps_ledger")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vm,
    pytest.mark.timeout(VM_TIMEOUT_S + 1500),  # as in test_systemd_vm.py
    pytest.mark.skipif(os.environ.get("VLLM_GUARD_VM") != "1", reason="set VLLM_GUARD_VM=1 (boots a guest, ~15 min)"),
]


@pytest.fixture(scope="module")
def journey_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="vllm-guard-journey-", dir="/var/tmp"))
    bin_path = Path(sys.prefix) / "bin" / "vllm-guard"
    subprocess.run([str(bin_path), "model", "tiny", str(d / "model")], check=True, timeout=600, capture_output=True)
    subprocess.run(["chmod", "-R", "a+rX", str(d / "model")], check=True)
    shutil.copy(HERE / "journey.sh", d / "guest.sh")
    (d / "bin").write_text(str(bin_path))
    (d / "base.toml").write_text(
        '[server]\nvllm_args = ["--enforce-eager", "--max-model-len", "512"]\n'
        'startup_timeout = "600s"\n'
        '[install]\nrestart_sec = "5s"\n')  # no VLLM_CPU_KVCACHE_SPACE: serve picks it
    os.chmod(d, 0o755)
    return d


def test_install_journey_under_real_systemd(image: Path, journey_dir: Path) -> None:  # noqa: F811
    boot(image, journey_dir)
    results_file = journey_dir / "result.jsonl"
    assert results_file.exists(), f"the guest wrote no results; see {journey_dir / 'console.log'}"
    results = {r["step"]: r for r in map(json.loads, results_file.read_text().splitlines())}
    for step in STEPS:
        assert step in results, f"step {step} did not run; see {journey_dir / 'transcript.log'}"
        assert results[step]["ok"] is True, f"{step}: {results[step]['detail']}"
    shutil.rmtree(journey_dir / "model", ignore_errors=True)
