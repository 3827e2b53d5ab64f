"""The state dir, opened without following links and checked for ownership.

The runtime may run as root (a box without the units). A state dir that another user owns, or
can write to, lets that user plant a symbolic link (`runtime.lock -> /etc/shadow`,
`logs -> /etc`) that a root runtime would follow, truncating or appending to the target. So:
the state dir itself must not be a link, must belong to the runtime's user when it runs as root,
and must not be writable by everybody; files and directories inside it are opened component by
component with O_NOFOLLOW, relative to the directory's descriptor, never through a path that
could have been swapped.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StateDirError(Exception):
    """The state dir is unsafe or unusable; the message is one line for the operator."""


def check_dir(fd: int, what: str, euid: int | None = None) -> None:
    """Refuse a directory writable by everybody (without the sticky bit) and, when running as
    root, one owned by another user."""
    st = os.fstat(fd)
    euid = os.geteuid() if euid is None else euid
    if euid == 0 and st.st_uid != 0:
        raise StateDirError(f"{what} is owned by uid {st.st_uid}, not root: a root runtime refuses a "
                            "directory another user controls (chown it to root, or run as that user)")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise StateDirError(f"{what} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}): "
                            "chmod o-w it")


def open_dir(path: str | Path, create: bool = True, mode: int = 0o770) -> int:
    """A descriptor of the state dir (created if missing, parents too); never through a link at
    its last component. StateDirError when it is unsafe."""
    p = Path(path)
    if create:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(p, mode)
        except FileExistsError:
            pass
        except OSError as e:
            raise StateDirError(f"cannot create {p}: {e.strerror or e}") from e
    try:
        fd = os.open(p, _DIR)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and p.is_symlink():
            raise StateDirError(f"{p} is a symbolic link: use the directory it points to") from e
        raise StateDirError(f"{p}: {e.strerror or e}") from e
    try:
        check_dir(fd, str(p))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _subdir(dir_fd: int, name: str, create: bool, mode: int) -> int:
    if create:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
    return os.open(name, _DIR, dir_fd=dir_fd)


def open_file(dir_fd: int, rel: str, flags: int, mode: int = 0o640, create_dirs: bool = True) -> int:
    """Open `rel` (e.g. `logs/generation-3.log`) under the directory `dir_fd`, every component
    without following links (a link anywhere: OSError ELOOP or ENOTDIR)."""
    parts = [x for x in rel.split("/") if x]
    if not parts or any(x == ".." for x in parts):
        raise ValueError(f"not a relative path inside the state dir: {rel!r}")
    fd = os.dup(dir_fd)
    try:
        for name in parts[:-1]:
            nxt = _subdir(fd, name, create_dirs, 0o750)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_under(state_dir: str | Path, path: str | Path, flags: int, mode: int = 0o640) -> int:
    """Open `path` with no link followed inside `state_dir` (the state dir itself checked)."""
    base = Path(state_dir).absolute()
    target = Path(path).absolute()
    rel = target.relative_to(base)
    dfd = open_dir(base, create=True)
    try:
        return open_file(dfd, str(rel), flags, mode)
    finally:
        os.close(dfd)


def not_a_link(path: str | Path) -> None:
    """StateDirError when `path` exists as a symbolic link (files SQLite or a library opens by name)."""
    p = Path(path)
    if p.is_symlink():
        raise StateDirError(f"{p} is a symbolic link: refusing to follow it")
