"""Errors a user can fix; the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

__all__ = ["ConfigError", "DiskFullError"]


class ConfigError(ValueError):
    """A problem the user fixes; the message says what to fix.

    One line that names the thing (file, path, key) and the fix, e.g.
    ``dataset fashion_mnist: /x/train-images-idx3-ubyte.gz not found; install Debian's
    dataset-fashion-mnist or pass --data-dir DIR``. The CLI turns this (and only this) error type
    into a one-line message and exit code 2; anything else is a bug and keeps its traceback.
    """


class DiskFullError(ConfigError):
    """A file did not fit on its file system (ENOSPC, or the user's quota: EDQUOT); the file it was
    to replace is unchanged. ``path``: the file; callers that know the fix better re-raise with it."""

    def __init__(self, message: str, path: "str | None" = None) -> None:
        super().__init__(message)
        self.path = path
