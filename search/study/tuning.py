"""One stage of a study as Ray Tune runs it: the search (``ray/``) or its confirmation
(``ray-confirm/``), each a Tune experiment of the study's trainable, built new or restored from
Tune's snapshot, then run to the end with its errors in one line.

Ray, Optuna and the Tune plug-ins are imported inside the functions that use them:
`search.study.runner` imports this module, and `import search` imports the runner.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from search.results.location import StudyLocation
from search.results.store import TRIAL_VALUE_OF, ResultsStore
from search.spec import SearchSpec
from search.study.prepare import dataset_request, seed_datasets
from trainers.data import PreparedDataset
from trainers.errors import DiskFullError

__all__ = ["StudyRun", "SEARCH_TUNE_DIR", "tune_environment", "trial_label", "trial_dirname", "store_for",
           "can_restore", "no_results_preview_warning"]

SEARCH_TUNE_DIR = "ray"  # Tune's experiment of the search, in the study's folder (the confirmation's beside it)


def tune_environment() -> None:
    """Optuna and Tune set up for a study's driver, before Tune starts."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # The store keeps the results; of Tune's own loggers only the JSON one is kept (its
    # ResultGrid reads result.json), not TensorBoard's and the CSV one.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # Every epoch checkpoints (so trials can be restored), which makes Tune warn about frequent
    # experiment snapshots; at one epoch per tens of seconds that cost is negligible.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Snapshot the experiment (trials, searcher) at least every second, so a killed driver
    # loses at most a second of bookkeeping (the default waits up to 10 s).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_label(trial: Any) -> str:
    """'<id>_locality_strength=1.2,local_up_to_layer=3' — what the trial tries, at a glance."""
    config = ",".join(f"{k}={_short(v)}" for k, v in sorted(trial.config.items()))
    return f"{trial.trial_id}_{config}"


def trial_dirname(trial: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]", "_", trial_label(trial))[:120]


def store_for(spec: SearchSpec, location: StudyLocation) -> ResultsStore:
    """The study's results store at ``location`` (its rows not read yet: ``load_existing``)."""
    objectives = [(o.metric, o.mode) for o in spec.objectives]
    return ResultsStore(location.local, space={k: p.to_json() for k, p in spec.all_params().items()},
                        objectives=objectives, reference=spec.reference_point,
                        location=location)


def can_restore(location: StudyLocation, name: str) -> bool:
    """Whether Tune saved the state of the stage ``name`` (``ray``, ``ray-confirm``) at ``location``."""
    from ray import tune

    return tune.Tuner.can_restore(location.tune_dir(name), storage_filesystem=location.tune_storage()[1])


@dataclass(frozen=True)
class StudyRun:
    """A study this driver runs: what every stage needs, and the Tune experiment of each."""

    spec: SearchSpec
    location: StudyLocation
    data: PreparedDataset
    cache_dir: str | os.PathLike | None
    commit: str | None  # the code's git commit, in every row the driver writes
    out: TextIO
    # the Ray cluster is this driver's own (no --address): one machine, idle once the trials are done
    local_cluster: bool = False

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def store(self) -> ResultsStore:
        return store_for(self.spec, self.location)

    def trainable(self):
        """The trainable of every trial: the spec's models, training and data, with its resources."""
        from ray import tune

        from search.study.trainable import run_tune_trial

        return tune.with_resources(tune.with_parameters(run_tune_trial, template=self.trial_template()),
                                   self.spec.resources.ray_resources())

    def trial_template(self):
        """What every trial of the study shares (search.study.trainable.TrialTemplate)."""
        from search.study.trainable import TrialTemplate

        spec = self.spec
        return TrialTemplate(
            models={m.name: dict(m.args) for m in spec.candidates},
            data=self.data,
            epochs=spec.budget.max_epochs,
            train=spec.train,
            throughput=spec.throughput,
            patience=spec.budget.patience,
            seed=spec.algorithm.seed,
            constraints=spec.parsed_constraints,
            # Each node converts the data (once, under a lock) and keeps its throughput measurements
            # in --cache-dir when given (a path valid on every node), else in its own default cache.
            dataset=dataset_request(spec),
            cache_dir=str(Path(self.cache_dir).expanduser().resolve()) if self.cache_dir else None,
            seed_data=seed_datasets(spec, self.cache_dir),  # converted already by prepare_study
        )

    def store_callback(self, store: ResultsStore, *, replicates: bool = False, total_trials: int | None = None):
        """The callback that writes each trial's rows to ``store`` (a stage's replicates with ``replicates``)."""
        from search.study.callbacks import StoreCallback

        spec = self.spec
        return StoreCallback(
            store,
            experiment=spec.name,
            model=spec.candidates[0].name,
            spec_hash=spec.spec_hash,
            git_commit=self.commit,
            seed=spec.algorithm.seed,
            total_trials=spec.planned_trials if total_trials is None else total_trials,
            time_limit_s=spec.budget.time_limit_s,
            max_epochs=spec.budget.max_epochs,
            objective_keys=[TRIAL_VALUE_OF[o.metric] for o in spec.objectives],
            replicates=replicates,
            out=self.out,
        )

    def new_tuner(self, callback, *, name: str, search_alg, scheduler, num_samples: int, time_budget_s: float | None):
        """Tune's run of the stage ``name``, new: the trainable, ``search_alg``, ``scheduler`` and the callbacks."""
        from ray import tune
        from ray.tune.logger import JsonLoggerCallback

        from search.study.metrics import MetricsCallback
        from search.study.progress import ProgressBar
        from search.study.recovery import CheckpointRecovery
        from search.study.snapshot import SnapshotKeeper

        location, out = self.location, self.out
        return tune.Tuner(
            self.trainable(),
            tune_config=tune.TuneConfig(
                search_alg=search_alg,
                scheduler=scheduler,
                num_samples=num_samples,
                reuse_actors=True,
                time_budget_s=time_budget_s,
                trial_name_creator=trial_label,
                trial_dirname_creator=trial_dirname,
            ),
            run_config=tune.RunConfig(
                name=name,
                # Checkpoints and Tune's own state: written from every node, so a URI or shared path
                storage_path=location.tune_storage()[0],
                storage_filesystem=location.tune_storage()[1],
                # Order matters: checkpoints are recovered before a resumed trial restores, the bar is
                # erased before the store prints a trial's line, and the metrics read the store after
                # it has the trial's row.
                callbacks=[CheckpointRecovery(out=out), ProgressBar(callback, stream=out), callback,
                           MetricsCallback(callback.store, experiment=self.spec.name, total_trials=callback.total_trials),
                           SnapshotKeeper(), JsonLoggerCallback()],
                verbose=0,
                checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                failure_config=tune.FailureConfig(max_failures=self.spec.budget.max_failures),
            ),
        )

    def restored_tuner(self, name: str):
        """Tune's run of the stage ``name`` as its snapshot left it: finished trials stay, the
        unfinished ones go on from their last checkpoint. The searcher, the scheduler and the
        callbacks come back from the snapshot (the store callback reloads the rows already written)."""
        from ray import tune

        self._mend_snapshot(name)
        with no_results_preview_warning():
            return tune.Tuner.restore(
                self.location.tune_dir(name),
                trainable=self.trainable(),
                storage_filesystem=self.location.tune_storage()[1],
                resume_unfinished=True,
                resume_errored=False,  # trials that raised stay FAILED; the ones the dying driver cut off are "unfinished"
                restart_errored=False,
            )

    def fit(self, tuner) -> None:
        """Run ``tuner`` to the end; a full disk anywhere under it is one line naming the fix."""
        with no_results_preview_warning(), _disk_full_in_one_line(self.location):
            tuner.fit()

    def _mend_snapshot(self, name: str) -> None:
        """Tune's snapshot cut short by a full disk: the last complete one put back (search.study.snapshot).
        A study at a URI is read as it is: Tune uploads only snapshots it finished writing."""
        from search.study.snapshot import drop_cut_error_pickles, restore_last_good

        if self.location.uri is None:
            said = restore_last_good(self.location.local / name)
            if said:
                self.say(said)
            drop_cut_error_pickles(self.location.local / name)


@contextlib.contextmanager
def _disk_full_in_one_line(location: StudyLocation):
    """A full disk anywhere under Tune (the store's files, the Optuna journal, Tune's snapshot) as
    one line naming the fix, however Tune wrapped the error it met."""
    from trainers.errors import is_disk_full

    try:
        yield
    except Exception as exc:
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, DiskFullError):
                raise seen.with_traceback(None) from None
            if is_disk_full(seen):
                raise DiskFullError(f"{seen.filename or location}: the disk is full; free space on the study's file "
                                    f"system, then python -m search resume {location}", path=seen.filename) from None
            seen = seen.__cause__ or seen.__context__
        raise


@contextlib.contextmanager
def no_results_preview_warning():
    """``Tuner.restore`` and the end of ``Tuner.fit`` read every trial's ``result.json`` into
    Tune's results (for ``tuner.get_results()``, which is never called here: the store has the
    results) and warn "Failed to fetch metrics" for each trial that has none -- one the snapshot
    has as not started, one the killed driver had not synced, one sampled but not started when
    the time limit ended the study. Only that warning, only there."""
    logger = logging.getLogger("ray.tune.analysis.experiment_analysis")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to fetch metrics")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
