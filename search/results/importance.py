"""Which knobs mattered: Optuna's own importance evaluators, run on the study's Optuna journal.

The study's ``optuna.journal`` (written by :class:`search.study.searcher.HonestOptunaSearch`) is
read as Optuna wrote it; the importance of each knob for each objective comes from
``optuna.importance.get_param_importances`` with

- ``fanova`` (default): :class:`optuna.importance.FanovaImportanceEvaluator`, seeded so the same
  journal gives the same numbers (its random forest is random). Hutter, Hoos & Leyton-Brown 2014,
  "An Efficient Approach for Assessing Hyperparameter Importance" (ICML): the share of the
  objective's variance that each knob explains on its own.
- ``ped-anova``: :class:`optuna.importance.PedAnovaImportanceEvaluator`. Watanabe et al. 2023,
  "PED-ANOVA: Efficiently Quantifying Hyperparameter Importance in Arbitrary Subspaces" (IJCAI):
  how differently a knob is distributed in the best 10 % of the trials than in all of them.

Only COMPLETE trials count. By the searcher's rule a PRUNED trial (stopped by the scheduler or the
time limit, or rejected by a constraint) and a FAIL one carry no objective values in the journal,
and a RUNNING one none yet; the evaluators themselves also read only COMPLETE trials, and here
each evaluator is handed a study that holds nothing else.

One objective at a time (``target=lambda t: t.values[i]``, ``i`` in experiment.json's order of
objectives, which is the order the searcher gave Optuna). In a conditional space (``models:``,
each candidate with its own knobs) the importance is computed per candidate model: the
evaluators need the same knobs in every trial they read, and a knob of one family means nothing
for another. The shared knobs (e.g. ``lr``) are ranked within each family.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from search.results.location import JOURNAL_FILE
from search.results.query import load
from search.text import count
from trainers.errors import ConfigError

__all__ = ["EVALUATORS", "MIN_COMPLETE_TRIALS", "MIN_TRIALS_PER_KNOB", "minimum_trials", "VIEW_MAX_TRIALS", "IMPORTANCE_COLUMNS", "FamilyImportance", "knob_importance", "by_family", "importance_warnings"]

EVALUATORS = ("fanova", "ped-anova")

# A family's ranking needs max(20, 4 per knob) COMPLETE trials; below that it is mostly noise,
# hence the warning:
# - PED-ANOVA compares the best 10 % of the trials with all of them, and Optuna's evaluator needs 2
#   trials in a set to estimate a distribution (its min_n_trials_in_regime): 10 % of 20 is 2;
# - fANOVA's forest grows each tree until its leaves hold one trial, so with only a few trials per
#   knob every split fits noise; 4 per knob is the least that lets each knob's main effect be seen
#   in both halves of its range twice (the spaces here have 2 to 8 knobs per family).
MIN_COMPLETE_TRIALS = 20
MIN_TRIALS_PER_KNOB = 4


def minimum_trials(knobs: int) -> int:
    """The COMPLETE trials a ranking of ``knobs`` knobs should rest on (see the comment above)."""
    return max(MIN_COMPLETE_TRIALS, MIN_TRIALS_PER_KNOB * knobs)


# The report and the Pareto page fit fANOVA on at most this many COMPLETE trials: Optuna's forest
# (64 trees grown to single-trial leaves) costs more than linearly in the trials: 16 trees took
# 3.7 s at 500 trials here (2-core Zen 3, shared), so some 15 s per objective and family; and the
# page recomputes it after every trial of a running study, on the cores the trials need. Beyond it they point to `python -m search importance`, which has no cap.
VIEW_MAX_TRIALS = 500

# One row per family, objective and knob; the table JSON and CSV print as it is.
IMPORTANCE_COLUMNS = ("family", "model", "objective", "mode", "rank", "knob", "importance", "complete_trials",
                      "evaluator")


def _space_entries(spec: dict) -> list[dict]:
    return [spec["model"]] if spec.get("model") else list(spec.get("models") or [])


def _family_names(trials: pd.DataFrame) -> dict[str, str]:
    """Candidate model -> its family as the store recorded it (e.g. ls_convit_micro -> convit)."""
    if not {"model", "family"} <= set(trials.columns):
        return {}
    known = trials.dropna(subset=["model", "family"])
    return {str(m): str(f) for m, f in zip(known["model"], known["family"])}


def _open_study(folder: Path, name: str):
    """The Optuna study of the journal in ``folder`` (read only: Optuna's file backend appends
    only when told something, and the file is there, so nothing is created)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = folder / JOURNAL_FILE
    if not journal.is_file():
        raise ConfigError(f"{folder}: no {JOURNAL_FILE}; the study's Optuna journal is where the importance is computed "
                          "from (studies run before the searcher kept one have none)")
    try:
        storage = JournalStorage(JournalFileBackend(str(journal)))
        names = optuna.get_all_study_names(storage=storage)
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{journal}: not a readable Optuna journal ({exc}); the study's files are damaged") from None
    if name not in names:
        if len(names) != 1:
            raise ConfigError(f"{journal}: holds no Optuna study named {name!r} (it holds {names or 'none'}); "
                              "its experiment.json and journal are not one study's")
        name = names[0]  # one study: the folder's, whatever its spec was renamed to
    return optuna.load_study(study_name=name, storage=storage)


def _check_directions(study, objectives: Sequence[tuple[str, str]], journal: Path) -> None:
    from optuna.study import StudyDirection

    expected = [StudyDirection.MAXIMIZE if mode == "max" else StudyDirection.MINIMIZE for _, mode in objectives]
    if list(study.directions) != expected:
        raise ConfigError(f"{journal}: the Optuna study optimises {[d.name.lower() for d in study.directions]}, but "
                          f"experiment.json's objectives are {[list(o) for o in objectives]}; the files are not one study's")


def _importances(trials: list, knobs: list[str], *, index: int, mode: str, directions: list, evaluator: str,
                 seed: int) -> dict[str, float]:
    """Optuna's importance of ``knobs`` for objective ``index`` over ``trials`` (all COMPLETE), as
    shares of their sum; all 0 where the evaluator attributes nothing (e.g. a constant objective),
    rather than Optuna's equal shares, which would read as 'all equally important'."""
    import optuna
    from optuna.exceptions import ExperimentalWarning
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator, get_param_importances

    if evaluator == "fanova":
        chosen = FanovaImportanceEvaluator(seed=seed)
        sign = 1.0  # a variance decomposition: the direction does not matter
    else:
        chosen = PedAnovaImportanceEvaluator()
        sign = -1.0 if mode == "max" else 1.0  # PED-ANOVA takes lower as better
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" line
    try:
        # A study holding only this family's COMPLETE trials: the evaluators read every trial of
        # the study they are given, and need the same knobs in each.
        sub = optuna.create_study(directions=directions)
    finally:
        optuna.logging.set_verbosity(verbosity)
    sub.add_trials(trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # normalize=False is experimental; the shares are taken below
        # its reminder that lower is better: the sign above has seen to it
        warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes the importances", category=UserWarning)
        raw = get_param_importances(sub, evaluator=chosen, params=knobs, normalize=False,
                                    target=lambda t: sign * t.values[index])
    total = sum(raw.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in raw.items()}


def knob_importance(study: str | Path, *, evaluator: str = "fanova", seed: int = 0,
                    max_trials: int | None = None) -> pd.DataFrame:
    """The importance of each searched knob for each objective of ``study`` (a study folder or
    URI), from Optuna's ``evaluator`` (``fanova``, seeded with ``seed``, or ``ped-anova``) on the
    COMPLETE trials of its journal; per family in a conditional space.

    One row per family, objective and knob (columns: :data:`IMPORTANCE_COLUMNS`): ``importance``
    is the knob's share of that objective's total (the family's shares sum to 1, or are all 0 when
    nothing varies), ``rank`` 1 is the most important, and ``complete_trials`` the number of COMPLETE
    trials it rests on. A family with fewer than 2 COMPLETE trials has no importance (null): no
    evaluator can compare one trial with nothing. Below :func:`minimum_trials` see
    :func:`importance_warnings`. ConfigError where ``study`` is not a study or has no journal, or
    has more than ``max_trials`` COMPLETE trials (a view's bound on the time it spends)."""
    if evaluator not in EVALUATORS:
        raise ConfigError(f"evaluator {evaluator!r}: expected one of {', '.join(EVALUATORS)}")
    from optuna.trial import TrialState

    exp = load(study)
    spec = exp.spec.get("spec") or {}
    if (spec.get("algorithm") or {}).get("name") == "grid":
        raise ConfigError(f"{exp.path}: a grid study has no Optuna journal (its points are listed, not sampled); "
                          f"`python -m search effects {exp.path}` gives each knob's effect")
    optuna_study = _open_study(exp.path, str(exp.spec.get("name") or exp.path.name))
    _check_directions(optuna_study, exp.objectives, exp.path / JOURNAL_FILE)
    complete = optuna_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if max_trials is not None and len(complete) > max_trials:
        raise ConfigError(f"{count(len(complete), 'COMPLETE trial')}, more than the {max_trials} importance is computed "
                          f"on here (fANOVA would take minutes); `python -m search importance {exp.path}` computes it")
    entries = _space_entries(spec)
    shared = list((spec.get("space") or {}).keys())
    conditional = len(entries) > 1
    families = _family_names(exp.trials)
    rows = []
    for entry in entries or [{"name": None}]:
        model = entry.get("name")
        knobs = list(dict.fromkeys([*(entry.get("space") or {}), *shared]))
        trials = [t for t in complete if not conditional or t.params.get("model") == model]
        # A knob must be in every trial handed to the evaluator; a journal from a spec whose knobs
        # changed (not something `run` does) would otherwise make Optuna refuse the whole family.
        knobs = [k for k in knobs if all(k in t.params for t in trials)]
        family = families.get(str(model), str(model)) if model is not None else None
        for index, (objective, mode) in enumerate(exp.objectives):
            values = {}
            if len(trials) >= 2 and knobs:
                values = _importances(trials, knobs, index=index, mode=mode, directions=optuna_study.directions,
                                      evaluator=evaluator, seed=seed)
            ranked = sorted(knobs, key=lambda k: -values.get(k, 0.0)) if values else knobs
            for rank, knob in enumerate(ranked, start=1):
                rows.append({"family": family, "model": model, "objective": objective, "mode": mode,
                             "rank": rank if values else None, "knob": knob,
                             "importance": values.get(knob, math.nan), "complete_trials": len(trials),
                             "evaluator": evaluator})
    table = pd.DataFrame(rows, columns=list(IMPORTANCE_COLUMNS))
    table["rank"] = table["rank"].astype("Int64")
    return table


@dataclass(frozen=True, eq=False)  # eq=False: a DataFrame has no truth value to compare by
class FamilyImportance:
    """One family's part of a :func:`knob_importance` table, as the views show it."""

    family: str | None  # None: a space with one model
    model: str | None
    complete_trials: int  # what the numbers rest on
    minimum: int  # minimum_trials of its knobs
    warning: str | None  # below the minimum: why not to trust the ranking
    shares: pd.DataFrame | None  # knob rows x objective columns, most important for the first objective first;
    # None: fewer than 2 COMPLETE trials, nothing to compare

    @property
    def heading(self) -> str:
        """'family convit (ls_convit_micro), 16 COMPLETE trials' (no family: a space with one model)."""
        family = "" if self.model is None else f"family {self.family} ({self.model}), "
        return f"{family}{count(self.complete_trials, 'COMPLETE trial')}"


def _warning(family: object, model: object, n: int, knobs: int) -> str | None:
    minimum = minimum_trials(knobs)
    if n >= minimum:
        return None
    who = "" if pd.isna(model) else f"family {family} ({model}): "
    why = f"{MIN_TRIALS_PER_KNOB} per knob" if minimum > MIN_COMPLETE_TRIALS else "at least"
    return (f"warning: {who}importance rests on {count(n, 'COMPLETE trial')}, fewer than {minimum} ({why}); "
            "its ranking is mostly noise")


def by_family(table: pd.DataFrame) -> list[FamilyImportance]:
    """``table`` (:func:`knob_importance`) split by family, in the spec's order."""
    groups = []
    for (family, model), group in table.groupby(["family", "model"], dropna=False, sort=False):
        n = int(group["complete_trials"].iloc[0])
        knobs = group["knob"].nunique()
        shares = None
        if not group["importance"].isna().all():
            objectives = list(dict.fromkeys(group["objective"]))
            shares = group.pivot(index="knob", columns="objective", values="importance")[objectives]
            shares = shares.sort_values(objectives[0], ascending=False, kind="stable")
            shares.columns.name = None
        groups.append(FamilyImportance(family=None if pd.isna(family) else str(family),
                                       model=None if pd.isna(model) else str(model), complete_trials=n,
                                       minimum=minimum_trials(knobs), warning=_warning(family, model, n, knobs),
                                       shares=shares))
    return groups


def importance_warnings(table: pd.DataFrame) -> list[str]:
    """One line per family whose importance rests on fewer COMPLETE trials than :func:`minimum_trials` of its knobs."""
    return [g.warning for g in by_family(table) if g.warning]
