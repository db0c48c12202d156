"""Files that readers see whole or not at all: write to a temporary name, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from trainers.errors import ConfigError

__all__ = ["atomic_write", "check_output_file", "folder_problem"]


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be written in a folder at ``path`` (made first where missing): a file in
    its place or above it, or a folder that refuses a new file; None when they can. For a check
    before long work (a dataset conversion, a search, a training run) that would end in that write."""
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:  # a file there, as atomic_write makes one (permissions, read-only or special file systems)
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror or exc})"
    return None


def check_output_file(value: str | os.PathLike, *, option: str, example: str) -> Path:
    """``value``, given for the command-line ``option``, as a file that can be written (its folder
    made where missing); ConfigError naming the fix otherwise, e.g. ``--out '': not a file name``.
    ``example``: a file name to suggest."""
    path = Path(value)
    if not str(value).strip() or not path.name:
        raise ConfigError(f"{option} {str(value)!r}: not a file name; pass one such as {example}")
    if path.is_dir():
        raise ConfigError(f"{option} {value}: is a folder; pass a file name such as {path / example}")
    problem = folder_problem(path.parent)
    if problem:
        raise ConfigError(f"{option} {value}: {problem}; pass a path in a folder you can write to")
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(handle)`` on a temporary file next to ``path``, then rename it over ``path``.

    The rename is atomic on one filesystem, so a concurrent reader gets the old file or the new
    one; a crash leaves the old file (and at worst a stray ``.NAME.*.tmp``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
