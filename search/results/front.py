"""The study's Pareto front: one pipeline from trial rows to the front every view shows.

    trials --filter (where, families, device)--> configs (replicates folded, see
    search.results.replicates) --COMPLETE only--> non-dominated per device (search.results.pareto)
    --sorted best first on the first objective--> members dominated within noise set apart
    (``dominated_by``) --> ties marked among the rest (``tied_with``; rules: search.results.intervals)

The store (``pareto.parquet`` and the ties in ``trials.parquet``), :func:`search.load` ``.front()``,
``python -m search pareto``, ``compare``, the report and the Pareto page all take their front from
:func:`compute_front`, so a rule about the front is written here once.

Only trials that ran their full budget (COMPLETE) compete: a trial the scheduler stopped after 2
epochs is never compared with 4-epoch trials as if it had finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from search.results.filter import Condition, filter_trials
from search.results.intervals import dominated_by, mark_ties, separated_groups
from search.results.pareto import DEVICE_COLUMN, device_groups, pareto_front
from search.results.replicates import REPLICATE_COLUMN, fold_replicates
from trainers.errors import ConfigError

__all__ = ["compute_front", "configs", "front_devices", "front_groups", "DOMINATED_COLUMN"]

DOMINATED_COLUMN = "dominated_by"  # the trials that dominate a set-apart candidate within noise


def compute_front(
    trials: pd.DataFrame,
    objectives: Sequence[tuple[str, str]],
    *,
    where: Sequence[str | Condition] = (),
    families: Sequence[str] = (),
    device: str | None = None,
    mix_devices: bool = False,
    dominated: bool = False,
) -> pd.DataFrame:
    """The Pareto front of ``trials`` (one row per finished trial, as in ``trials.parquet``) on
    ``objectives`` ((column, mode) pairs): the trials ``where``/``families`` keep (see
    :func:`search.filter_trials`), on ``device`` alone when given, folded into configs, COMPLETE
    ones only; one front per measuring device unless ``mix_devices``; best first on the first
    objective, each member's ``tied_with`` set. Candidates another candidate dominates within noise
    are not members; ``dominated`` appends them after the members, each with its ``dominated_by``
    (the members' ``dominated_by`` is null)."""
    trials = filter_trials(trials, where=where, families=families)
    if device is not None:
        known = sorted(set(trials[DEVICE_COLUMN].dropna())) if DEVICE_COLUMN in trials else []
        if device not in known:
            raise ConfigError(f"device {device!r}: no trial was measured there; the study's devices: {known or 'none yet'}")
        trials = trials[trials[DEVICE_COLUMN] == device]
    trials = configs(trials, objectives)
    front = pareto_front(trials[trials["state"] == "COMPLETE"], objectives=objectives, mix_devices=mix_devices)
    split = not mix_devices and bool(front_devices(front, objectives))
    front = front.assign(**{DOMINATED_COLUMN: None})
    for rows in _per_device(front, split):
        front.loc[rows.index, DOMINATED_COLUMN] = np.array(dominated_by(rows, objectives), dtype=object)
    beaten = front[DOMINATED_COLUMN].notna()
    members = mark_ties(front[~beaten], objectives, groups=DEVICE_COLUMN if split else None)
    if not dominated:
        return members
    return pd.concat([members, front[beaten].assign(tied_with=None)])


def _per_device(front: pd.DataFrame, split: bool) -> list[pd.DataFrame]:
    if not split:
        return [front]
    keys = front[DEVICE_COLUMN].fillna("")
    return [front[keys == key] for key in dict.fromkeys(keys.tolist())]


def front_groups(front: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> int:
    """How many groups the measurements separate among ``front``'s members (its rows without a
    ``dominated_by``): tied members, chained, count once; summed over the devices' fronts."""
    if DOMINATED_COLUMN in front:
        front = front[front[DOMINATED_COLUMN].isna()]
    split = bool(front_devices(front, objectives))
    return sum(separated_groups(rows, objectives) for rows in _per_device(front, split))


def configs(trials: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """One row per config: confirmation replicates folded into their search trial's row (see
    search.results.replicates); a study without replicates as it is, with ``seeds`` 1."""
    if REPLICATE_COLUMN not in trials or not trials[REPLICATE_COLUMN].notna().any():
        return trials.assign(seeds=trials["seeds"].fillna(1) if "seeds" in trials else 1)
    rows = fold_replicates(trials.to_dict("records"), objectives)
    return pd.DataFrame.from_records(rows, columns=list(trials.columns)).astype(
        {c: t for c, t in trials.dtypes.items() if c not in ("seeds", "val_acc_sd", "val_acc_sd_df", "selection_val_acc", *(o for o, _ in objectives))},
        errors="ignore")


def front_devices(front: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> list[str]:
    """The devices whose fronts ``front`` holds side by side (empty: one front, nothing split)."""
    if DEVICE_COLUMN not in front or device_groups(front[DEVICE_COLUMN].tolist(), objectives) is None:
        return []
    return list(dict.fromkeys(front[DEVICE_COLUMN].fillna("").tolist()))
