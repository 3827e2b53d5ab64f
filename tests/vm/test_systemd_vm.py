"""The units under a real systemd (PID 1): a Debian bookworm guest (mmdebstrap + systemd-nspawn).

The guest (tests/vm/guest.sh) installs with `vllm-guard install`, waits for READY, serves a
request, survives `kill -9` of the engine, recycles gracefully on `systemctl reload` while a
stream is in flight, lets the watchdog's unit act through the admin socket as its own non-root
user, stops cleanly and uninstalls keeping the ledger. The project, its venv and the venv's base
Python are bound read-only at their own paths, so the guest runs this checkout.

Why a container and not qemu/KVM: this machine's /dev/kvm is PVM (module kvm_pvm, nested
virtualisation without hardware support), which boots only kernels built with CONFIG_PVM_GUEST;
Debian's kernel hangs right after the boot loader (tried: -cpu host/max/qemu64/kvm64, pc, q35,
microvm). systemd-nspawn --boot gives the same real systemd 252 as PID 1 of the guest, on the
host's kernel. docs/systemd-vm-transcript.md has a recorded run.

Slow (tree ~2 min once, then ~10 min): runs only with VLLM_GUARD_VM=1. Needs root and the Debian
packages mmdebstrap and systemd-container.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
IMAGE_DIR = Path(os.environ.get("VLLM_GUARD_VM_IMAGE", "/var/tmp/vllm-guard-vm"))
STEPS = ("install", "ready", "request", "kill9_restored", "reload_graceful", "upgrade_by_restart",
         "admin_denied_to_others", "watchdog_acts", "exit2_not_restarted", "revive_after_start_limit", "clean_stop", "uninstall")
VM_TIMEOUT_S = 1800

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vm,
    # the guest's own bound, plus the image build (once) and the model: on a loaded 2-core box the
    # steps take several times their idle time (pytest's default 15 min cut a run that was passing)
    pytest.mark.timeout(VM_TIMEOUT_S + 1500),
    pytest.mark.skipif(os.environ.get("VLLM_GUARD_VM") != "1", reason="set VLLM_GUARD_VM=1 (boots a VM, ~12 min)"),
]


def _shares() -> list[Path]:
    """The checkout, the venv and the venv's base Python: outermost distinct directories."""
    dirs = sorted({REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}, key=lambda p: len(p.parts))
    out: list[Path] = []
    for d in dirs:
        if not any(d == o or o in d.parents for o in out):
            out.append(d)
    return out


@pytest.fixture(scope="module")
def image() -> Path:
    missing = [t for t in ("systemd-nspawn", "mmdebstrap") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"VLLM_GUARD_VM=1 needs root and {missing} (apt-get install mmdebstrap systemd-container)")
    subprocess.run(["bash", str(HERE / "build_image.sh"), str(IMAGE_DIR)], check=True, timeout=1200)
    return IMAGE_DIR


@pytest.fixture(scope="module")
def run_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="vllm-guard-vm-run-"))
    bin_path = Path(sys.prefix) / "bin" / "vllm-guard"
    subprocess.run([str(bin_path), "model", "tiny", str(d / "model")], check=True, timeout=600,
                   capture_output=True)
    # safetensors writes its file 0600; the service user must read it (install's preflight says so)
    subprocess.run(["chmod", "-R", "a+rX", str(d / "model")], check=True)
    shutil.copy(HERE / "guest.sh", d / "guest.sh")
    (d / "bin").write_text(str(bin_path))
    (d / "base.toml").write_text(
        '[server]\nvllm_args = ["--enforce-eager", "--max-model-len", "4096"]\n'
        'drain_timeout = "120s"\nstartup_timeout = "600s"\n'
        '[install]\nrestart_sec = "5s"\nenv = { VLLM_CPU_KVCACHE_SPACE = "1" }\n')
    os.chmod(d, 0o755)
    return d


def boot(image: Path, run: Path) -> subprocess.CompletedProcess[str]:
    """Boot the tree with systemd as PID 1; the guest's test unit powers it off when done.

    --volatile=overlay keeps the tree pristine (a tmpfs overlay takes every write), so each run
    starts from a fresh install; --private-network leaves the guest only its loopback.
    """
    cmd = ["systemd-nspawn", "--quiet", "--boot", "--directory", str(image / "tree"), "--volatile=overlay",
           "--private-network", "--register=no", "--keep-unit", "--machine", f"vg{os.getpid()}", "--console=pipe",
           "--capability=CAP_SYSLOG",  # a host has it; the watchdog keeps only this one
           f"--bind={run}:/srv/share"]
    cmd += [f"--bind-ro={p}" for p in _shares()]
    with open(run / "console.log", "w") as console:
        return subprocess.run(cmd, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              text=True, timeout=VM_TIMEOUT_S)


def test_units_under_real_systemd(image: Path, run_dir: Path) -> None:
    boot(image, run_dir)
    results_file = run_dir / "result.jsonl"
    assert results_file.exists(), f"the guest wrote no results; see {run_dir / 'console.log'}"
    results = {r["step"]: r for r in map(json.loads, results_file.read_text().splitlines())}
    for step in STEPS:
        assert step in results, f"step {step} did not run; see {run_dir / 'transcript.log'}"
        assert results[step]["ok"] is True, f"{step}: {results[step]['detail']}"
    if "watchdog_unit_runs" in results:  # the real watchdog exists in this build: its unit must run
        assert results["watchdog_unit_runs"]["ok"] is True, results["watchdog_unit_runs"]["detail"]
    shutil.rmtree(run_dir / "model", ignore_errors=True)
