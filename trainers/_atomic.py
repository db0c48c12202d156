"""Files that readers see whole or not at all: write to a temporary name, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from trainers.errors import ConfigError, DiskFullError, is_disk_full

__all__ = ["atomic_write", "check_output_file", "folder_problem", "current_umask"]


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status,
    kernel 4.7+): os.umask can only read it by setting it, a moment in which another thread's
    new file would get the wrong mode."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    one; a crash leaves the old file (and at worst a stray ``.NAME.*.tmp``). The file gets the
    mode a plain ``open(path, "w")`` would (0666 less the umask): mkstemp makes it 0600, which
    would keep a study on shared storage from the colleagues the umask lets read it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        _raise_if_full(exc, path)
        raise
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~current_umask())  # before the rename: never seen private
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            _raise_if_full(exc, path)
        raise


def _raise_if_full(exc: OSError, path: Path) -> None:
    """A DiskFullError (one line, the fix) for a write that failed for want of space. pyarrow
    raises its own OSError for a failed write ("[Errno 28] ..." in the message, no errno)."""
    if is_disk_full(exc):
        kept = "the file there is unchanged" if path.exists() else "nothing was written"
        raise DiskFullError(f"{path}: the disk is full (no space left on {path.parent}'s file system; {kept}); "
                            "free space there and run again", path=str(path)) from None
