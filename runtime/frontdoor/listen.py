"""The public listening socket handed in by systemd (socket activation, `sd_listen_fds(3)`).

With a `vllm-guard.socket` unit the listening socket belongs to systemd, not to the runtime: it
stays open while one runtime exits and the next starts, so a connection made in between waits in
the kernel's backlog instead of being refused. That is what lets `systemctl restart` (an upgrade
of the runtime) refuse no connection. The protocol: `LISTEN_PID` is our pid, `LISTEN_FDS` how many
descriptors start at fd 3; we take exactly one stream socket that listens.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Mapping

from vllm_guard.core.errors import ConfigError

FIRST_FD = 3  # SD_LISTEN_FDS_START
VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def inherited(env: Mapping[str, str] | None = None, pid: int | None = None) -> socket.socket | None:
    """The listening socket systemd passed to this process, or None when none was passed (or it
    was meant for another process: `LISTEN_PID` differs). A passed descriptor that is not one
    listening stream socket is a configuration error (exit 2), never silently ignored."""
    env = os.environ if env is None else env
    count, owner = env.get("LISTEN_FDS"), env.get("LISTEN_PID")
    if not count or not owner:
        return None
    if not owner.isdigit() or int(owner) != (os.getpid() if pid is None else pid):
        return None
    if not count.isdigit() or int(count) != 1:
        raise ConfigError(f"LISTEN_FDS has value {count!r}: the runtime takes exactly one listening socket "
                          "(one ListenStream= in vllm-guard.socket)")
    try:
        mode = os.fstat(FIRST_FD).st_mode
    except OSError as e:
        raise ConfigError(f"LISTEN_FDS=1 but fd {FIRST_FD} is not open: {e.strerror}") from e
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"LISTEN_FDS=1 but fd {FIRST_FD} is not a socket")
    sock = socket.socket(fileno=FIRST_FD)
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ConfigError(f"LISTEN_FDS=1 but fd {FIRST_FD} is not a listening stream socket "
                          "(vllm-guard.socket needs ListenStream=)")
    sock.set_inheritable(False)  # vLLM's processes must not hold the public socket
    sock.setblocking(False)
    return sock


def forget(env: dict[str, str] | os._Environ[str]) -> None:
    """Drop the variables once read: children (vLLM) must not think the socket is theirs."""
    for name in VARS:
        env.pop(name, None)


def address(sock: socket.socket) -> tuple[str, int]:
    """(host, port) the socket listens on, for the log and status."""
    name = sock.getsockname()
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) else (str(name), 0)
