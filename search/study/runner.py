"""Run a study: spec -> dataset prepared once -> Ray Tune + Optuna -> results store.

    run_study       checks -> data, kernels, Ray -> experiment.json -> search -> confirmation
                    -> held-out test of the front
    resume_study    checks -> experiment.json's spec -> what is left? -> data, kernels, Ray
                    -> search taken up -> confirmation (taken up, or started) -> held-out test

One driver per study (search.study.driver) runs the stages, each a Tune experiment
(search.study.tuning): the search (search.study.search_stage, search.study.resume) and the
confirmation (search.study.confirm); then the front's trials are scored once on the test split
(search.study.heldout). Ray, Optuna, torch and the Tune plug-ins are imported
inside the functions that use them: `search pareto` and the other readers import this module's
package without paying for them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from search.results.location import StudyLocation, resuming_at, study_location
from search.spec import SearchSpec
from search.study.cluster import check_dashboard_host
from search.study.compat import moved_names
from search.study.confirm import confirm
from search.study.driver import driving
from search.study.heldout import test_front
from search.study.experiment import EXPERIMENT_FILE, check_new_study, no_study, recorded_spec, write_experiment
from search.study.prepare import prepare_study
from search.study.resume import check_restorable, nothing_left, resume_search
from search.study.search_stage import run_search
from search.study.tuning import StudyRun, tune_environment
from trainers import git_commit

__all__ = ["run_study", "resume_study", "check_dashboard_host"]


def run_study(
    spec: SearchSpec,
    *,
    address: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dashboard_host: str = "127.0.0.1",
    allow_remote_dashboard: bool = False,
    out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
) -> Path:
    """Run ``spec`` to the end; returns the experiment folder holding the Parquet files.

    Ray's dashboard binds ``dashboard_host``; an address other than loopback needs
    ``allow_remote_dashboard`` (``--allow-remote-dashboard``)."""
    out = out or sys.stdout
    check_dashboard_host(dashboard_host, allow_remote=allow_remote_dashboard, address=address)
    for note in spec.notes():
        print(f"note: {note}", file=out, flush=True)
    if spec.budget.trials != spec.planned_trials:  # a grid: what it runs is what the study records (experiment.json)
        spec = spec.with_overrides(trials=spec.planned_trials)
    tune_environment()
    location = study_location(spec.storage, spec.name)
    check_new_study(location)
    exp_dir = location.local  # with a URI: the staging folder, uploaded after every write
    data = prepare_study(spec, address=address, dashboard_host=dashboard_host, cache_dir=cache_dir, out=out)

    exp_dir.mkdir(parents=True, exist_ok=True)
    with driving(exp_dir):
        check_new_study(location)  # again: another driver may have started it meanwhile
        run = StudyRun(spec, location, data, cache_dir, git_commit(), out, local_cluster=address is None)
        write_experiment(spec, location, data, run.commit)
        run_search(run)
        confirm(run)
        test_front(run)
    return exp_dir


def resume_study(
    exp_dir: str | os.PathLike,
    *,
    address: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dashboard_host: str = "127.0.0.1",
    allow_remote_dashboard: bool = False,
    out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
) -> Path:
    """Finish a study whose driver stopped (killed, crashed, interrupted): finished trials stay,
    running ones continue from their last epoch checkpoint, the rest are sampled as before."""
    out = out or sys.stdout
    check_dashboard_host(dashboard_host, allow_remote=allow_remote_dashboard, address=address)
    tune_environment()
    location = StudyLocation(exp_dir)
    if not location.exists(EXPERIMENT_FILE):
        raise no_study(location)
    location.local.mkdir(parents=True, exist_ok=True)  # a URI's staging folder, filled by pull()
    with driving(location.local):
        location.pull()  # with a URI: the study's files into this machine's staging folder
        spec = recorded_spec(location)
        done = nothing_left(spec, location)
        if done:  # without Ray
            print(done, file=out, flush=True)
            return location.local
        check_restorable(location)
        data = prepare_study(spec, address=address, dashboard_host=dashboard_host, cache_dir=cache_dir, out=out)
        run = StudyRun(spec, location, data, cache_dir, git_commit(), out, local_cluster=address is None)
        # Tune's snapshot unpickled with this study location, wherever it was taken (search.results.location)
        with resuming_at(location) as elsewhere:
            resume_search(run, elsewhere)
            confirm(run)
            test_front(run)
    return location.local


# Tune's snapshots (tuner.pkl, the searcher's state) of studies begun before these moved name them here.
__getattr__ = moved_names(__name__, {"OptunaSpace": "search.study.searcher", "make_sampler": "search.study.searcher",
                                     "trial_label": "search.study.tuning", "trial_dirname": "search.study.tuning"})
