"""Errors a user can fix; the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A problem the user fixes; the message says what to fix.

    One line that names the thing (file, path, key) and the fix, e.g.
    ``dataset fashion_mnist: /x/train-images-idx3-ubyte.gz not found; install Debian's
    dataset-fashion-mnist or pass --data-dir DIR``. The CLI turns this (and only this) error type
    into a one-line message and exit code 2; anything else is a bug and keeps its traceback.
    """
