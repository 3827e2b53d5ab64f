"""Preflight and revive decisions on literal values; the live checks' one-line exit-2 contract."""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path

import pytest

from vllm_guard import cli
from vllm_guard.systemd import preflight as P
from vllm_guard.systemd import render as R
from vllm_guard.systemd import revive


@pytest.mark.parametrize("version, cuda", [
    ("2.11.0+cu130", (13, 0)), ("2.5.1+cu124", (12, 4)), ("2.13.0+cpu", None), ("2.5.1", None), ("", None),
])
def test_cuda_of_torch(version: str, cuda: tuple[int, int] | None) -> None:
    assert P.cuda_of_torch(version) == cuda


@pytest.mark.parametrize("driver, needed, verdict", [
    (13000, (13, 0), "ok"), (13010, (13, 0), "ok"), (12080, (13, 0), "error"), (12020, (12, 4), "warn"),
    (None, (12, 4), "error"), (None, None, "ok"), (11080, None, "ok"),
    # driver branches (nvmlSystemGetCudaDriverVersion): 535 = 12.2, 550 = 12.4, 570 = 12.8, 580 = 13.0;
    # a CUDA 12 torch runs on every 12.x driver (minor-version compatibility) and on 13.x
    (12020, (12, 8), "warn"), (12040, (12, 6), "warn"), (12080, (12, 8), "ok"), (13000, (12, 8), "ok"),
    (12080, (13, 0), "error"),
])
def test_driver_verdict(driver: int | None, needed: tuple[int, int] | None, verdict: str) -> None:
    assert P.driver_verdict(driver, needed)[0] == verdict


def test_driver_too_old_names_both_versions() -> None:
    _, why = P.driver_verdict(12080, (13, 0))
    assert "CUDA 12.8" in why and "needs 13.0" in why and "apt-mark hold" in why


@pytest.mark.parametrize("props, revive_it", [
    ({"ActiveState": "failed", "Result": "start-limit-hit", "ExecMainStatus": "3"}, True),
    ({"ActiveState": "failed", "Result": "watchdog", "ExecMainStatus": "0"}, True),
    ({"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "2"}, False),
    ({"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "4"}, False),
    ({"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, False),
    ({"ActiveState": "active", "Result": "success", "ExecMainStatus": "0"}, False),
])
def test_revive_decision(props: dict[str, str], revive_it: bool) -> None:
    assert revive.decide(props)[0] is revive_it


def test_parse_systemctl_show() -> None:
    text = "ActiveState=failed\nResult=start-limit-hit\nExecMainStatus=3\n"
    assert revive.parse_show(text) == {"ActiveState": "failed", "Result": "start-limit-hit", "ExecMainStatus": "3"}


def test_protect_home_relaxes_only_for_homes() -> None:
    assert R.protect_home(["/opt/vg/venv/bin/vllm-guard", "/usr"])[0] == "yes"
    assert R.protect_home(["/opt/x", "/root/.pyenv/versions/3.11.7"])[0] == "read-only"
    assert R.protect_home(["/homework/x"])[0] == "yes"


def test_toml_emitter_round_trips() -> None:
    data = {"server": {"model": 'a "quoted" path', "port": 8000, "vllm_args": ["--x", "1"], "overlap": False,
                       "drain_timeout": 12.5}, "install": {"env": {"A": "1"}}}
    assert tomllib.loads(R.toml_text(data, "# header")) == data


def test_substitute_refuses_unknown_placeholder() -> None:
    with pytest.raises(KeyError, match="@nope@"):
        R.substitute("x=@nope@", {})


def test_port_taken_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = cli.main(["install", "--dry-run", "--model", str(tmp_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"port {port} on 127.0.0.1 is taken" in err and len(err.strip().splitlines()) == 1


def test_live_install_refuses_without_systemd_as_pid1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if Path("/run/systemd/system").is_dir():
        pytest.skip("systemd is PID 1 here: a live install would really install")
    (tmp_path / "config.json").write_text("{}")
    rc = cli.main(["install", "--model", str(tmp_path), "--port", "1"])
    err = capsys.readouterr().err
    expected = "install needs root" if os.geteuid() != 0 else "systemd is not PID 1"
    assert rc == 2 and expected in err and len(err.strip().splitlines()) == 1


def test_not_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # an unprivileged operator
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["install", "--model", str(tmp_path)]) == 2
    assert cli.main(["uninstall"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("needs root" in line for line in lines)


def test_gpus_without_driver_or_unknown_uuid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No NVML here: 'no NVIDIA driver answers'; on a GPU box the UUID is unknown: 'no such GPU'."""
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli.main(["install", "--dry-run", "--model", str(tmp_path), "--port", str(port),
                   "--gpus", "GPU-00000000-1111-2222-3333-444444444444"])
    err = capsys.readouterr().err
    assert rc == 2 and ("no NVIDIA driver answers" in err or "no such GPU" in err), err


def test_torch_build_is_read_from_the_services_interpreter() -> None:
    """torch.version.cuda as the interpreter sees it (this venv: a CPU build, so no driver needed);
    an interpreter without torch: unknown, never a guess."""
    import shutil
    import sys

    version, cuda, known = P.torch_build(sys.executable)
    assert version.startswith("2.") and cuda is None and known
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other:
        v, c, k = P.torch_build(other)
        if not v:
            assert (c, k) == (None, False)
