"""Can the guard's public port be bound? One check for `serve` and `install`'s preflight.

Bound the way the proxy binds it (SO_REUSEADDR, so a socket of a stopped runtime still in
TIME_WAIT does not count as taken), IPv6 for an address with a colon; the socket is closed at
once. The callers word the error for their own flags.
"""

from __future__ import annotations

import socket


def bind_error(host: str, port: int) -> str | None:
    """None when `host:port` can be bound now, else why not (the OS's words: "Address already
    in use", "Cannot assign requested address", "Permission denied")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None
