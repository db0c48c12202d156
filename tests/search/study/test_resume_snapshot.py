"""Crash-safe resume when Tune's experiment snapshot names a checkpoint already deleted: a real
study whose driver is SIGKILLed between the two, then `python -m search resume`. Its own file, apart
from test_resume.py's kills: each takes minutes, and pytest-xdist hands out whole files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.search.study.test_resume import ROOT, _env, _read_all, _run_and_sigkill


@pytest.mark.ray(seconds=110)
def test_resume_when_tunes_snapshot_names_a_checkpoint_already_deleted(tmp_path):
    """Tune deletes a trial's checkpoints beyond ``num_to_keep`` when a newer one is registered
    and writes its experiment snapshot (what a resume starts from) later. A driver killed in
    between leaves a snapshot whose running trial's latest checkpoint is gone. Made certain here:
    Tune's snapshot is taken aside early in a trial, the trial runs 3 more epochs (its
    checkpoints of that time deleted), the driver is killed and the old snapshot put back."""
    EPOCHS = 48  # of 0.2-1 s each (by VM); the kill comes near epoch 7 (the driver takes up results a few at a
    # time, and writes the epochs every 2 s or more: with 24, a fast VM finished the trial unseen)
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="stale", storage=str(tmp_path / "results"))
    spec["budget"].update(trials=1, max_epochs=EPOCHS)  # one trial: the case needs no other
    path = tmp_path / "stale.yaml"
    path.write_text(yaml.safe_dump(spec))
    exp = tmp_path / "results" / "stale"
    tune_dir, aside = exp / "ray", tmp_path / "snapshot"

    def epochs_of_unfinished_trials() -> dict[str, int]:
        tables = _read_all(exp)
        done = {t["trial_id"] for t in tables.get("trials.parquet", [])}
        counts: dict[str, int] = {}
        for row in tables.get("epochs.parquet", []):
            if row["trial_id"] not in done:
                counts[row["trial_id"]] = counts.get(row["trial_id"], 0) + 1
        return counts

    def take_snapshot_aside() -> bool:
        """Tune's own files (not the trial folders), if they are whole at this moment."""
        shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir()
        states = []
        for file in tune_dir.iterdir():
            if file.is_file():
                shutil.copy2(file, aside / file.name)
                if file.name.startswith("experiment_state"):
                    states.append(aside / file.name)
        try:
            return bool(states) and all(json.loads(s.read_text())["trial_data"] for s in states)
        except (ValueError, KeyError):
            return False  # caught mid-upload: try again

    trial, taken_at = None, 0

    def old_checkpoints_of_a_trial_deleted() -> bool:
        nonlocal trial, taken_at
        counts = epochs_of_unfinished_trials()
        if trial is None:
            running, epochs = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
            if epochs >= 3 and take_snapshot_aside():
                trial, taken_at = running, epochs
            return False
        assert trial in counts, "the trial ended before its old checkpoints were deleted"
        return counts[trial] >= taken_at + 3

    _run_and_sigkill(path, _env(tmp_path), until=old_checkpoints_of_a_trial_deleted, what="far enough", watch=exp)
    for file in aside.iterdir():  # the driver "died" before its later snapshots reached storage
        shutil.copy2(file, tune_dir / file.name)
    before = {(e["trial_id"], e["epoch"]): e for e in _read_all(exp)["epochs.parquet"]}
    kept = sorted(p.name for p in tune_dir.glob(f"{trial}_*/checkpoint_*"))
    # the snapshot names the checkpoint of epoch `taken_at` (index taken_at - 1) or an older one:
    # all gone (num_to_keep), as are the ones of the epochs before
    assert kept and all(int(name.rsplit("_", 1)[1]) >= taken_at for name in kept), (taken_at, kept)

    resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(exp)], cwd=ROOT, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"trial {trial}: Tune's snapshot names checkpoint" in resumed.stdout, resumed.stdout
    assert "Traceback" not in resumed.stdout + resumed.stderr, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # (Tune's restore-time preview of results warned about the trial the snapshot had not started)
    assert "Failed to fetch metrics" not in resumed.stderr, resumed.stderr[-3000:]

    after = _read_all(exp)
    states = {t["trial_id"]: (t["state"], t["epochs_run"], t["error"]) for t in after["trials.parquet"]}
    assert len(states) == 1 and all(s[:2] == ("COMPLETE", EPOCHS) for s in states.values()), states
    pairs = [(e["trial_id"], e["epoch"]) for e in after["epochs.parquet"]]
    assert len(pairs) == len(set(pairs)) == EPOCHS  # every epoch once
    for trial_id in states:  # num_to_keep, the killed run's leftovers of the recovered trial included
        assert len(list(tune_dir.glob(f"{trial_id}_*/checkpoint_*"))) == 2
    now = {(e["trial_id"], e["epoch"]): e for e in after["epochs.parquet"]}
    assert all(now[key]["val_acc"] == row["val_acc"] for key, row in before.items())  # kept as they were
