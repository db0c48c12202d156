"""A real search: real Ray (a local cluster), real FFCV files, Optuna, the Parquet store.

The synthetic dataset keeps it to about a minute on two cores. One searched learning rate is
absurd on purpose (1e30): its trials must end FAILED with the reason, and the search go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from search.results.store import EPOCH_COLUMNS, TRIAL_COLUMNS
from trainers.corruptions import corruption_names

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.ray


def _spec(tmp_path: Path) -> Path:
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec["name"] = "e2e"
    spec["storage"] = str(tmp_path / "results")
    spec["space"]["lr"] = {"type": "choice", "values": [2.0e-3, 1.0e30]}
    spec["budget"]["trials"] = 4
    spec["budget"]["max_epochs"] = 2
    spec["algorithm"] = {"name": "random", "seed": 3}
    spec["dataset"]["corruptions"] = True  # the held-out test also on corrupted copies (trainers.corruptions)
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOCALITY_SEARCH_CACHE=str(tmp_path / "cache"), LOCALITY_SEARCH_RAY_DASHBOARD="1")
    env.pop("RAY_ADDRESS", None)  # always the embedded local cluster here, with its dashboard (the suite's are off)
    return subprocess.run(
        [sys.executable, "-m", "search", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("e2e")
    proc = _run("run", str(_spec(tmp_path)), tmp_path=tmp_path)
    return tmp_path / "results" / "e2e", proc


@pytest.mark.ray(seconds=100)
def test_run_finishes_and_prints_the_front(study):
    exp_dir, proc = study
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Ray dashboard: http://127.0.0.1:" in proc.stdout
    assert "Pareto front" in proc.stdout
    assert proc.stdout.count("[") >= 4  # one progress line per finished trial


def test_three_parquet_files_with_expected_columns_and_states(study):
    exp_dir, proc = study
    trials = pq.read_table(exp_dir / "trials.parquet").to_pylist()
    epochs = pq.read_table(exp_dir / "epochs.parquet").to_pylist()
    front = pq.read_table(exp_dir / "pareto.parquet").to_pylist()
    assert len(trials) == 4
    assert set(TRIAL_COLUMNS) | {"locality_strength", "local_up_to_layer", "lr"} == set(trials[0])
    assert set(EPOCH_COLUMNS) == set(epochs[0])
    # the trainer's own timings reach the store through Tune (the wait is part of the epoch)
    assert all(0 <= e["train_loader_wait_s"] < e["epoch_time_s"] for e in epochs), epochs

    by_state = {}
    for row in trials:
        by_state.setdefault(row["state"], []).append(row)
    assert set(by_state) == {"COMPLETE", "FAILED"}, [(t["state"], t["lr"], t["error"]) for t in trials]
    for row in by_state["FAILED"]:
        assert row["lr"] == 1e30
        assert row["error"].startswith("NonFiniteLossError: training loss became")
        assert row["stop_reason"] == "error"
    for row in by_state["COMPLETE"]:
        assert row["lr"] == 2e-3
        assert row["epochs_run"] == 2 and row["stop_reason"] == "max_epochs"
        assert 0.0 <= row["val_acc"] <= 1.0
        assert row["throughput"] > 0 and row["params"] > 0 and row["flops"] > 0
        assert row["throughput_device"].startswith("cpu") and row["throughput_batch"] == 64
        assert row["family"] == "convit" and row["model"] == "ls_convit_nano"
        assert row["started_at"] <= row["ended_at"]
        assert len(row["spec_hash"]) == 16
        per_trial = [e for e in epochs if e["trial_id"] == row["trial_id"]]
        assert [e["epoch"] for e in per_trial] == [1, 2]
        assert max(e["val_acc"] for e in per_trial) == pytest.approx(row["val_acc"])

    complete_ids = {t["trial_id"] for t in by_state["COMPLETE"]}
    assert front and {t["trial_id"] for t in front} <= complete_ids
    meta = json.loads((exp_dir / "experiment.json").read_text())
    assert meta["objectives"] == [["val_acc", "max"], ["throughput", "max"]]


def test_pareto_command_reads_the_study(study, tmp_path):
    exp_dir, _ = study
    proc = _run("pareto", str(exp_dir), "--format", "json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    front = pq.read_table(exp_dir / "pareto.parquet").to_pylist()
    members = [r["trial_id"] for r in rows if r["dominated_by"] is None]  # the rest: dominated within noise, apart
    assert sorted(members) == sorted(r["trial_id"] for r in front)


def test_resume_of_a_finished_study_says_so_in_one_line_without_ray(study, tmp_path):
    exp_dir, _ = study
    before = {p.name: p.stat().st_mtime_ns for p in exp_dir.iterdir() if p.is_file() and p.name != "driver.lock"}
    proc = _run("resume", str(exp_dir), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "study e2e is finished (4 of 4 trials); nothing left to resume in" in proc.stdout
    assert "Ray dashboard" not in proc.stdout and "resuming study" not in proc.stdout  # Ray never started
    assert "Traceback" not in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in exp_dir.iterdir()
            if p.is_file() and p.name != "driver.lock"} == before  # nothing rewritten (the driver's lock aside)


def test_rerun_into_the_same_folder_is_refused(study, tmp_path):
    exp_dir, _ = study
    spec = _spec(exp_dir.parent.parent)
    proc = _run("run", str(spec), tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "already holds a study" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_dataset_is_a_one_line_error(tmp_path):
    spec = yaml.safe_load((ROOT / "spaces" / "convit_locality.yaml").read_text())
    spec["storage"] = str(tmp_path)
    path = tmp_path / "fm.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = _run("run", str(path), "--data-dir", str(tmp_path / "nowhere"), tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--data-dir" in proc.stderr
    assert not (tmp_path / "convit_locality" / "trials.parquet").exists()


def test_the_fronts_trials_are_scored_once_on_the_test_split_at_their_best_validation_epoch(study):
    exp_dir, proc = study
    trials = pq.read_table(exp_dir / "trials.parquet").to_pylist()
    epochs = pq.read_table(exp_dir / "epochs.parquet").to_pylist()
    front = {r["trial_id"] for r in pq.read_table(exp_dir / "pareto.parquet").to_pylist()}
    # one stage, every trial in it once: its announcement, then its end
    assert proc.stdout.count("held-out test:") == 2 and f"held-out test: {len(front)} trial" in proc.stdout
    held = json.loads((exp_dir / "heldout.json").read_text())
    assert held["not_tested"] == {} and sorted(held["tested"]) == sorted(front)
    for row in trials:
        if row["trial_id"] not in front:  # selected on nothing, scored on nothing
            assert row["test_acc"] is None and row["test_epoch"] is None and row["test_corrupted"] is None
            continue
        corrupted = dict(row["test_corrupted"])
        assert sorted(corrupted) == sorted(corruption_names()) and all(0.0 <= v <= 1.0 for v in corrupted.values())
        per_trial = [e for e in epochs if e["trial_id"] == row["trial_id"]]
        best = max(per_trial, key=lambda e: (e["val_acc"], -e["epoch"]))  # the first epoch at the best
        assert row["test_epoch"] == best["epoch"] == per_trial[-1]["best_epoch"]
        assert 0.0 <= row["test_acc_low"] <= row["test_acc"] <= row["test_acc_high"] <= 1.0
        assert row["test_images"] > 0 and row["test_loss"] > 0
    assert "test_acc" in proc.stdout.split("Pareto front")[-1]
