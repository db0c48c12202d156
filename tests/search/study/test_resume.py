"""Crash-safe resume: a real study whose driver is SIGKILLed mid-run, then `python -m search resume`.

Checked: exactly the requested number of trials, no trial recorded twice, no configuration run
twice, every Parquet file readable at every moment (polled while the driver runs and dies), and
the Optuna journal agreeing with the store (nothing left RUNNING).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import optuna
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
FILES = ("trials.parquet", "epochs.parquet", "pareto.parquet", "progress.parquet")
TRIALS = 6

pytestmark = pytest.mark.ray


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, LOCALITY_SEARCH_CACHE=str(tmp_path / "cache"))
    env.pop("RAY_ADDRESS", None)
    return env


def _read_all(exp: Path) -> dict[str, list[dict]]:
    """Every store file, each opened once (a reader's view at one moment); raises if any is torn."""
    out = {}
    for name in FILES:
        path = exp / name
        if path.exists():
            with open(path, "rb") as handle:
                out[name] = pq.read_table(handle).to_pylist()
    return out


def _version(folder: Path | None) -> tuple | None:
    """The files directly in ``folder`` as they stand: a store file replaced (write, rename) changes it."""
    if folder is None or not folder.is_dir():
        return None
    return tuple(sorted((p.name, s.st_mtime_ns, s.st_size, s.st_ino)
                        for p in folder.iterdir() if p.is_file() for s in [p.stat()]))


def _run_and_sigkill(spec: Path, env: dict[str, str], *, until: Callable[[], bool], what: str,
                     watch: Path | None = None, poll: float = 0.05) -> None:
    """``search run spec``, SIGKILLed as soon as ``until()`` (polled every ``poll`` s) is true. With
    ``watch`` (the study folder), ``until()`` runs only when a file there changed: a poll that
    reads the whole store takes its CPU from the study it watches."""
    driver = subprocess.Popen([sys.executable, "-m", "search", "run", str(spec)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, seen = time.monotonic() + 300, object()
        while True:
            version = _version(watch)
            if watch is None or version != seen:
                seen = version
                if until():
                    break
            assert driver.poll() is None, driver.stdout.read()
            if time.monotonic() > deadline:
                pytest.fail(f"the study did not get {what} in 300 s")
            time.sleep(poll)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    time.sleep(2)  # Ray's reaper takes the killed driver's local cluster down


@pytest.mark.ray(seconds=140)
def test_sigkilled_driver_resumes_to_the_exact_trial_count(tmp_path):
    """The study folder moved elsewhere before the resume (its results must follow it), the Optuna
    journal lock still held by the killed driver. (A study at a URI killed and resumed "on another
    machine", another cache and staging folder: tests/search/results/test_storage.py, on S3.)"""
    spec = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    spec.update(name="killed", storage=str(tmp_path / "results"), algorithm={"name": "tpe", "seed": 5, "n_startup_trials": 3})
    spec["budget"].update(trials=TRIALS, max_epochs=4)  # continuous knobs: two equal configs cannot happen by chance
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(spec))
    exp = tmp_path / "results" / "killed"

    reads = 0

    def two_trials_done_a_third_mid_way() -> bool:
        nonlocal reads
        tables = _read_all(exp)  # must never fail, whatever the driver is doing
        reads += 1
        return len(tables.get("trials.parquet", [])) >= 2 and len(tables.get("epochs.parquet", [])) >= 9

    # every 50 ms, changed or not (no ``watch``): this test's reads land at any moment of the writes
    _run_and_sigkill(path, _env(tmp_path), until=two_trials_done_a_third_mid_way, what="two trials done")
    before = _read_all(exp)
    assert 2 <= len(before["trials.parquet"]) < TRIALS

    # Tune's snapshot, the store and the Optuna journal all name the old folder
    moved = tmp_path / "elsewhere" / "killed"
    moved.parent.mkdir()
    shutil.move(exp, moved)
    # as a driver killed while appending to the journal leaves it: Optuna's lock, a link to
    # the journal where it was (Optuna itself would wait forever on a link that dangles)
    (moved / "optuna.journal.lock").unlink(missing_ok=True)
    (moved / "optuna.journal.lock").symlink_to(exp / "optuna.journal")
    resumed = subprocess.run([sys.executable, "-m", "search", "resume", str(moved)], cwd=ROOT, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming study killed" in resumed.stdout
    assert f"it carries on in {moved}" in resumed.stdout, resumed.stdout
    assert not exp.exists()  # nothing written to where the study was
    exp = moved

    after = _read_all(exp)
    trials = after["trials.parquet"]
    ids = [t["trial_id"] for t in trials]
    assert len(trials) == TRIALS and len(set(ids)) == TRIALS, ids
    configs = [(t["locality_strength"], t["local_up_to_layer"], t["lr"]) for t in trials]
    assert len(set(configs)) == TRIALS, configs  # no configuration ran twice
    # Every trial ran to its end: all 4 epochs, or (recorded as data, not a resume fault) a
    # config whose loss diverged -- TPE's configs after the kill depend on when it came.
    diverged = [t for t in trials if t["state"] == "FAILED" and "training loss became" in (t["error"] or "")]
    assert all((t["state"] == "COMPLETE" and t["epochs_run"] == 4) or t in diverged for t in trials), \
        [(t["state"], t["epochs_run"], t["error"]) for t in trials]
    assert len(diverged) <= 1, [(t["lr"], t["error"]) for t in diverged]
    # the trials finished before the kill are kept as they were
    kept = {t["trial_id"]: t for t in trials}
    for row in before["trials.parquet"]:
        assert kept[row["trial_id"]]["val_acc"] == row["val_acc"]
    epochs = after["epochs.parquet"]
    pairs = [(e["trial_id"], e["epoch"]) for e in epochs]
    assert len(pairs) == len(set(pairs)) == sum(t["epochs_run"] for t in trials)  # every epoch once, the resumed trial's too
    assert [p["finished"] for p in after["progress.parquet"]] == list(range(1, TRIALS + 1))
    assert set(ids) == {p["trial_id"] for p in after["progress.parquet"]}

    # the Optuna study (its journal, as optuna-dashboard would open it) agrees with the store
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(exp / "optuna.journal")))
    study = optuna.load_study(study_name="killed", storage=journal)
    states = [t.state.name for t in study.trials]
    assert "RUNNING" not in states, states
    complete = {round(t.params["lr"], 12) for t in study.trials if t.state.name == "COMPLETE"}
    # (a trial that finished in the last second before the kill, after Tune's last snapshot, is
    # COMPLETE in the journal but its slot is sampled again: the store keeps the exact count)
    finished = {round(t["lr"], 12) for t in trials if t not in diverged}
    assert finished <= complete and len(complete) <= TRIALS + 1
    # (a trial the kill caught between Optuna's ask and its last suggest is marked FAIL at the
    # restore with only some of its params: it never reached Tune, so it has no store row)
    failed = {round(t.params["lr"], 12) for t in study.trials if t.state.name == "FAIL" and "lr" in t.params}
    assert all("orphaned" in t.user_attrs for t in study.trials if t.state.name == "FAIL" and "lr" not in t.params)
    assert {round(t["lr"], 12) for t in diverged} <= failed
    assert reads > 10
    print(f"\nSIGKILL after {len(before['trials.parquet'])} finished trials and {len(before['epochs.parquet'])} epochs; "
          f"after resume: {len(trials)} trials ({len(set(ids))} distinct ids, {len(set(configs))} distinct configs), "
          f"{len(pairs)} epoch rows, Optuna states {sorted(states)}; {reads} reads of all four files while it ran")


def test_resume_of_a_folder_that_is_not_a_study_is_a_one_line_error(tmp_path, capsys):
    from search.views.cli import main

    assert main(["resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no experiment.json" in err


def test_resume_of_a_study_that_ran_its_time_limit_says_so_without_starting_ray(tmp_path, capsys):
    """Its store's clock (the progress rows) is at the limit, as a study the limit ended leaves it:
    Tune would restore only to stop at once, so the resume says why and starts nothing."""
    import ray

    from search.results.location import StudyLocation
    from search.spec import load_spec, to_plain
    from search.study.tuning import store_for
    from search.views.cli import main

    raw = yaml.safe_load((ROOT / "spaces" / "synthetic_smoke.yaml").read_text())
    raw["budget"]["time_limit_s"] = 60
    (tmp_path / "limited.yaml").write_text(yaml.safe_dump(raw))
    spec = load_spec(tmp_path / "limited.yaml")
    study = tmp_path / "study"
    study.mkdir()
    (study / "experiment.json").write_text(json.dumps({  # as `search run` writes it
        "name": spec.name, "spec": to_plain(spec), "spec_hash": spec.spec_hash,
        "objectives": [[o.metric, o.mode] for o in spec.objectives], "reference_point": spec.reference_point}))
    store = store_for(spec, StudyLocation(str(study)))
    store.add_trial({"trial_id": "t1", "state": "PRUNED", "stop_reason": "time_limit", "epochs_run": 1}, {})
    store.add_progress(trial_id="t1", state="PRUNED", elapsed_s=61.5, at=None)
    store.flush()

    assert main(["resume", str(study)]) == 0
    out = capsys.readouterr().out
    assert f"study {spec.name} ran its time limit (62 s of budget.time_limit_s: 60); nothing left to resume" in out, out
    assert not ray.is_initialized()
