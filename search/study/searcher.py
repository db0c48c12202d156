"""What Optuna is told when a trial ends: only a trial that ran its full budget counts as done.

Ray's ``OptunaSearch`` tells Optuna COMPLETE, with the last reported values, for every trial
that reported anything -- a trial the scheduler stopped after one epoch included, and even a
trial that crashed after its first report. The sampler then models a one-epoch accuracy as if
it were a full run's. The rule here (docs/store.md#trial-states states it for users):

    finished by the trainer (max_epochs, or patience: more epochs stopped helping) -> COMPLETE
    stopped early by the scheduler or the time limit                                -> PRUNED
    rejected by a constraint before training                                        -> PRUNED, infeasible
    raised, or a non-finite objective                                                -> FAIL

The store uses the same rule (:func:`trial_state`), with REJECTED and FAILED as its names.

PRUNED and FAIL trials give Optuna no objective values. A rejected trial carries its
constraint violation (``user_attrs["constraint_violation"]``), which :func:`constraint_violation`
hands to samplers that take a ``constraints_func`` (TPE, NSGA-II), so they learn to avoid it.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

from ray.tune.search import SearchGenerator
from ray.tune.search.optuna import OptunaSearch

from search.results.location import JOURNAL_FILE, resumed_location

__all__ = ["HonestOptunaSearch", "StudySearchGenerator", "constraint_violation", "optuna_state_for", "trial_state",
           "nonfinite_objectives", "prune_running_trials"]

logger = logging.getLogger(__name__)


def constraint_violation(trial: Any) -> list[float]:
    """Optuna ``constraints_func``: > 0 for a trial a spec constraint rejected."""
    return [float(trial.user_attrs.get("constraint_violation", 0.0))]


def trial_state(result: dict[str, Any] | None, *, error: bool, metrics: list[str]) -> str:
    """COMPLETE, PRUNED, REJECTED or FAILED: the store's state of a trial that ended with
    ``result`` as its last report (the rule of the module doc)."""
    result = result or {}
    if error:
        return "FAILED"
    if result.get("rejected"):
        return "REJECTED"
    if "stop_reason" not in result:  # the trainer did not finish it: the scheduler or time limit did
        return "PRUNED"
    if nonfinite_objectives(result, metrics=metrics):
        return "FAILED"
    return "COMPLETE"


def nonfinite_objectives(result: dict[str, Any], *, metrics: list[str]) -> list[str]:
    """'best_val_acc=nan'-style descriptions of the objectives a result lacks or has non-finite."""
    bad = []
    for m in metrics:
        value = result.get(m)
        try:
            finite = value is not None and math.isfinite(float(value))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            bad.append(f"{m}={value}")
    return bad


_OPTUNA_STATE = {"COMPLETE": "COMPLETE", "PRUNED": "PRUNED", "REJECTED": "PRUNED", "FAILED": "FAIL"}


def optuna_state_for(result: dict[str, Any] | None, *, error: bool, metrics: list[str]) -> tuple[str, list[float] | None]:
    """('COMPLETE' | 'PRUNED' | 'FAIL', values or None): what Optuna is told (see the module doc)."""
    state = trial_state(result, error=error, metrics=metrics)
    values = [float((result or {})[m]) for m in metrics] if state == "COMPLETE" else None
    return _OPTUNA_STATE[state], values


def prune_running_trials(journal: Path, *, study_name: str, reason: str) -> int:
    """Mark PRUNED, with ``user_attrs["stop_reason"] = reason``, every trial of the Optuna study
    in ``journal`` that is still RUNNING; returns how many. For the end of a study that Tune
    stopped without telling the searcher (its time limit): by the rule above a trial stopped
    early is PRUNED, and one left RUNNING would stay so forever (optuna-dashboard, a sampler
    reading the study). No journal (a study without one): nothing to do."""
    if not journal.is_file():
        return 0
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    storage = JournalStorage(JournalFileBackend(str(journal)))
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # the journal holds no such study (nothing was sampled yet)
        return 0
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for frozen in running:
        storage.set_trial_user_attr(frozen._trial_id, "stop_reason", reason)
        storage.set_trial_state_values(frozen._trial_id, TrialState.PRUNED)
    return len(running)


class HonestOptunaSearch(OptunaSearch):
    """``OptunaSearch`` that reports trial ends by :func:`optuna_state_for`, and that cleans up
    after a killed driver when Tune restores it.

    With ``journal`` (the study's :class:`search.results.location.StudyLocation`), the Optuna study lives
    in ``optuna.journal`` of that study's local folder, reopened there at a restore: a study
    stored at a URI may be resumed on another machine, whose staging folder differs from the one
    in Tune's snapshot."""

    def __init__(self, *args: Any, journal: Any = None, **kwargs: Any) -> None:
        self._journal = journal
        if journal is not None:
            kwargs["storage"] = self._journal_storage()
        super().__init__(*args, **kwargs)

    def _journal_storage(self) -> Any:
        """The Optuna storage on this machine's journal file of the study."""
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(str(self._journal.local / JOURNAL_FILE)))

    def _reopen_journal(self) -> None:
        """Point the study (and the trials handed out) at this machine's journal file."""
        if getattr(self, "_journal", None) is None or self._ot_study is None:
            return
        import optuna

        storage = self._journal_storage()
        study = optuna.load_study(study_name=self._ot_study.study_name, storage=storage, sampler=self._ot_study.sampler)
        self._storage, self._ot_study = storage, study
        for trial in self._ot_trials.values():
            trial.study, trial.storage = study, storage

    def restore(self, checkpoint_path: str) -> None:
        """Tune's snapshot of this searcher, plus the Optuna study as its journal has it now. A
        trial Optuna handed out after the snapshot belongs to no Tune trial: it can never finish,
        so it is marked FAIL instead of staying RUNNING forever."""
        from optuna.trial import TrialState

        super().restore(checkpoint_path)
        self._reopen_journal()
        known = {t._trial_id for t in self._ot_trials.values()}
        for frozen in self._ot_study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if frozen._trial_id not in known:
                self._ot_study._storage.set_trial_user_attr(frozen._trial_id, "orphaned", "driver killed before Tune recorded the trial")
                self._ot_study._storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)

    def suggest(self, trial_id: str) -> dict | None:
        """Optuna's next configuration, with the journal at a URI holding the trial before Tune
        can snapshot it: a resume elsewhere replays that journal, and a trial it lacked would give
        its Optuna id to the next trial sampled there (whose trial the first one's end then told)."""
        suggestion = super().suggest(trial_id)
        if trial_id in self._ot_trials and getattr(self, "_journal", None) is not None:
            try:
                self._journal.push([JOURNAL_FILE])
            except OSError as exc:  # e.g. the network: the next store flush uploads it again
                logger.warning("%s; the journal is kept in %s and uploaded at the next write",
                               self._journal.unreachable(exc), self._journal.local)
        return suggestion

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        from optuna.trial import TrialState

        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        self._completed_trials.add(trial_id)
        if self._ot_study._storage.get_trial(ot_trial._trial_id).state.is_finished():
            # told before the driver died (Tune's snapshot predates it): the journal has it
            return
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        state, values = optuna_state_for(result, error=error, metrics=metrics)
        result = result or {}
        try:  # never let the searcher take the study down
            if result.get("rejected"):
                ot_trial.set_user_attr("rejected", str(result["rejected"]))
                ot_trial.set_user_attr("constraint_violation", float(result.get("constraint_violation") or 1.0))
            if "epoch" in result:
                ot_trial.set_user_attr("epochs_run", int(result["epoch"]))
            told = values[0] if len(metrics) == 1 and values is not None else values
            self._ot_study.tell(ot_trial, told, state=getattr(TrialState, state))
        except Exception as exc:
            logger.warning("could not tell Optuna about trial %s: %s", trial_id, exc)


class StudySearchGenerator(SearchGenerator):
    """Tune's ``SearchGenerator`` (what Tune wraps a Searcher in), whose trials sampled after a
    resume go to the study's storage as it is now.

    A restore points the trials it restores at the folder or URI resumed (``Tuner.restore``'s
    path), but not the experiment this generator keeps in its snapshot, from which it makes new
    trials (Ray 2.x): after a study folder was moved, the trials sampled after the resume would
    checkpoint into the old folder, and fail where it is gone. The storage is mended here as Tune
    mends the restored trials' (filesystem and path; see ``search.results.location.resuming_at``)."""

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        location = resumed_location()
        if location is None or self._experiment is None:
            return
        from ray.train._internal.storage import get_fs_and_path

        storage = copy.copy(self._experiment.spec["storage"])
        storage.storage_filesystem, storage.storage_fs_path = get_fs_and_path(*location.tune_storage())
        self._experiment.spec["storage"] = self._experiment.storage = storage
