"""What a compromised or misbehaving service could reach: `systemd-analyze security` of every
unit `install` renders, offline (the real tool over the real rendered files), must be <= 3.0,
and the sandbox must still let the runtime reach the GPU (the NVIDIA device nodes by their
device classes) and loopback only. Skipped where systemd-analyze is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import GUARD_CMD

pytestmark = pytest.mark.faults

UNITS = ("vllm-guard.service", "vllm-guard@.service", "vllm-guard-watchdog.service",
         "vllm-guard-watchdog@.service", "vllm-guard-soak@.service", "vllm-guard-revive.service")
MAX_EXPOSURE = 3.0


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    base = tmp_path_factory.mktemp("units")
    model = base / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    root = base / "root"
    r = subprocess.run([*GUARD_CMD, "install", "--root", str(root), "--model", str(model), "--port", "23998"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return root


def exposure(root: Path, name: str) -> float:
    unit = root / "etc/systemd/system" / name
    if "@." in name:  # a template is analysed as one of its instances
        inst = root / name.replace("@.", "@t0.")
        shutil.copy(unit, inst)
        unit = inst
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", f"--root={root}", str(unit)],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout[-2000:] + r.stderr
    return float(m.group(1))


def test_every_unit_is_exposed_at_most_3(rendered: Path) -> None:
    figures = {name: exposure(rendered, name) for name in UNITS}
    print("\n[figure] systemd-analyze security exposure: "
          + ", ".join(f"{n} {v:.1f}" for n, v in figures.items()), flush=True)
    assert all(v <= MAX_EXPOSURE for v in figures.values()), figures


def test_the_sandbox_still_lets_the_runtime_reach_its_gpu_and_only_loopback(rendered: Path) -> None:
    for name in ("vllm-guard.service", "vllm-guard@.service", "vllm-guard-watchdog.service"):
        text = (rendered / "etc/systemd/system" / name).read_text()
        lines = set(text.splitlines())
        assert "DevicePolicy=closed" in lines and "PrivateDevices=yes" not in lines
        # /dev/nvidia0..N and nvidiactl are the frontend class (major 195); UVM and caps their own
        assert {"DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw"} <= lines, name
        assert {"IPAddressAllow=localhost", "IPAddressDeny=any"} <= lines, name
        assert "SystemCallFilter=@system-service" in lines
        # the watchdog reads the runtime's processes (another user): only the runtime hides others'
        assert ("ProtectProc=invisible" in lines) == ("watchdog" not in name), name
    revive = (rendered / "etc/systemd/system/vllm-guard-revive.service").read_text().splitlines()
    # root only to talk to systemd, with no capability at all and no network
    assert "CapabilityBoundingSet=" in revive and "PrivateNetwork=yes" in revive
