"""Errors a user can fix; the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import errno

__all__ = ["ConfigError", "DiskFullError", "FULL_DISK_ERRNOS", "is_disk_full"]

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """An OSError for want of space; pyarrow raises its own OSError with "[Errno 28] ..." in the
    message and no errno."""
    return isinstance(exc, OSError) and (
        exc.errno in FULL_DISK_ERRNOS or any(f"[Errno {code}]" in str(exc) for code in FULL_DISK_ERRNOS))


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
