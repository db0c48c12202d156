"""Tune's experiment snapshot kept whole: the last complete one, for a resume after a full disk.

Tune writes its snapshot (``experiment_state-<session>.json``: the trials, what ``Tuner.restore``
starts from) in place, not through a temporary file, and carries on when that write fails. A disk
that fills during the write leaves the file cut short; a resume then cannot read it, and Tune, instead
of stopping, logs "Failed to restore the run state" and starts the experiment over with an empty
trial list: the study ends with the trials of that new start only, its earlier ones forgotten.

Tune writes the snapshot in the driver's staging folder and copies it to the study's storage, file
by file; the copy is what a resume reads, and what the full disk cuts. ``SnapshotKeeper`` (a Tune
callback) copies each snapshot in the study's folder that reads whole and whose files agree (the
searcher's count of the trials it made is the number of trials in the snapshot) into
``.last-good/`` beside it, through a temporary folder renamed into place, so the copy is whole or
the previous one stays. ``restore_last_good`` runs before a resume: where the newest snapshot does not read, it moves
the damaged files aside (``.damaged/``, nothing deleted) and puts the last good set back; the trials
that finished after it are in the store, and the resume's reconciliation
(``StoreCallback.on_step_begin``) samples their slots again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ray.tune import Callback

from trainers.errors import ConfigError

__all__ = ["SnapshotKeeper", "restore_last_good", "snapshot_files"]

LAST_GOOD = ".last-good"
DAMAGED = ".damaged"
STATE = "experiment_state-{}.json"
# the searcher's files of a session, written after the trials' (Tune's save_to_dir)
SIDECARS = ("search_gen_state-{}.json", "searcher-state-{}.pkl")


def _session(path: Path) -> str:
    return path.name[len("experiment_state-"):-len(".json")]


def snapshot_files(folder: Path) -> list[Path]:
    """The newest session's snapshot files in ``folder`` (its experiment state first), or []."""
    states = sorted(folder.glob(STATE.format("*")))
    if not states:
        return []
    session = _session(states[-1])
    return [states[-1], *(folder / name.format(session) for name in SIDECARS if (folder / name.format(session)).exists())]


def _reads_whole(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
        return True
    except (OSError, ValueError):
        return False


def _consistent(files: list[Path]) -> bool:
    """The experiment state reads whole and the searcher made as many trials as it lists."""
    import pickle

    try:
        trials = len(json.loads(files[0].read_bytes())["trial_data"])
        with open(files[1], "rb") as f:
            made = pickle.load(f)["counter"]  # Tune's own file in the study's folder (Tune unpickles it to resume)
    except Exception:  # cut short, or written while we read
        return False
    return made == trials


def _copy_set(files: list[Path], target: Path) -> None:
    """``files`` into ``target`` as one set: a temporary folder renamed over it."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in files:
        shutil.copy2(f, tmp / f.name)
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


class SnapshotKeeper(Callback):
    """After each step of Tune's loop: a new complete snapshot is copied into ``.last-good/``."""

    def __init__(self) -> None:
        self._kept: tuple | None = None

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        from pyarrow import fs as pafs

        if not trials or not isinstance(trials[0].storage.storage_filesystem, pafs.LocalFileSystem):
            return  # a study at a URI: Tune uploads a snapshot only once it is written whole
        folder = Path(trials[0].storage.experiment_fs_path)
        try:
            files = snapshot_files(folder)
            if len(files) != 1 + len(SIDECARS):
                return
            stamps = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
            if stamps == self._kept or not _consistent(files):
                return  # kept already, or being copied
            _copy_set(files, folder / LAST_GOOD)
            self._kept = stamps
        except OSError:  # e.g. the disk is full: the previous copy stays
            shutil.rmtree(folder / (LAST_GOOD + ".tmp"), ignore_errors=True)


def restore_last_good(folder: str | os.PathLike) -> str | None:
    """Before a resume from ``folder`` (Tune's experiment folder, local): where its newest snapshot
    does not read whole, put the last good one back; returns what it did (None: nothing to do).
    ConfigError where the snapshot is damaged and no good copy is there."""
    folder = Path(folder)
    files = snapshot_files(folder)
    if not files or _reads_whole(files[0]):
        return None
    kept = snapshot_files(folder / LAST_GOOD)
    if not kept or not _reads_whole(kept[0]):
        raise ConfigError(f"{files[0]}: Tune's snapshot of the study is cut short (the disk filled while it was "
                          "written) and no complete copy was kept, so a resume would start the study over; run the "
                          "spec again with --name NEW_NAME (what this study has stays readable)")
    damaged = folder / DAMAGED
    damaged.mkdir(exist_ok=True)
    since = _session(kept[0])  # that session's files (overwritten since) and any later session's
    for f in list(folder.iterdir()):
        for pattern in (STATE, *SIDECARS):
            prefix, suffix = pattern.split("{}")
            if f.is_file() and f.name.startswith(prefix) and f.name.endswith(suffix) \
                    and f.name[len(prefix):-len(suffix)] >= since:
                os.replace(f, damaged / f.name)
    for f in kept:
        shutil.copy2(f, folder / f.name)
    trials = len(json.loads(kept[0].read_bytes()).get("trial_data", []))
    return (f"resume: Tune's last snapshot was cut short (the disk filled while it was written; kept in "
            f"{damaged}); resuming from the last complete one ({trials} trial{'s' * (trials != 1)})")


def drop_cut_error_pickles(folder: Path) -> int:
    """Remove the trials' ``error.pkl`` files that a full disk left empty; how many. Tune's restore
    unpickles each failed trial's error and an empty file stops the resume (EOFError); without the
    file it reads the trial's ``error.txt``, so the failed trial stays data, its error kept."""
    cut = [p for p in Path(folder).glob("*/error.pkl") if p.is_file() and p.stat().st_size == 0]
    for path in cut:
        path.unlink()
    return len(cut)
