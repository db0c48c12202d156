"""Fake trainables that succeed, report NaN or inf, raise, or get cut short, in a real Tune run
with this project's searcher and store callback: the study finishes, and the store and Optuna
record each with the right state."""

from __future__ import annotations

import io
import logging
import math
import os

import optuna
import pyarrow.parquet as pq
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from search.results.location import JOURNAL_FILE
from search.results.store import ResultsStore
from search.spec import ParamSpec
from search.study.callbacks import StoreCallback
from search.study.searcher import HonestOptunaSearch, OptunaSpace
from search.study.tuning import no_results_preview_warning

pytestmark = pytest.mark.ray

KINDS = ["ok", "nan", "inf", "raise", "cut", "flaky"]
EXPECTED = {  # kind -> (store state, stop_reason, Optuna state)
    "ok": ("COMPLETE", "max_epochs", "COMPLETE"),
    "nan": ("FAILED", "error", "FAIL"),
    "inf": ("FAILED", "error", "FAIL"),
    "raise": ("FAILED", "error", "FAIL"),
    "cut": ("PRUNED", "scheduler", "PRUNED"),
    "flaky": ("COMPLETE", "max_epochs", "COMPLETE"),  # raises once; budget.max_failures retries it
}


def _fake_trainable(marker_dir: str):
    def trainable(config):  # defined in a function: shipped to the workers by value
        from pathlib import Path

        from ray import tune

        kind = config["kind"]
        if kind == "flaky":
            marker = Path(marker_dir) / "flaky-failed-once"
            if not marker.exists():
                marker.touch()
                raise RuntimeError("a transient failure")
            kind = "ok"
        if kind == "raise":
            tune.report({"epoch": 1, "best_val_acc": 0.5, "throughput": 100.0})
            raise RuntimeError("the fake trainable broke")
        if kind == "cut":  # would run 3 epochs; the run's stop criterion cuts it after 2
            for epoch in (1, 2, 3):
                tune.report({"epoch": epoch, "best_val_acc": 0.1 * epoch, "throughput": 50.0})
            return
        acc = {"ok": 0.9, "nan": math.nan, "inf": 0.7}[kind]
        throughput = math.inf if kind == "inf" else 200.0
        tune.report({"epoch": 1, "best_val_acc": acc, "throughput": throughput, "stop_reason": "max_epochs"})

    return trainable


@pytest.mark.ray(seconds=40)
def test_every_ending_is_recorded_with_its_state(tmp_path):
    import ray
    from ray import tune

    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    objectives = [("val_acc", "max"), ("throughput", "max")]
    space = {"kind": ParamSpec(type="choice", values=tuple(KINDS))}
    store = ResultsStore(tmp_path, space={"kind": space["kind"].to_json()}, objectives=objectives, reference=[0.0, 0.0])
    store.flush()
    study_storage = optuna.storages.InMemoryStorage()
    searcher = HonestOptunaSearch(
        space=OptunaSpace(space, {"fake": {}}), metric=["best_val_acc", "throughput"], mode=["max", "max"],
        sampler=optuna.samplers.RandomSampler(seed=0), points_to_evaluate=[{"kind": k} for k in KINDS],
        study_name="states", storage=study_storage,
    )
    out = io.StringIO()
    callback = StoreCallback(store, experiment="states", model="fake", spec_hash="x", git_commit=None, seed=0,
                             total_trials=len(KINDS), time_limit_s=None, max_epochs=1,
                             objective_keys=["best_val_acc", "throughput"], out=out)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        tuner = tune.Tuner(
            _fake_trainable(str(tmp_path)),
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=len(KINDS), max_concurrent_trials=1),
            run_config=tune.RunConfig(name="states", storage_path=str(tmp_path / "ray"), callbacks=[callback],
                                      stop={"training_iteration": 2}, verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=1)),
        )
        tuner.fit()
    finally:
        ray.shutdown()

    rows = pq.read_table(open(tmp_path / "trials.parquet", "rb")).to_pylist()
    assert sorted(r["kind"] for r in rows) == sorted(KINDS)
    for row in rows:
        state, reason, _ = EXPECTED[row["kind"]]
        assert (row["state"], row["stop_reason"]) == (state, reason), row
    by_kind = {r["kind"]: r for r in rows}
    assert "non-finite objective: best_val_acc=nan" in by_kind["nan"]["error"]
    assert "throughput=inf" in by_kind["inf"]["error"]
    assert "the fake trainable broke" in by_kind["raise"]["error"]  # after its one retry
    assert by_kind["flaky"]["val_acc"] == 0.9
    front = pq.read_table(open(tmp_path / "pareto.parquet", "rb")).to_pylist()
    assert sorted(r["kind"] for r in front) == ["flaky", "ok"]  # nothing unfinished or non-finite on the front
    progress = pq.read_table(open(tmp_path / "progress.parquet", "rb")).to_pylist()
    assert progress[-1]["hypervolume"] == pytest.approx(0.9 * 200.0)

    study = optuna.load_study(study_name="states", storage=study_storage)
    told = {t.params["kind"]: t.state.name for t in study.trials}
    assert told == {k: EXPECTED[k][2] for k in KINDS}
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert [t.values for t in complete] == [[0.9, 200.0], [0.9, 200.0]]


def test_trials_running_when_the_time_limit_ends_the_study_are_recorded(tmp_path):
    """Tune stops them without on_trial_complete: the store still gets a PRUNED / time_limit row
    with the epochs they reported (the main job on a slow CPU once lost two such trials), and the
    Optuna study in the journal beside it (as the runner keeps it) has them PRUNED, not RUNNING."""
    import ray
    from ray import tune
    from ray.tune.stopper import Stopper

    class DeadlineAfterFirstReport(Stopper):
        """Tune's ``time_budget_s`` is a stopper whose ``stop_all`` turns true at a wall-clock
        deadline; this one turns true once a trial has reported, so the test does not depend on
        how fast a loaded machine starts Ray's worker (CI once took over 6 s)."""

        def __init__(self) -> None:
            self.reported = False

        def __call__(self, trial_id: str, result: dict) -> bool:
            self.reported = True
            return False

        def stop_all(self) -> bool:
            return self.reported

    def slow(config):
        import time

        from ray import tune

        tune.report({"epoch": 1, "best_val_acc": 0.5, "throughput": 10.0})
        time.sleep(120)  # the study's time limit stops it here

    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    space = {"kind": ParamSpec(type="choice", values=("slow",))}
    store = ResultsStore(tmp_path, space={"kind": space["kind"].to_json()},
                         objectives=[("val_acc", "max"), ("throughput", "max")], reference=[0.0, 0.0])
    store.flush()
    callback = StoreCallback(store, experiment="limited", model="fake", spec_hash="x", git_commit=None, seed=0,
                             total_trials=2, time_limit_s=1e-3, max_epochs=3,  # past when the stopper fires
                             objective_keys=["best_val_acc", "throughput"], out=io.StringIO())
    journal = JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL_FILE)))
    searcher = HonestOptunaSearch(
        space=OptunaSpace(space, {"fake": {}}), metric=["best_val_acc", "throughput"], mode=["max", "max"],
        sampler=optuna.samplers.RandomSampler(seed=0), study_name="limited", storage=journal,
    )
    warnings: list[str] = []
    tune_results = logging.getLogger("ray.tune.analysis.experiment_analysis")
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    tune_results.addHandler(handler)
    # one CPU, two trials at once: the second is sampled but waits for the CPU until the limit
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        with no_results_preview_warning():
            tune.Tuner(
                slow,
                tune_config=tune.TuneConfig(search_alg=searcher, num_samples=2, max_concurrent_trials=2),
                run_config=tune.RunConfig(name="limited", storage_path=str(tmp_path / "ray"), callbacks=[callback],
                                          stop=DeadlineAfterFirstReport(), verbose=0),
            ).fit()
    finally:
        ray.shutdown()
        tune_results.removeHandler(handler)
    rows = pq.read_table(open(tmp_path / "trials.parquet", "rb")).to_pylist()
    # the first trial ran (one epoch) and was cut; the second never started: no row
    assert [(r["state"], r["stop_reason"], r["epochs_run"]) for r in rows] == [("PRUNED", "time_limit", 1)], rows
    reread = optuna.load_study(study_name="limited",
                               storage=JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL_FILE))))
    assert [(t.state.name, t.user_attrs.get("stop_reason")) for t in reread.trials] == [("PRUNED", "time_limit")] * 2
    # Tune's end-of-fit results read the unstarted trial's missing result.json: its warning is
    # noise the runner filters (the store has the results)
    assert not [w for w in warnings if w.startswith("Failed to fetch metrics")], warnings


def test_a_full_disk_inside_a_hook_tune_wraps_stops_the_driver_at_the_next_step(tmp_path, monkeypatch):
    """Tune logs (with a traceback) and swallows what on_trial_complete raises: a full disk met
    there is raised at the next step instead, where it stops the driver with its one line."""
    from types import SimpleNamespace

    from trainers.errors import DiskFullError

    store = ResultsStore(tmp_path, space={"kind": ParamSpec(type="choice", values=tuple(KINDS)).to_json()},
                         objectives=[("val_acc", "max")], reference=[0.0])
    callback = StoreCallback(store, experiment="full", model="fake", spec_hash="x", git_commit=None, seed=0,
                             total_trials=1, time_limit_s=None, max_epochs=1, objective_keys=["best_val_acc"],
                             out=io.StringIO())
    callback.setup()
    full = DiskFullError(f"{tmp_path}/trials.parquet: the disk is full")

    def no_room() -> None:
        raise full

    monkeypatch.setattr(store, "flush", no_room)
    trial = SimpleNamespace(trial_id="t1", config={"kind": "ok"}, last_result={"epoch": 1, "best_val_acc": 0.5,
                                                                             "stop_reason": "max_epochs"},
                            num_failures=0)
    callback.on_trial_complete(iteration=1, trials=[trial], trial=trial)  # as Tune calls it: nothing escapes
    with pytest.raises(DiskFullError) as raised:
        callback.on_step_end(iteration=1, trials=[trial])
    assert raised.value is full
    with pytest.raises(DiskFullError):
        callback.on_experiment_end(trials=[trial])
