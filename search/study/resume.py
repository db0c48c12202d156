"""Resuming a study whose driver stopped (killed, crashed, interrupted): what is left of it, and
its search taken up from Tune's snapshot (its confirmation: search.study.confirm).

Finished trials stay, the running ones continue from their last epoch checkpoint, and the rest
are sampled as before: the searcher, the scheduler and the store callback come back from Tune's
snapshot, and the callback reloads the rows already in the Parquet files (StoreCallback.setup).
"""

from __future__ import annotations

from pathlib import Path

from search.results.location import StudyLocation
from search.results.query import read_experiment_json
from search.results.replicates import REPLICATE_COLUMN
from search.results.store import ResultsStore
from search.spec import SearchSpec
from search.study.confirm import CONFIRM_FILE
from search.study.heldout import held_out_done
from search.study.tuning import SEARCH_TUNE_DIR, StudyRun, can_restore, store_for
from trainers.errors import ConfigError

__all__ = ["nothing_left", "check_restorable", "resume_search"]


def nothing_left(spec: SearchSpec, location: StudyLocation) -> str:
    """Why there is nothing left to resume of the study at ``location``, in one line: it ran its
    time limit, or every planned trial and replicate is recorded and the front's held-out test is
    done (a study finished before the test existed is taken up to score its front); "" when there
    is something left."""
    store = store_for(spec, location)
    store.load_existing()
    limit = spec.budget.time_limit_s
    if limit is not None and store.elapsed_s >= limit:
        return (f"study {spec.name} ran its time limit ({store.elapsed_s:.0f} s of budget.time_limit_s: {limit:g}); "
                f"nothing left to resume in {location}")
    finished = _finished(spec, store, location.local)
    if finished and held_out_done(location):
        return f"study {spec.name} is finished ({finished}); nothing left to resume in {location}"
    return ""


def check_restorable(location: StudyLocation) -> None:
    """Tune saved the search's state at ``location``, to resume from."""
    if not can_restore(location, SEARCH_TUNE_DIR):
        raise ConfigError(f"{location}: Ray Tune saved no state there (the study stopped before its first trial, or "
                          "its ray/ folder is gone), so it cannot be resumed; run the spec again with --name NEW_NAME "
                          "(what this study has stays readable)")


def _finished(spec: SearchSpec, store: ResultsStore, folder: Path) -> str:
    """What a finished study ran ('24 of 24 trials', with its replicates), or '' while any planned
    trial or replicate has not finished."""
    search = [t for t in store.trials if t.get(REPLICATE_COLUMN) is None]
    if len(search) < spec.planned_trials:
        return ""
    done = f"{len(search)} of {spec.planned_trials} trials"
    if spec.budget.confirm is None:
        return done
    plan_file = folder / CONFIRM_FILE
    if not plan_file.is_file():
        return ""
    plan = read_experiment_json(plan_file)
    replicates = len(store.trials) - len(search)
    if plan.get("strategy") == "race":  # it ends when the configs are separated: its end is the held-out test's start
        return f"{done}, {replicates} replicates raced"
    planned = len(plan.get("configs") or [])
    return f"{done}, {replicates} of {planned} replicates" if replicates >= planned else ""


def resume_search(run: StudyRun, elsewhere: list[str]) -> None:
    """The search taken up from Tune's snapshot and run to the end. Inside
    ``search.results.location.resuming_at(run.location)``, whose list of the study's earlier
    locations is ``elsewhere``: the snapshot's study location is this one, wherever it was taken
    (a folder moved since, another machine)."""
    run.say(f"resuming study {run.spec.name} in {run.location}")
    tuner = run.restored_tuner(SEARCH_TUNE_DIR)
    if elsewhere:
        run.say(f"the study was in {', '.join(elsewhere)} when it stopped; it carries on in {run.location}")
    run.fit(tuner)
