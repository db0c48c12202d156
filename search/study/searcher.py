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

Also here: the Optuna side of a study (its define-by-run space, :class:`OptunaSpace`, and its
sampler, :func:`make_sampler`), the searcher of fixed configs (a grid's points, the confirmation's
replicates: :class:`ReplicateSearcher`), and :func:`study_searcher`, the searcher a study's search runs.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray.tune.search import SearchGenerator, Searcher
from ray.tune.search.optuna import OptunaSearch

from search.results.location import JOURNAL_FILE, StudyLocation, resumed_location
from search.results.pareto import DEVICE_METRICS
from search.results.replicates import REPLICATE_COLUMN
from search.results.store import TRIAL_VALUE_OF
from search.study.race import race_step
from search.spec import ParamSpec, SearchSpec

__all__ = ["HonestOptunaSearch", "StudySearchGenerator", "ReplicateSearcher", "RaceSearcher", "OptunaSpace", "make_sampler",
           "study_searcher", "grid_searcher", "constraint_violation", "optuna_state_for", "trial_state",
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
        with warnings.catch_warnings():
            # Ray times the define-by-run space, and a model-based sampler (gp, botorch) fits inside
            # it, at the first suggest: its advice to move training out of the space does not apply
            warnings.filterwarnings("ignore", message="Define-by-run function passed in the `space` argument took")
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


def study_searcher(spec: SearchSpec, location: StudyLocation) -> StudySearchGenerator:
    """The searcher of the study's search, as Tune takes it: a grid's points (`grid_searcher`), or
    Optuna's sampler on the spec's space. The Optuna study lives in a journal next to the results:
    it survives a killed driver, and optuna-dashboard opens it (optuna-dashboard <dir>/optuna.journal)."""
    if spec.is_grid:
        return StudySearchGenerator(grid_searcher(spec))
    return StudySearchGenerator(HonestOptunaSearch(
        space=optuna_space(spec),
        metric=[TRIAL_VALUE_OF[o.metric] for o in spec.objectives],
        mode=[o.mode for o in spec.objectives],
        sampler=make_sampler(spec),
        study_name=spec.name,
        journal=location,
    ))


def grid_searcher(spec: SearchSpec):
    """Tune's searcher of a grid study: every point of the grid once per seed, seed by seed (all
    points at the first seed, then at the second: a study the time limit cuts short has whole
    replicates of the grid). No Optuna study: nothing is sampled. The searcher's position is saved
    with Tune's snapshot (see ReplicateSearcher), so a resumed grid repeats and skips no point."""
    from search.study.trainable import SEED_KEY

    points = spec.grid_points()
    return ReplicateSearcher([{**point, SEED_KEY: seed} for seed in spec.algorithm.grid_seeds for point in points])


def optuna_space(spec: SearchSpec) -> "OptunaSpace":
    """The spec's space as its sampler draws it (``SearchSpec.sampled_param``: botorch's levels)."""
    sampled = spec.sampled_param
    return OptunaSpace({k: sampled(p) for k, p in spec.space.items()},
                       {m.name: {k: sampled(p) for k, p in m.space.items()} for m in spec.candidates})


class OptunaSpace:
    """Define-by-run space for Optuna: one ``suggest_*`` per knob, bounds inclusive.

    With several candidate models, ``model`` is suggested first and only the chosen model's own
    knobs are suggested after it (the others stay unset: null in the store). A class rather than
    a closure: Tune pickles the searcher with the experiment state."""

    def __init__(self, shared: dict[str, ParamSpec], per_model: dict[str, dict[str, ParamSpec]]) -> None:
        self.shared = dict(shared)
        self.per_model = {name: dict(space) for name, space in per_model.items()}

    def __call__(self, trial) -> dict[str, Any] | None:
        """Suggests every knob on ``trial``; returns the values of ``ordered`` choices (Optuna holds
        their positions, the config their values: Ray's define-by-run merges this dict over the
        suggestions)."""
        names = list(self.per_model)
        model = trial.suggest_categorical("model", names) if len(names) > 1 else names[0]
        ordered: dict[str, Any] = {}
        for key, p in {**self.per_model[model], **self.shared}.items():
            if p.type == "choice" and p.ordered:
                ordered[key] = p.values[trial.suggest_int(key, 0, len(p.values) - 1)]
            elif p.type == "choice":
                trial.suggest_categorical(key, list(p.values))
            elif p.type == "int":
                trial.suggest_int(key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
            else:
                trial.suggest_float(key, p.low, p.high, log=p.type == "loguniform", step=p.step)
        return ordered or None

    def distributions(self) -> dict[str, Any]:
        """The Optuna distribution of every knob of a space of one model, as ``__call__`` suggests it."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        assert len(self.per_model) == 1, "distributions of a conditional space"
        out: dict[str, Any] = {}
        for key, p in {**next(iter(self.per_model.values())), **self.shared}.items():
            if p.type == "choice" and p.ordered:
                out[key] = IntDistribution(0, len(p.values) - 1)
            elif p.type == "choice":
                out[key] = CategoricalDistribution(list(p.values))
            elif p.type == "int":
                out[key] = IntDistribution(int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
            else:
                out[key] = FloatDistribution(p.low, p.high, log=p.type == "loguniform", step=p.step)
        return out


def make_sampler(spec: SearchSpec):
    """The spec's Optuna sampler (``algorithm``): TPE, Optuna's GP (LogEHVI for several
    objectives), BoTorch's qLogNEHVI over a finite space (search.study.finite_bo), NSGA-II or
    random, seeded."""
    import optuna

    algorithm = spec.algorithm
    if algorithm.name == "botorch":
        from search.study.finite_bo import STARTUP_TRIALS, FiniteQNEHVISampler

        space = optuna_space(spec).distributions()
        return FiniteQNEHVISampler(space, seed=algorithm.seed, n_startup_trials=STARTUP_TRIALS
                                   if algorithm.n_startup_trials is None else algorithm.n_startup_trials)
    # With constraints, rejected trials count as infeasible, so the model learns to avoid them.
    constraints = {"constraints_func": constraint_violation} if spec.constraints else {}
    if algorithm.name == "tpe":
        kwargs: dict[str, Any] = {"seed": algorithm.seed, "multivariate": True, **constraints}
        if algorithm.n_startup_trials is not None:
            kwargs["n_startup_trials"] = algorithm.n_startup_trials
        return optuna.samplers.TPESampler(**kwargs)
    if algorithm.name == "gp":
        startup = {} if algorithm.n_startup_trials is None else {"n_startup_trials": algorithm.n_startup_trials}
        return optuna.samplers.GPSampler(seed=algorithm.seed, **startup, **constraints)
    if algorithm.name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=algorithm.seed, **constraints)
    return optuna.samplers.RandomSampler(seed=algorithm.seed)


class ReplicateSearcher(Searcher):
    """Tune's searcher of the confirmation stage: the plan's configs, each once, in order (also a
    grid study's searcher: its points x seeds, see `grid_searcher`).

    (Tune's ``BasicVariantGenerator(points_to_evaluate=...)`` wants every key in a param space;
    these configs are whole.) Its state, the next config, is saved with Tune's snapshot, so a
    resumed stage starts none twice."""

    def __init__(self, configs: Sequence[Mapping[str, Any]]) -> None:
        super().__init__()
        self.configs = [dict(c) for c in configs]
        self.next = 0

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self.next >= len(self.configs):
            return Searcher.FINISHED
        self.next += 1
        return dict(self.configs[self.next - 1])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass  # nothing to learn: the configs are fixed

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as handle:
            pickle.dump({"configs": self.configs, "next": self.next}, handle)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as handle:
            state = pickle.load(handle)  # Tune's own snapshot (Tune unpickles the rest of it too)
        self.configs, self.next = state["configs"], state["next"]


class RaceSearcher(Searcher):
    """Tune's searcher of a raced confirmation: ``race_step`` on the plan's pool and the replicates
    finished so far. Its state (the replicates handed out, running and finished) is saved with
    Tune's snapshot, so a resumed race goes on from where it was."""

    def __init__(self, plan: Mapping[str, Any], objectives: Sequence[tuple[str, str]], *, base_seed: int) -> None:
        super().__init__()
        self.pool = [dict(r) for r in plan["pool"]]
        self.configs = {k: dict(v) for k, v in plan["pool_configs"].items()}  # search trial id -> its Tune config
        self.objectives = [tuple(o) for o in objectives]
        self.max_seeds = int(plan["seeds"])
        self.budget = int(plan["replicates"])
        self.base_seed = base_seed
        self.issued = 0
        self.seeds_given: Counter = Counter()  # config -> seeds handed out (their seed numbers: base + 1 ..)
        self.running: dict[str, str] = {}  # replicate trial id -> config
        self.finished: list[dict[str, Any]] = []  # the replicates' rows, as the front folds them

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        from search.study.trainable import REPLICATE_KEY, SEED_KEY

        if self.issued >= self.budget:
            return Searcher.FINISHED
        config = race_step(self.pool, self.finished, self.objectives, max_seeds=self.max_seeds,
                           running=Counter(self.running.values()))
        if config is None:
            # running replicates may still unsettle the front: ask again when one finishes
            return None if self.running else Searcher.FINISHED
        self.issued += 1
        self.seeds_given[config] += 1
        self.running[trial_id] = config
        return {**self.configs[config], SEED_KEY: self.base_seed + self.seeds_given[config], REPLICATE_KEY: config}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        config = self.running.pop(trial_id, None)
        if config is None or error or not result or result.get("stop_reason") not in ("max_epochs", "patience"):
            return  # failed or cut short: no seed of the config's estimate (the store's rule)
        row = {"trial_id": trial_id, REPLICATE_COLUMN: config, "val_images": result.get("val_images")}
        for column, _ in self.objectives:  # the architecture's measurements stay the search trial's
            if column not in DEVICE_METRICS:
                row[column] = result.get(TRIAL_VALUE_OF.get(column, column))
        self.finished.append(row)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as handle:
            pickle.dump({k: getattr(self, k) for k in ("issued", "seeds_given", "running", "finished")}, handle)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as handle:
            state = pickle.load(handle)  # Tune's own snapshot (Tune unpickles the rest of it too)
        self.__dict__.update(state)
