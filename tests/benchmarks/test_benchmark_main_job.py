"""The main-job benchmark's record, from a tiny synthetic study's tables; no run, no timings."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pytest

import benchmarks._env
from benchmarks.main_job import _front_table, front_span, main, proposal_seconds, summarise_run, with_algorithm

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


def _at(seconds: float) -> pd.Timestamp:
    return pd.Timestamp(T0 + dt.timedelta(seconds=seconds))


def test_front_span_and_the_closest_neighbours():
    assert front_span([1000.0, 3000.0, 1500.0]) == {"span": 3.0, "closest_neighbours_ratio": 1.5}
    assert front_span([800.0]) == {"span": 1.0, "closest_neighbours_ratio": None}
    assert front_span([]) == {"span": None, "closest_neighbours_ratio": None}


def test_summarise_run_reads_the_first_epoch_the_front_and_the_states():
    trials = pd.DataFrame({
        "trial_id": ["a", "b", "c"],
        "state": ["COMPLETE", "COMPLETE", "PRUNED"],
        "val_acc": [0.81, 0.78, 0.70],
        "throughput": [1000.0, 2500.0, 4000.0],
        "started_at": [_at(40.0), _at(70.0), _at(100.0)],
    })
    epochs = pd.DataFrame({
        "trial_id": ["b", "a", "a", "b"],
        "epoch": [1, 1, 2, 2],
        "epoch_time_s": [5.0, 12.0, 12.0, 5.0],
        "reported_at": [_at(80.0), _at(60.0), _at(75.0), _at(90.0)],
    })
    front = trials[trials["state"] == "COMPLETE"].assign(params=[1, 2], flops=[3, 4], epochs_run=[2, 2])
    record = summarise_run(trials=trials, epochs=epochs, front=front, started_at=T0, setup_done_s=30.0,
                           finished_s=130.0, objectives=[("val_acc", "max"), ("throughput", "max")])
    s = record["seconds"]
    assert s["to_first_epoch_report"] == 60.0  # trial a's, the first reported
    assert s["to_first_epoch_start"] == 48.0  # less its epoch's wall time
    assert s["first_trial_start_to_first_epoch_start"] == 8.0  # a started at 40 s
    assert (s["setup"], s["total"], s["after_setup"]) == (30.0, 130.0, 100.0)
    assert record["trials"] == {"finished": 3, "COMPLETE": 2, "PRUNED": 1}
    assert record["front_size"] == 2 and [r["trial_id"] for r in record["front"]] == ["a", "b"]
    assert record["throughput"]["span"] == pytest.approx(2.5)
    assert record["best_val_acc"] == 0.81 and record["epochs_trained"] == 4


def test_summarise_run_of_a_run_with_no_epoch():
    trials = pd.DataFrame({"trial_id": ["a"], "state": ["FAILED"], "val_acc": [float("nan")],
                           "throughput": [float("nan")], "started_at": [_at(5.0)]})
    epochs = pd.DataFrame({"trial_id": [], "epoch": [], "epoch_time_s": [], "reported_at": []})
    record = summarise_run(trials=trials, epochs=epochs, front=trials.iloc[:0], started_at=T0, setup_done_s=None,
                           finished_s=9.0, objectives=[("val_acc", "max")])
    assert record["seconds"]["to_first_epoch_start"] is None and record["seconds"]["after_setup"] is None
    assert record["front_size"] == 0 and record["best_val_acc"] is None
    assert record["throughput"] == {"span": None, "closest_neighbours_ratio": None}


def test_the_front_as_printed_runs_to_the_results_line():
    """The members' table and the block of those dominated within noise, without the blank line before 'results:'."""
    lines = ["[1/2] COMPLETE ...", "", "Pareto front (val_acc max, throughput max), 1 trial:", "trial_id val_acc",
             "a 0.81", "", "dominated within noise, so not on the front (1): ...", "trial_id val_acc dominated_by",
             "b 0.70 a", "", "results: ..."]
    assert _front_table(lines) == lines[2:9]
    assert _front_table(["no front here"]) == []


def test_append_to_another_specs_runs_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    env = benchmarks._env.environment()
    monkeypatch.setattr(benchmarks._env, "environment", lambda *a: env)  # (its git check reads RESULTS_DIR)
    monkeypatch.setattr(benchmarks._env, "RESULTS_DIR", tmp_path)
    earlier = tmp_path / f"main_job-{benchmarks._env.result_slug(env)}.json"
    earlier.write_text('{"config": {"spec": "spaces/convit_locality.yaml", "profile": null}, "runs": [{"run": 1}]}')
    before = earlier.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        main(["--spec", "other.yaml", "--append", "--cache-home", str(tmp_path / "cache")])
    assert exit_.value.code == 2
    assert "--result-name" in capsys.readouterr().err
    assert earlier.read_bytes() == before and not (tmp_path / "cache").exists()


def test_with_algorithm_changes_the_run_profiles_sampler_only(tmp_path):
    from search.spec import load_spec

    derived = with_algorithm("spaces/convit_locality.yaml", profile=None, algorithm={"name": "botorch", "levels": 5},
                             into=tmp_path)
    cpu, gpu = load_spec(derived), load_spec(derived, profile="gpu")
    assert (cpu.algorithm.name, cpu.algorithm.levels, cpu.algorithm.seed, cpu.algorithm.n_startup_trials) == (
        "botorch", 5, 0, 8)  # the file's seed and start-up kept
    assert (gpu.algorithm.name, gpu.algorithm.levels) == ("tpe", None)  # its space at 5 levels: over 20,000 points
    assert cpu.space == load_spec("spaces/convit_locality.yaml").space


def test_proposal_seconds_asks_the_studys_sampler_once_more_from_its_journal(tmp_path):
    import optuna

    from search.spec import load_spec
    from search.study.searcher import optuna_space

    derived = with_algorithm("spaces/convit_locality.yaml", profile=None, algorithm={"name": "botorch", "levels": 2},
                             into=tmp_path)
    spec = load_spec(derived)
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(study_dir / "optuna.journal")))
    study = optuna.create_study(study_name=spec.name, storage=storage, directions=["maximize", "maximize"],
                                sampler=optuna.samplers.RandomSampler(seed=0))
    for k in range(9):  # past the spec's 8 start-up trials: the next proposal fits BoTorch's GP
        trial = study.ask()
        config = {**(optuna_space(spec)(trial) or {}), **trial.params}
        study.tell(trial, [0.6 + 0.01 * k, 1000.0 / config["depth"]])
    timed = proposal_seconds(derived, profile=None, study=study_dir, repeats=2)
    assert timed["algorithm"] == "botorch" and (timed["trials"], timed["complete"]) == (9, 9)
    assert len(timed["seconds"]) == 2 and all(s > 0 for s in timed["seconds"])
    states = [t.state.name for t in optuna.load_study(study_name=spec.name, storage=storage).trials]
    assert states == ["COMPLETE"] * 9 + ["FAIL"] * 2  # the timed asks are not left RUNNING
    assert proposal_seconds(derived, profile=None, study=tmp_path) is None  # no journal: a grid study
