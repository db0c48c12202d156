"""train.num_workers: auto gives FFCV's loader the CPUs the trial was given (Ray's
resources.cpus in a search), within [2, 8]; a number is kept as it is."""

from __future__ import annotations

import os

import pytest

from trainers._cpu import cpus_given
from trainers.config import SettingError, TrainSettings


@pytest.mark.parametrize("affinity, omp, threads", [
    (16, None, 8),      # a 16-core GPU host outside Ray: capped at 8, the most measured
    (16, "4", 4),       # a trial that asked for 4 CPUs
    (16, "1", 2),       # one CPU: still the 2 threads of the old fixed default
    (16, "12,2", 8),    # a nested OMP_NUM_THREADS: its first level counts
    (16, "many", 8),    # not a number: ignored
    (3, "6", 3),        # more threads asked for than the process may run on
    (2, None, 2),       # this 2-core CI machine: what the default was before auto
])
def test_auto_loader_threads_follow_the_cpus_given(monkeypatch, affinity, omp, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert TrainSettings().num_workers == "auto"
    assert TrainSettings().loader_threads == threads
    assert TrainSettings(num_workers=12).loader_threads == 12  # a number is the user's choice


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "many", None])
def test_num_workers_rejects_what_is_not_a_thread_count(bad):
    with pytest.raises(SettingError, match="must be a whole number of threads, at least 1, or auto") as info:
        TrainSettings(num_workers=bad)
    assert info.value.key == "num_workers"


@pytest.mark.ray
def test_a_tune_trial_is_given_its_resources_cpus(monkeypatch, tmp_path):
    """What auto relies on: in a Tune trial started as the runner starts them
    (``tune.with_resources``), ``cpus_given`` is the trial's CPU request, not the machine's."""
    ray = pytest.importorskip("ray")
    from ray import tune

    monkeypatch.setenv("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def trainable(config):
        tune.report({"cpus_given": cpus_given(), "loader_threads": TrainSettings().loader_threads})

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        seen = {}
        for cpus in (1, 2):
            grid = tune.Tuner(tune.with_resources(trainable, {"cpu": cpus}),
                              run_config=tune.RunConfig(name=f"cpus{cpus}", storage_path=str(tmp_path), verbose=0)).fit()
            assert not grid.errors, grid.errors
            seen[cpus] = (grid[0].metrics["cpus_given"], grid[0].metrics["loader_threads"])
    finally:
        ray.shutdown()
    assert seen == {1: (1, 2), 2: (2, 2)}
