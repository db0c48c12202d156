"""search.study.recovery on a real Tune Trial and real checkpoint folders (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ray.train._internal.session import _TrainingResult
from ray.train._internal.storage import StorageContext
from ray.tune import Checkpoint, CheckpointConfig, register_trainable
from ray.tune.experiment import Trial

from search.study.recovery import recover_missing_checkpoint
from search.study.trainable import STATE_FILE


def _trial(tmp_path: Path) -> Trial:
    register_trainable("recovery_noop", lambda config: None)
    storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="ray", trial_dir_name="t1")
    trial = Trial("recovery_noop", config={}, storage=storage, checkpoint_config=CheckpointConfig(num_to_keep=2))
    Path(storage.trial_fs_path).mkdir(parents=True)
    return trial


def _checkpoint(trial: Trial, index: int, *, epoch: int | None = None) -> str:
    """``checkpoint_<index>`` with the state after ``epoch`` (None: its state file cut short)."""
    path = Path(trial.storage.trial_fs_path, f"checkpoint_{index:06d}")
    path.mkdir()
    if epoch is None:
        whole = path.parent / "whole.pt"
        torch.save({"epoch": 1, "history": [{"epoch": 1}]}, whole)
        (path / STATE_FILE).write_bytes(whole.read_bytes()[:100])  # the kill caught its upload
    else:
        history = [{"epoch": e, "val_acc": e / 10} for e in range(1, epoch + 1)]
        torch.save({"epoch": epoch, "history": history, "model": {"w": torch.zeros(2)}}, path / STATE_FILE)
    return str(path)


def _name(trial: Trial, index: int, metrics: dict) -> None:
    """What Tune's snapshot holds: checkpoint ``index`` as the latest (registered, then deleted)."""
    path = Path(trial.storage.trial_fs_path, f"checkpoint_{index:06d}")
    trial.run_metadata.checkpoint_manager.register_checkpoint(
        _TrainingResult(checkpoint=Checkpoint(path=str(path), filesystem=trial.storage.storage_filesystem), metrics=metrics))
    trial.storage.current_checkpoint_index = index


def test_a_checkpoint_that_exists_is_left_as_it_is(tmp_path):
    trial = _trial(tmp_path)
    _checkpoint(trial, 3, epoch=4)
    _checkpoint(trial, 4, epoch=5)
    _name(trial, 3, {"training_iteration": 4})
    assert recover_missing_checkpoint(trial) is None
    assert trial.latest_checkpoint_result.checkpoint.path.endswith("checkpoint_000003")
    assert trial.storage.current_checkpoint_index == 3


def test_a_gone_checkpoint_is_replaced_by_the_newest_one_that_loads(tmp_path):
    trial = _trial(tmp_path)
    _name(trial, 1, {"training_iteration": 2, "time_total_s": 3.0})  # gone
    _checkpoint(trial, 2, epoch=3)
    _checkpoint(trial, 3, epoch=4)
    _checkpoint(trial, 4)  # newest, torn
    note = recover_missing_checkpoint(trial)
    assert note == ("Tune's snapshot names checkpoint checkpoint_000001, which is gone (deleted after the snapshot was taken); "
                    "continuing from checkpoint_000003 (epoch 4)")
    latest = trial.latest_checkpoint_result
    assert latest.checkpoint.path == str(Path(trial.storage.trial_fs_path, "checkpoint_000003"))
    # Trainable.restore takes the iteration from here; the rest is the epoch's own result
    assert latest.metrics["training_iteration"] == 4 and latest.metrics["val_acc"] == 0.4
    assert latest.metrics["time_total_s"] == 3.0
    assert trial.storage.current_checkpoint_index == 3  # the next one is checkpoint_000004
    assert trial.run_metadata.checkpoint_manager.best_checkpoint_results == [latest]  # the gone one untracked
    # the older and the torn one are deleted: nothing names them, so Tune never would
    assert sorted(p.name for p in Path(trial.storage.trial_fs_path).iterdir()) == ["checkpoint_000003", "whole.pt"]


@pytest.mark.parametrize("left", ["none", "torn"])
def test_with_no_checkpoint_that_loads_the_trial_starts_over(tmp_path, left):
    trial = _trial(tmp_path)
    _name(trial, 5, {"training_iteration": 6})
    if left == "torn":
        _checkpoint(trial, 6)
    assert "no other checkpoint loads; starting it over" in recover_missing_checkpoint(trial)
    assert trial.latest_checkpoint_result is None  # Tune starts the trial without a restore
    assert trial.storage.current_checkpoint_index == -1
    assert not list(Path(trial.storage.trial_fs_path).glob("checkpoint_*"))
