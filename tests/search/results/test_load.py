"""search.load: a study folder written by the results store, read back for a notebook."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pyarrow.parquet as pq
import pytest

import search
from search import EPOCH_COLUMNS, TRIAL_COLUMNS, ResultsStore

SPACE = {"locality_strength": {"type": "uniform", "low": 0.1, "high": 3.0}}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
META = {
    "name": "tiny",
    "objectives": [list(o) for o in OBJECTIVES],
    "spec": {"name": "tiny", "objectives": [{"metric": m, "mode": mode} for m, mode in OBJECTIVES]},
}
# trial, state, val_acc, throughput
TRIALS = [
    ("t0", "COMPLETE", 0.95, 1000.0),  # most accurate
    ("t1", "COMPLETE", 0.90, 4000.0),  # the knee
    ("t2", "COMPLETE", 0.70, 5000.0),  # fastest
    ("t3", "COMPLETE", 0.80, 3000.0),  # dominated by t1
    ("t4", "PRUNED", 0.99, 9000.0),  # better than all, but stopped early: not on the front
    ("t5", "FAILED", None, None),
]


def _study(tmp_path, *, epochs: bool = True):
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    now = dt.datetime.now(dt.timezone.utc)
    for i, (trial_id, state, acc, tput) in enumerate(TRIALS):
        row = {"trial_id": trial_id, "state": state, "val_acc": acc, "throughput": tput, "params": 100 + i}
        store.add_trial(row, {"locality_strength": 0.5 + i})
        for epoch in (1, 2):
            store.add_epoch({"trial_id": trial_id, "epoch": epoch, "val_acc": acc, "reported_at": now})
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps(META))
    if not epochs:
        (tmp_path / "epochs.parquet").unlink()
    return tmp_path


def test_load_reads_every_file(tmp_path):
    exp = search.load(_study(tmp_path))
    assert isinstance(exp, search.Experiment)
    assert exp.path == tmp_path
    assert exp.spec == META
    assert exp.objectives == OBJECTIVES
    assert list(exp.trials["trial_id"]) == [t[0] for t in TRIALS]
    assert set(TRIAL_COLUMNS) | {"locality_strength"} == set(exp.trials.columns)
    assert len(exp.epochs) == 2 * len(TRIALS)
    assert set(exp.epochs.columns) == set(EPOCH_COLUMNS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.trials = None


def test_front_is_the_complete_trials_front(tmp_path):
    exp = search.load(_study(tmp_path))
    front = exp.front()
    assert list(front["trial_id"]) == ["t0", "t1", "t2"]  # best first on val_acc; no t3, t4, t5
    # The same rows as the CLI's front and as the store's own pareto.parquet.
    assert list(search.front_of(tmp_path)[0]["trial_id"]) == ["t0", "t1", "t2"]
    assert pq.read_table(tmp_path / "pareto.parquet").column("trial_id").to_pylist() == ["t0", "t1", "t2"]


def test_select_and_hypervolume_on_a_study(tmp_path):
    exp = search.load(_study(tmp_path))
    assert exp.select()["trial_id"] == "t1"  # knee by default
    assert exp.select(rule="max-acc")["trial_id"] == "t0"
    assert exp.select(rule="max-throughput")["trial_id"] == "t2"
    assert search.select(exp.front(), objectives=exp.objectives, rule="knee")["trial_id"] == "t1"
    # Staircase above (0.5, 0): t0 0.45 x 1000, t1 0.40 x 3000 more, t2 0.20 x 1000 more.
    assert exp.hypervolume(reference=[0.5, 0.0]) == pytest.approx(450 + 1200 + 200)
    # The pruned t4 would dominate everything: the complete-only volume must not see it.
    assert search.front_hypervolume(exp.trials, objectives=exp.objectives, reference=[0.5, 0.0]) > 1850


def test_no_epochs_file_gives_an_empty_typed_table(tmp_path):
    exp = search.load(_study(tmp_path, epochs=False))
    assert exp.epochs.empty
    assert list(exp.epochs.columns) == list(EPOCH_COLUMNS)


def test_a_study_with_no_complete_trial(tmp_path):
    store = ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES)
    store.add_trial({"trial_id": "t0", "state": "PRUNED", "val_acc": 0.5, "throughput": 10.0}, {})
    store.flush()
    (tmp_path / "experiment.json").write_text(json.dumps(META))
    exp = search.load(tmp_path)
    assert exp.front().empty
    with pytest.raises(ValueError, match="no trial has completed"):
        exp.select(rule="knee")
    assert exp.hypervolume(reference=[0.0, 0.0]) == 0.0


def test_not_a_study_folder(tmp_path):
    with pytest.raises(ValueError, match="no trials.parquet"):
        search.load(tmp_path)
    ResultsStore(tmp_path, space=SPACE, objectives=OBJECTIVES).flush()
    with pytest.raises(ValueError, match="experiment.json: missing"):
        search.load(tmp_path)
