"""Attacks through what an operator (or whoever can write the config or a command) types:
injection into the sd_notify datagram and into unit files, owned vLLM flags in disguise,
absurd durations, links planted in the state dir. Each against the real component — the real
notify datagram on a real socket, the real `vllm-guard` CLI, real `systemd-analyze verify` —
none needs vLLM (every one is refused before a child would start).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import GUARD_CMD, free_port
from vllm_guard.core import config as C
from vllm_guard.core.errors import ConfigError, UsageError
from vllm_guard.core.notify import Notifier
from vllm_guard.core.protocol import Command, CommandRequest
from vllm_guard.runtime.cli import find_owned_arg
from vllm_guard.systemd import render as R

pytestmark = pytest.mark.faults

INJECTION = "maint\nWATCHDOG=trigger\nMAINPID=1"


def guard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GUARD_CMD, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def one_line_exit_2(r: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (r.returncode, r.stderr)


# -- sd_notify and admin reasons ---------------------------------------------------------------------
def test_a_reason_with_a_newline_is_refused_and_status_lines_cannot_add_notify_fields(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="control characters"):
        CommandRequest(command=Command.HOLD, reason=INJECTION)
    with pytest.raises(ValueError, match="at most 200"):
        CommandRequest(command=Command.HOLD, reason="x" * 201)
    r = guard("hold", "--state-dir", str(tmp_path / "s"), "--reason", INJECTION)
    assert r.returncode == 2 and "control characters" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # whatever text reaches STATUS= (a vLLM log line quoted in it) stays one field of one line
    sock_path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
        n = Notifier()
        n.status("held: " + INJECTION + "\x00\u2028" + "y" * 1000)
        datagram = sock.recv(65536).decode()
        assert datagram.startswith("STATUS=held: maint") and "\n" not in datagram and "\x00" not in datagram
        assert len(datagram) <= len("STATUS=") + 400 and datagram.endswith("…")
        n.status("Wartung: 維護")  # any script reaches systemd (sdnotify alone dropped it silently)
        assert sock.recv(65536).decode() == "STATUS=Wartung: 維護"


# -- configuration values ------------------------------------------------------------------------------
@pytest.mark.parametrize("toml, needle", [
    ("[recycle]\nmemory_interval = 0\n", "[recycle] memory_interval has value 0"),
    ("[recycle]\nmemory_interval = nan\n", "[recycle] memory_interval has value nan"),
    ("[probe]\ninterval = nan\n", "[probe] interval has value nan"),
    ("[server]\ndrain_timeout = inf\n", "[server] drain_timeout has value inf"),
    ("[server]\ndrain_timeout = -inf\n", "[server] drain_timeout has value -inf"),
    ("[server]\nstartup_timeout = '400d'\n", "longer than a year"),
    ("[recycle]\nmax_uptime = 1e12\n", "longer than a year"),
    ("[server]\nheader_timeout = '2h'\n", "[server] header_timeout has value"),
    ("[server]\nadmin_mode = 0o777\n", "[server] admin_mode has value"),
    ("[server]\nadmin_mode = 0o000\n", "[server] admin_mode has value"),
    ("[server]\nmax_body_mb = nan\n", "[server] max_body_mb has value nan"),
    ("[server]\nhost = \"127.0.0.1\\nExecStartPre=/bin/sh\"\n", "control characters"),
    ("[server]\nvllm_args = [\"--enforce-eager\\n\"]\n", "control characters"),
])
def test_a_duration_or_mode_out_of_range_is_one_line_and_nothing_starts(tmp_path: Path, toml: str, needle: str) -> None:
    cfg = tmp_path / "guard.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match="has value|longer than a year|control characters") as e:
        C.load(cfg)
    assert needle in str(e.value)
    if "nan" in toml or "0o777" in toml or "\\n" in toml:  # and through the CLI: one line, exit 2, nothing made
        state = tmp_path / "state"
        one_line_exit_2(guard("serve", "--config", str(cfg), "--state-dir", str(state)), needle)
        assert not state.exists()


def test_install_refuses_nan_like_serve(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "guard.toml"
    cfg.write_text("[recycle]\nmemory_interval = nan\n")
    r = guard("install", "--root", str(tmp_path / "root"), "--model", str(model), "--config", str(cfg))
    one_line_exit_2(r, "memory_interval has value nan")
    assert not (tmp_path / "root").exists()


# -- owned vLLM flags ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--ho", "0.0.0.0"], ["--hos=0.0.0.0"], ["--po", "1"], ["--mod", "x"],
                                  ["--ud", "/tmp/s"], ["--uds=/tmp/s"], ["--host", "::"]])
def test_owned_vllm_flags_are_found_the_way_vllms_parser_reads_them(args: list[str]) -> None:
    """vLLM's parser allows unambiguous abbreviations: `--ho` is `--host`."""
    assert find_owned_arg(["--enforce-eager", *args]) == args[0]
    if args[0] == "--ho":
        one_line_exit_2(guard("serve", "--state-dir", "/nonexistent/x", "--", *args), "is owned by the runtime")


# -- unit files -------------------------------------------------------------------------------------------
def test_a_model_path_with_a_newline_cannot_add_a_unit_line(tmp_path: Path) -> None:
    model = tmp_path / "model\nExecStartPre=touch pwned"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = guard("install", "--root", str(tmp_path / "root"), "--model", str(model))
    assert r.returncode == 2 and "control characters" in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()
    with pytest.raises(UsageError):
        R.exec_word("/opt/venv/bin/vllm-guard\nExecStartPre=/bin/sh")


def test_an_executable_path_with_spaces_and_specifiers_is_one_word_to_systemd(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    venv = tmp_path / "my venv %h $HOME"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "vllm-guard"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    arg = "a b%i$x\"q\\"
    unit = tmp_path / "t-escape.service"
    unit.write_text(f"[Service]\nType=oneshot\nExecStart={R.exec_word(str(exe), first=True)} serve "
                    f"{R.exec_word(arg)}\n")
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr  # verify checks that the executable exists: one word
    unquoted = tmp_path / "t-plain.service"  # (the attack: the same path unquoted is not)
    unquoted.write_text(f"[Service]\nType=oneshot\nExecStart={exe} serve\n")
    r = subprocess.run([tool, "verify", str(unquoted)], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0


# -- the state dir -------------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.parametrize("planted", ["runtime.lock", "ledger.sqlite", "logs"])
def test_a_link_planted_in_the_state_dir_is_not_followed(tmp_path: Path, model_dir: Path, planted: str) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    target = victim / "precious" if planted != "logs" else victim
    (state / planted).symlink_to(target)
    r = guard("serve", "--model", str(model_dir), "--state-dir", str(state), "--port", str(free_port()))
    one_line_exit_2(r, "state_dir has value")
    assert (victim / "precious").read_text() == "keep me" and os.listdir(victim) == ["precious"]


def test_a_state_dir_that_is_a_link_is_refused(tmp_path: Path, model_dir: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "state").symlink_to(real)
    r = guard("serve", "--model", str(model_dir), "--state-dir", str(tmp_path / "state"), "--port", str(free_port()))
    one_line_exit_2(r, "symbolic link")
    assert os.listdir(real) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership rule is for a runtime running as root")
def test_as_root_a_state_dir_of_another_user_is_refused(tmp_path: Path, model_dir: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chown(state, 65534, 65534)
    r = guard("serve", "--model", str(model_dir), "--state-dir", str(state), "--port", str(free_port()))
    one_line_exit_2(r, "owned by uid 65534")
    assert os.listdir(state) == []
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    r = guard("serve", "--model", str(model_dir), "--state-dir", str(world), "--port", str(free_port()))
    one_line_exit_2(r, "writable by every user")
    assert stat.S_IMODE(world.stat().st_mode) == 0o777 and os.listdir(world) == []
