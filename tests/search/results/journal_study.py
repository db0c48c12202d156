"""A study folder with a real Optuna journal, written the way a run writes it (no Ray).

The Optuna study goes into ``optuna.journal`` through ``JournalStorage(JournalFileBackend(...))``
(as :class:`search.study.searcher.HonestOptunaSearch` opens it), its knobs are suggested by the
runner's own :class:`search.study.searcher.OptunaSpace` (so a conditional space has its ``model``
choice), and experiment.json and the Parquet files come from the real store.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from search.results.location import JOURNAL_FILE
from search.results.store import ResultsStore
from search.spec.spec import ParamSpec
from search.study.searcher import OptunaSpace

OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
UNIT = {"type": "uniform", "low": 0.0, "high": 1.0}

Objective = Callable[[Mapping[str, object]], tuple[float, float]]


def make_journal_study(
    path: Path,
    *,
    objective: Objective,
    complete: int,
    models: Mapping[str, Mapping[str, dict]] | None = None,
    shared: Mapping[str, dict] | None = None,
    pruned: int = 0,
    failed: int = 0,
    name: str = "journal_fixture",
    seed: int = 0,
) -> Path:
    """``complete`` COMPLETE trials (values: ``objective(params)``), then ``pruned`` PRUNED and
    ``failed`` FAIL ones (no values, as the searcher tells Optuna), sampled at random.
    ``models``: candidate model -> its own knobs (several: a conditional space); ``shared``: the
    knobs every model has. Returns ``path``."""
    models = dict(models or {"ls_convit_nano": {}})
    shared = dict(shared or {})
    path.mkdir(parents=True, exist_ok=True)
    space = {**shared, **{k: v for knobs in models.values() for k, v in knobs.items()}}
    store = ResultsStore(path, space=space, objectives=OBJECTIVES, reference=[0.0, 0.0])
    now = dt.datetime.now(dt.timezone.utc)
    for k, model in enumerate(models):  # one stored row per model: the store's family names
        store.add_trial({"trial_id": f"t{k}", "trial_name": f"t{k}", "experiment": name, "model": model,
                         "family": model.split("_")[1] if model.startswith("ls_") else model.split("_")[0],
                         "state": "COMPLETE", "stop_reason": "max_epochs", "epochs_run": 2, "epochs_budget": 2,
                         "val_acc": 0.5, "throughput": 1000.0, "started_at": now, "ended_at": now, "duration_s": 1.0}, {})
    store.flush()
    entries = [{"name": m, "args": {}, "space": dict(knobs)} for m, knobs in models.items()]
    spec = {"name": name, "space": shared, "budget": {"trials": complete + pruned + failed, "max_epochs": 2}}
    spec.update({"model": entries[0]} if len(entries) == 1 else {"models": entries})
    meta = {"name": name, "objectives": [list(o) for o in OBJECTIVES], "reference_point": [0.0, 0.0],
            "created_at": now.isoformat(), "spec": spec}
    (path / "experiment.json").write_text(json.dumps(meta))

    suggest = OptunaSpace({k: ParamSpec(**v) for k, v in shared.items()},
                          {m: {k: ParamSpec(**v) for k, v in knobs.items()} for m, knobs in models.items()})
    storage = JournalStorage(JournalFileBackend(str(path / JOURNAL_FILE)))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "maximize"],
                                    sampler=optuna.samplers.RandomSampler(seed=seed))
    finally:
        optuna.logging.set_verbosity(verbosity)
    for k in range(complete + pruned + failed):
        trial = study.ask()
        suggest(trial)
        if k < complete:
            study.tell(trial, list(objective(trial.params)))
        else:
            study.tell(trial, state=TrialState.PRUNED if k < complete + pruned else TrialState.FAIL)
    return path
