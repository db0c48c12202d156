"""A resumed trial whose checkpoint in Tune's snapshot is gone continues from its newest one left.

Tune keeps ``num_to_keep`` checkpoints per trial and deletes the oldest as soon as a newer one is
registered, but writes its experiment snapshot (what ``Tuner.restore`` starts from) only every
second or so and uploads it in the background. A driver killed in between leaves a snapshot whose
running trial names a checkpoint that no longer exists, and Tune fails that trial at the restore
("Could not recover from checkpoint as it does not exist on storage anymore") although newer
checkpoints of it are there. ``CheckpointRecovery`` points such a trial at the newest of its
checkpoints whose state file loads whole (a checkpoint the kill caught mid-upload does not), or,
with none, lets it start over; the trial's other checkpoint folders, which nothing names any
more, are deleted.

Tune's per-trial checkpoint bookkeeping has no public setter: this module is the one place that
touches it (Ray 2.x: ``trial.run_metadata.checkpoint_manager`` and ``trial.storage``).
"""

from __future__ import annotations

import io
import re
import sys
from typing import Any, TextIO

import torch
from pyarrow import fs as pafs
from ray.tune.experiment import Trial

from search.study.callbacks import PrintingCallback
from search.study.trainable import STATE_FILE

__all__ = ["CheckpointRecovery"]

_CHECKPOINT_DIR = re.compile(r"checkpoint_(\d{6})")


class CheckpointRecovery(PrintingCallback):
    """Before the first trial of a ``fit()`` (fresh or resumed) starts: every unfinished trial has
    a checkpoint to restore that exists, or none."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self._checked = False

    def setup(self, **info: Any) -> None:
        self._checked = False

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        if self._checked:
            return
        self._checked = True
        for trial in trials:
            if trial.status not in (Trial.TERMINATED, Trial.ERROR):
                note = recover_missing_checkpoint(trial)
                if note:
                    print(f"trial {trial.trial_id}: {note}", file=self.out, flush=True)


def recover_missing_checkpoint(trial: Any) -> str | None:
    """Point ``trial`` at a checkpoint that exists when the one Tune's snapshot names is gone;
    what was done, or None when nothing had to be."""
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult
    from ray.tune import Checkpoint

    manager = trial.run_metadata.checkpoint_manager
    named = manager.latest_checkpoint_result
    if named is None or _exists(named.checkpoint.filesystem, named.checkpoint.path):
        return None
    filesystem, trial_dir = trial.storage.storage_filesystem, trial.storage.trial_fs_path
    gone = named.checkpoint.path.rsplit("/", 1)[-1]
    # A new manager: the checkpoints the old one tracked are all older than the one it names, so
    # gone too, and Tune would fail deleting them later.
    trial.run_metadata.checkpoint_manager = _CheckpointManager(manager.checkpoint_config)
    trial.storage.current_checkpoint_index = -1
    note = f"Tune's snapshot names checkpoint {gone}, which is gone, and no other checkpoint loads; starting it over"
    continued = False
    for index, path in _checkpoints_newest_first(filesystem, trial_dir):
        state = None if continued else _load_state(filesystem, f"{path}/{STATE_FILE}")
        if state is None:
            # torn, or older than the one continued from: nothing names it now, so nothing
            # would ever delete it (a folder that will not go is only disk space: resume goes on)
            try:
                filesystem.delete_dir(path)
            except OSError:
                pass
            continue
        continued = True
        epoch, name = int(state["epoch"]), path.rsplit("/", 1)[-1]
        metrics = {**named.metrics, **state["history"][-1], "training_iteration": epoch, "checkpoint_dir_name": name}
        trial.run_metadata.checkpoint_manager.register_checkpoint(
            _TrainingResult(checkpoint=Checkpoint(path=path, filesystem=filesystem), metrics=metrics))
        trial.storage.current_checkpoint_index = index  # its next checkpoint goes after this one
        note = (f"Tune's snapshot names checkpoint {gone}, which is gone (deleted after the snapshot was taken); "
                f"continuing from {name} (epoch {epoch})")
    trial.invalidate_json_state()
    return note


def _exists(filesystem: pafs.FileSystem, path: str) -> bool:
    return filesystem.get_file_info(path).type != pafs.FileType.NotFound


def _checkpoints_newest_first(filesystem: pafs.FileSystem, trial_dir: str) -> list[tuple[int, str]]:
    """``(index, path)`` of the trial's ``checkpoint_NNNNNN`` folders."""
    found = []
    for info in filesystem.get_file_info(pafs.FileSelector(trial_dir, allow_not_found=True)):
        match = _CHECKPOINT_DIR.fullmatch(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            found.append((int(match.group(1)), info.path))
    return sorted(found, reverse=True)


def _load_state(filesystem: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    """The trial state in a checkpoint, or None when it is missing or torn (the kill caught its upload)."""
    try:
        with filesystem.open_input_stream(path) as stream:
            state = torch.load(io.BytesIO(stream.read()), weights_only=True, map_location="cpu")
        return state if state.get("history") else None
    except Exception:  # noqa: BLE001 -- whatever does not load is no checkpoint to continue from
        return None
