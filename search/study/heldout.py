"""The held-out stage: at a study's end, the front's trials scored once on the test split.

The search selects on validation (``val_acc``, each trial's best epoch there), so the front's
``val_acc`` is biased upwards as an estimate of accuracy on new images. Once the search and its
confirmation are done, each front member's trials are scored on the dataset's test split, which
nothing else reads (``trainers.heldout``):

- a member without replicates: its search trial;
- a confirmed member: its fresh seeds (the replicates its ``val_acc`` rests on);
- in a grid study (an ablation, whose claims compare every point's seeds): every COMPLETE trial.

Each trial's last Tune checkpoint holds the weights of its best validation epoch (the epoch
selection used); they are scored as a Ray task with a trial's resources, on whichever node Ray
picks, reading the checkpoint from the study's storage. On the driver's own local cluster (no
``--address``) the stage runs after every trial has ended, on the one machine there is, so the
driver scores them itself: a Ray worker would first import torch, timm and the trainers again
(seconds per study) to do the same. Its ``test_acc`` (with its Wilson
interval), ``test_loss``, ``test_images`` and ``test_epoch`` go to the trial's row; the front folds
a confirmed member's seeds as it folds ``val_acc`` (``search.results.replicates``). A trial already
scored is never scored again (a resumed study takes up where the stage stopped). ``heldout.json``
records that the stage finished, the trials scored, and those it could not score (a checkpoint
written before the selected weights were kept, whose last epoch was not the best).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from search.results.replicates import REPLICATE_COLUMN
from search.results.store import ResultsStore, write_json_atomic
from search.study.confirm import CONFIRM_TUNE_DIR
from search.study.export import sampled_config
from search.study.tuning import SEARCH_TUNE_DIR, StudyRun
from search.text import count

__all__ = ["HELDOUT_FILE", "trials_to_test", "test_front", "held_out_done"]

HELDOUT_FILE = "heldout.json"  # written when the stage has finished: what it scored and what it could not


def trials_to_test(store: ResultsStore, *, every: bool = False) -> list[dict[str, Any]]:
    """The rows of the trials the front's estimates rest on: each member's COMPLETE replicates
    where it has any, else its search trial; in the front's order. With ``every`` (a grid: an
    ablation reports every point and seed), every COMPLETE trial."""
    if every:
        return [t for t in store.trials if t["state"] == "COMPLETE"]
    replicas: dict[str, list[dict[str, Any]]] = {}
    for t in store.trials:
        if t.get(REPLICATE_COLUMN) is not None and t["state"] == "COMPLETE":
            replicas.setdefault(t[REPLICATE_COLUMN], []).append(t)
    by_id = {t["trial_id"]: t for t in store.trials}
    out = []
    for member in store.pareto_table().to_pylist():
        out += replicas.get(member["trial_id"]) or [by_id[member["trial_id"]]]
    return out


def held_out_done(location) -> bool:
    """Whether the held-out stage finished for the study at ``location``."""
    return location.exists(HELDOUT_FILE)


def test_front(run: StudyRun) -> None:
    """Score the front's untested trials on the test split, each once; then write ``heldout.json``."""
    started = time.monotonic()
    store = run.store()
    store.load_existing()
    rows = trials_to_test(store, every=run.spec.is_grid)
    todo = [r for r in rows if r.get("test_acc") is None]
    if todo:
        which = "of the grid" if run.spec.is_grid else "of the front"
        run.say(f"held-out test: {count(len(todo), 'trial')} {which}, each scored once on the "
                f"{run.data.counts['test']:,} test images at its best validation epoch")
    asked = []
    missing: dict[str, str] = {}
    for row in todo:
        checkpoint = _last_checkpoint(run, row)
        if checkpoint is None:
            missing[row["trial_id"]] = "no checkpoint in Tune's folder"
            continue
        asked.append((row["trial_id"], sampled_config(run.spec, row, where=f"trial {row['trial_id']}"), checkpoint))
    scored = _scored_here if run.local_cluster else _scored_on_the_cluster
    for trial_id, score in scored(run, asked):
        if score is None:
            missing[trial_id] = "its checkpoint holds no weights of its best validation epoch (written by an older version)"
            continue
        store.add_test(trial_id, score)
        store.flush()  # one trial at a time: a kill loses at most the scores under way
    for trial_id, why in missing.items():
        run.say(f"held-out test: trial {trial_id} not scored: {why}")
    if todo:
        run.say(f"held-out test: {count(len(todo) - len(missing), 'trial')} scored in {time.monotonic() - started:.0f} s")
    tested = [r["trial_id"] for r in rows if r["trial_id"] not in missing]
    write_json_atomic({"tested": tested, "not_tested": missing}, run.location.local / HELDOUT_FILE)
    run.location.push([HELDOUT_FILE])


def _scored_here(run: StudyRun, asked: list[tuple[str, dict[str, Any], Any]]) -> Iterator[tuple[str, Any]]:
    """(trial id, score) for each (trial id, config, checkpoint) asked, scored one after another in this process."""
    template, corruptions = run.trial_template(), bool(run.spec.dataset.corruptions)
    for trial_id, config, checkpoint in asked:
        yield trial_id, _score(template, config, checkpoint, corruptions)


def _scored_on_the_cluster(run: StudyRun, asked: list[tuple[str, dict[str, Any], Any]]) -> Iterator[tuple[str, Any]]:
    """The same, each a Ray task with a trial's resources, side by side, in the order they finish."""
    import ray

    template, corruptions = run.trial_template(), bool(run.spec.dataset.corruptions)
    resources = run.spec.resources.ray_resources()
    task = ray.remote(_score).options(num_cpus=resources.pop("cpu"), num_gpus=resources.pop("gpu"),
                                      resources=resources or None)
    pending = {task.remote(template, config, checkpoint, corruptions): trial_id for trial_id, config, checkpoint in asked}
    while pending:
        [ready], _ = ray.wait(list(pending))
        yield pending.pop(ready), ray.get(ready)


def _last_checkpoint(run: StudyRun, row: Mapping[str, Any]):
    """The trial's newest Tune checkpoint (a ``ray.tune.Checkpoint`` on the study's storage), or None."""
    import pyarrow.fs
    from ray import tune

    stage = CONFIRM_TUNE_DIR if row.get(REPLICATE_COLUMN) is not None else SEARCH_TUNE_DIR
    path, fs = run.location.tune_storage()
    fs = fs or pyarrow.fs.LocalFileSystem()
    base = run.location.tune_dir(stage)
    try:
        trials = fs.get_file_info(pyarrow.fs.FileSelector(base))
    except FileNotFoundError:
        return None
    folders = [i.path for i in trials if i.type == pyarrow.fs.FileType.Directory
               and i.base_name.startswith(f"{row['trial_id']}_")]
    checkpoints = sorted(i.path for folder in folders for i in fs.get_file_info(pyarrow.fs.FileSelector(folder))
                         if i.type == pyarrow.fs.FileType.Directory and i.base_name.startswith("checkpoint_"))
    return tune.Checkpoint(checkpoints[-1], filesystem=fs) if checkpoints else None


def _score(template, config: dict[str, Any], checkpoint, corruptions: bool = False) -> dict[str, Any] | None:
    """On a Ray worker (or the driver, on its local cluster): the checkpoint's selected weights
    scored on the test split, and on its corrupted copies where asked (None: it has no selected weights)."""
    import dataclasses
    import os

    import torch

    from search.study.trainable import STATE_FILE, on_this_node, trial_config
    from trainers import selection_in, score_held_out

    cfg = trial_config(on_this_node(template), config)
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
    selected = selection_in(state)
    if selected is None:
        return None
    score = score_held_out(cfg, selected["model"], reparametrised=selected["reparametrised"], epoch=selected["epoch"],
                           corruptions=corruptions)
    return dataclasses.asdict(score)

