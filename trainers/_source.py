"""Which version of this project's code is running: the git commit, and whether tracked files differ
from it. Studies record the commit in their rows; benchmark results record both, so a number can
be traced to the code that produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["PROJECT_ROOT", "git_commit", "tracked_files_modified"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """git's output in this checkout (fixed arguments only, no shell); None without git or a repo."""
    try:
        out = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_commit() -> str | None:
    """HEAD's commit hash; None outside a git checkout."""
    out = _git("rev-parse", "HEAD")
    if out is None:
        return None
    return out.strip() or None


def tracked_files_modified(*, ignore: tuple[str, ...] = ()) -> bool | None:
    """Whether any tracked file differs from HEAD (staged or not), leaving out the paths under
    `ignore` (relative to the project root); None outside a git checkout."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
               *(f":(exclude){path}" for path in ignore))
    return None if out is None else bool(out.strip())
