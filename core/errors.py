"""Errors every command shares, and the named exit codes they map to (gunicorn style)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # a runtime error reported in one line (e.g. the admin socket is unreachable)
EXIT_USAGE = 2  # bad command line or config; nothing was started
EXIT_FAILURE_LIMIT = 3  # too many failures in the window: let systemd's StartLimit decide
EXIT_BOOT_ERROR = 4  # the backend cannot even be launched (no vLLM, no model)
EXIT_START_FAILURE = 5  # two starts in a row died before serving of the same cause: restarting cannot help
EXIT_INTERRUPTED = 130


class GuardError(Exception):
    """Base of the errors a command turns into one line on stderr."""

    exit_code = EXIT_ERROR


class ConfigError(GuardError, ValueError):
    """A setting is unknown, of the wrong type, out of range, or impossible with the others."""

    exit_code = EXIT_USAGE


class UsageError(GuardError):
    """Bad command line: one line on stderr, exit 2."""

    exit_code = EXIT_USAGE


class ProtocolError(GuardError, ValueError):
    """A cross-process message (status, command, sample) does not match its typed schema."""
