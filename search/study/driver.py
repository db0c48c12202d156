"""One driver per study folder, and what a killed one leaves behind.

A study is driven by one process at a time: its searcher appends to the Optuna journal and its
callbacks rewrite the Parquet files. :func:`driving` holds an exclusive ``flock`` on
``driver.lock`` in the study's folder (the staging folder for a study at a URI) for as long as
the driver runs. The kernel drops the lock when the process ends, however it ends (SIGKILL
included), so a killed driver leaves nothing for its resume to wait on -- and a second ``run`` or
``resume`` of a study that is still being driven stops with a message naming the process,
instead of two drivers interleaving writes to the same files.

Holding that lock, the new driver knows the study's Optuna journal has no other writer, and
clears what a driver killed in the middle of appending to it can leave:

- Optuna's journal lock (``JournalFileSymlinkLock``: a symbolic link ``optuna.journal.lock``
  to the journal). Optuna removes a stale one only after a 30 s grace period, and never when the
  link dangles -- the study folder was moved or copied since -- where it waits forever;
- a link that lock was releasing (``optuna.journal.lock<uuid>.rename``);
- a last record cut short (no line end): the next append would be glued to it, and Optuna would
  refuse the whole journal from there on.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from search.results.location import JOURNAL_FILE
from trainers.errors import ConfigError

__all__ = ["DRIVER_LOCK", "JOURNAL_LOCK", "driving"]

DRIVER_LOCK = "driver.lock"
JOURNAL_LOCK = JOURNAL_FILE + ".lock"  # Optuna's JournalFileBackend: JournalFileSymlinkLock(journal)

# The lock files this process holds. A forked child shares an open file and so its lock: were it
# to outlive a killed driver, the study would look driven still. Children close their copies.
_held: set[int] = set()


def _drop_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def _holder(fd: int) -> str:
    """Who holds the lock, as it wrote itself into the file (it may be mid-write: then unknown)."""
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which"


def _clear_journal_leftovers(folder: Path, *, sole_writer: bool) -> None:
    """What a driver killed mid-append leaves (see the module doc). A lock link that dangles is no
    one's lock on this journal, so it goes in any case; the rest only when ``sole_writer``."""
    lock = folder / JOURNAL_LOCK
    dangling = lock.is_symlink() and not lock.exists()
    if dangling or (sole_writer and (lock.is_symlink() or lock.exists())):
        lock.unlink()
    if not sole_writer:
        return
    for releasing in folder.glob(f"{JOURNAL_LOCK}*.rename"):
        releasing.unlink(missing_ok=True)
    journal = folder / JOURNAL_FILE
    if not journal.is_file():
        return
    with open(journal, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        whole = f.read()  # a journal holds a few records per trial: small
        f.truncate(whole.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def driving(folder: str | os.PathLike) -> Iterator[None]:
    """Be the one driver of the study in ``folder`` (which must exist) until the block ends;
    a :class:`ConfigError` naming the holder when another process drives it now.

    Where the filesystem cannot lock (an NFS mount without a lock service), a warning says so
    and the study runs unguarded."""
    folder = Path(folder)
    try:
        fd = os.open(folder / DRIVER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot write the study's files there ({exc.strerror}); "
                          "make the folder writable, or copy the study somewhere that is") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            raise ConfigError(
                f"{folder}: another driver is running this study ({_holder(fd)}); wait for it to finish, "
                "or stop it (Ctrl-C) and `python -m search resume` the study"
            ) from None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: no locks on this filesystem
            locked = False
            print(f"warning: {folder}: cannot lock {DRIVER_LOCK} ({exc.strerror}); nothing stops a second "
                  "driver of this study, so start only one", file=sys.stderr, flush=True)
        if locked:  # written in place, not renamed over: the lock is on this file
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "since": dt.datetime.now().astimezone().isoformat(timespec="seconds")}).encode(), 0)
            _held.add(fd)
        _clear_journal_leftovers(folder, sole_writer=locked)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)  # drops the lock
