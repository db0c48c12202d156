"""Confirmation seeds: after the search, the front's configs trained again with further seeds.

``budget.confirm: {seeds: S, top: K}``. When the search's trials are done, the configs to confirm
are picked once and written to ``confirm.json`` in the study's folder (a resumed study reads them
back, so a kill cannot change the choice):

1. the front's members (COMPLETE trials, best first on the first objective), then
2. the COMPLETE trials off the front that are tied with a front member (their intervals overlap
   on every objective: nothing measured says the front beats them), best first,

at most K configs in all. Each is trained S more times at the full budget, with the seeds
``algorithm.seed + 1 .. algorithm.seed + S`` (the search's own trials train with
``algorithm.seed``), as ordinary Ray trials of a second Tune experiment (``ray-confirm/``): the
time limit, resume, patience and the store's rules apply as to any trial. Their rows name the
search trial in ``replicate_of``; the front is then taken over configs, each the mean over its
seeds with its interval (``search.results.replicates``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from search.results.intervals import bounds, tied_pairs
from search.results.pareto import DEVICE_COLUMN
from search.results.query import read_experiment_json
from search.results.replicates import REPLICATE_COLUMN
from search.results.store import write_json_atomic
from search.spec import SearchSpec
from search.study.compat import moved_names
from search.study.export import sampled_config
from search.study.race import POOL_COLUMNS
from search.study.schedulers import scheduler_for
from search.study.tuning import StudyRun, can_restore
from search.text import count

__all__ = ["CONFIRM_FILE", "CONFIRM_TUNE_DIR", "confirm", "configs_to_confirm", "replicate_configs",
           "confirmation_plan"]

CONFIRM_FILE = "confirm.json"  # the configs picked and the replicates' Tune configs, written once
CONFIRM_TUNE_DIR = "ray-confirm"  # Tune's experiment of the replicates, beside the search's ("ray")


def configs_to_confirm(front: Sequence[Mapping[str, Any]], complete: Sequence[Mapping[str, Any]],
                       objectives: Sequence[tuple[str, str]], *, top: int) -> list[Mapping[str, Any]]:
    """The rows to confirm: ``front`` (best first), then the rows of ``complete`` off the front
    that are tied with a member of it on the same device, best first on the first objective;
    at most ``top``."""
    on_front = {r["trial_id"] for r in front}
    rest = [r for r in complete if r["trial_id"] not in on_front]
    picked = list(front)
    if rest and front:
        rows = list(front) + rest
        pairs = [bounds(rows, column) for column, _ in objectives]
        tied = tied_pairs(np.stack([lo for lo, _ in pairs], axis=1), np.stack([hi for _, hi in pairs], axis=1))
        device = [r.get(DEVICE_COLUMN) for r in rows]
        n = len(front)
        near = [r for i, r in enumerate(rest, start=n)
                if any(tied[i, j] and device[i] == device[j] for j in range(n))]
        first, mode = objectives[0]
        near.sort(key=lambda r: r[first], reverse=mode == "max")
        picked += near
    return picked[:top]


def replicate_configs(spec: SearchSpec, rows: Sequence[Mapping[str, Any]], *, seeds: int) -> list[dict[str, Any]]:
    """The Tune configs of the replicates: each row's sampled config, once per further seed."""
    from search.study.trainable import REPLICATE_KEY, SEED_KEY  # torch: only when a study runs

    out = []
    for row in rows:
        config = sampled_config(spec, row, where=f"trial {row['trial_id']}")
        for k in range(1, seeds + 1):
            out.append({**config, SEED_KEY: spec.algorithm.seed + k, REPLICATE_KEY: row["trial_id"]})
    return out


def confirmation_plan(spec: SearchSpec, store, folder: Path) -> dict[str, Any]:
    """The plan in ``folder``'s confirm.json, or a new one from the search's trials in ``store``
    (written there before any replicate starts)."""
    path = folder / CONFIRM_FILE
    if path.is_file():
        return read_experiment_json(path)
    assert spec.budget.confirm is not None
    search = [t for t in store.trials if t.get(REPLICATE_COLUMN) is None]
    complete = [t for t in search if t["state"] == "COMPLETE"]
    front_ids = {t["trial_id"] for t in store.pareto_table().to_pylist()}
    front = [t for t in complete if t["trial_id"] in front_ids]
    first, mode = store.objectives[0]
    front.sort(key=lambda r: r[first], reverse=mode == "max")
    confirm = spec.budget.confirm
    rows = configs_to_confirm(front, complete, store.objectives, top=confirm.top)
    plan = {
        "strategy": confirm.strategy,
        "seeds": confirm.seeds,
        "top": confirm.top,
        "trials": [{"trial_id": r["trial_id"], "on_front": r["trial_id"] in front_ids} for r in rows],
    }
    if confirm.strategy == "race":  # what search.study.race decides from, whatever happens to the store
        columns = dict.fromkeys([*POOL_COLUMNS, *(f"{c}{end}" for c, _ in store.objectives for end in ("", "_low", "_high"))])
        plan["replicates"] = confirm.budget
        plan["pool"] = [{c: r.get(c) for c in columns} for r in rows]
        plan["pool_configs"] = {r["trial_id"]: sampled_config(spec, r, where=f"trial {r['trial_id']}") for r in rows}
        plan["configs"] = []
    else:
        plan["configs"] = replicate_configs(spec, rows, seeds=confirm.seeds)
    write_json_atomic(plan, path)
    return plan


def confirm(run: StudyRun) -> None:
    """The confirmation stage (``budget.confirm``): started once the search's trials are done, or
    taken up where a killed driver left it."""
    if run.spec.budget.confirm is None:
        return
    if can_restore(run.location, CONFIRM_TUNE_DIR):
        run.say(f"resuming the confirmation of study {run.spec.name}")
        tuner = run.restored_tuner(CONFIRM_TUNE_DIR)
    else:
        tuner = _new_confirmation(run)
        if tuner is None:
            return
    run.fit(tuner)


def _new_confirmation(run: StudyRun):
    """Tune's run of the replicates the plan picks, or None (said why) where there are none to run."""
    from search.study.searcher import RaceSearcher, ReplicateSearcher, StudySearchGenerator

    spec, location = run.spec, run.location
    store = run.store()
    store.load_existing()
    limit = spec.budget.time_limit_s
    left = None if limit is None else limit - store.elapsed_s
    if left is not None and left <= 0:
        run.say(f"confirmation: none (the search used the time limit, budget.time_limit_s: {limit:g})")
        return None
    plan = confirmation_plan(spec, store, location.local)
    location.push([CONFIRM_FILE])
    if not plan["trials"]:
        run.say("confirmation: none (no trial completed)")
        return None
    # Replicate rows a driver killed before Tune's first snapshot recorded: trained again.
    if store.forget_trials(set(), replicates=True):
        store.flush()
    picked = f"{count(len(plan['trials']), 'config')} (the front, then those tied with it; budget.confirm.top: {plan['top']})"
    if plan.get("strategy") == "race":
        trials = int(plan["replicates"])
        searcher = RaceSearcher(plan, store.objectives, base_seed=spec.algorithm.seed)
        run.say(f"confirmation: a race over {picked}: up to {count(trials, 'replicate')} at the full budget, at most "
                f"{count(plan['seeds'], 'further seed')} each, each to a config still tied or dominated within noise")
    else:
        trials = len(plan["configs"])
        searcher = ReplicateSearcher(plan["configs"])
        run.say(f"confirmation: {picked} x {count(plan['seeds'], 'further seed')} = {count(trials, 'trial')} at the full budget")
    callback = run.store_callback(store, replicates=True, total_trials=trials)
    return run.new_tuner(callback, name=CONFIRM_TUNE_DIR, search_alg=StudySearchGenerator(searcher),
                         scheduler=scheduler_for(spec, confirmation=True), num_samples=trials, time_budget_s=left)


# Tune's snapshot of a confirmation begun before the searchers moved to search.study.searcher names
# ReplicateSearcher here.
__getattr__ = moved_names(__name__, {"ReplicateSearcher": "search.study.searcher"})
