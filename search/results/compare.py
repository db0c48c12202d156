"""Two or more studies' Pareto fronts side by side, with comparable hypervolumes.

Each study keeps its own front (of its COMPLETE trials, after ``where``/``families``); the table
stacks them with a ``study`` column, best first on the first objective, and ``joint_front``
marks the rows that no row of any study dominates. The hypervolumes share one reference point:
for each objective, the worst value over all the fronts (the lowest for 'max', the highest for
'min'). Only then are the numbers comparable; a point that is the worst on some objective adds
no volume, so a front of one such trial has hypervolume 0.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from search.results.filter import filter_trials
from search.results.hypervolume import front_hypervolume
from search.results.pareto import DEVICE_COLUMN, DEVICE_METRICS, RUNTIME_COLUMN, device_groups, pareto_mask
from search.results.front import compute_front
from search.results.query import load_experiment, load_trials, study_dir, study_objectives
from trainers.errors import ConfigError

__all__ = ["Comparison", "compare_studies"]


@dataclasses.dataclass(frozen=True, eq=False)
class Comparison:
    objectives: list[tuple[str, str]]
    front: pd.DataFrame  # the fronts stacked: study, joint_front, then the trial columns
    studies: pd.DataFrame  # one row per study: study, path, trials, complete, front, hypervolume
    reference: list[float] | None  # the shared reference point; None when every front is empty


def _labels(paths: Sequence[Path]) -> list[str]:
    names = [p.name or str(p) for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def _study_front(path: Path, trials: pd.DataFrame, objectives, *, where, families) -> pd.DataFrame:
    present = set(trials["family"].dropna()) if "family" in trials else set()
    if families and not present & set(families):
        return compute_front(trials.iloc[0:0], objectives)  # none of those families here
    try:
        trials = filter_trials(trials, where=where, families=[f for f in families if f in present])
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return compute_front(trials, objectives)


def _one_runtime(paths: Sequence[Path], objectives: Sequence[tuple[str, str]]) -> None:
    """Refuse studies whose throughput was timed in different runtimes (throughput.runtime): their
    fronts would mix inductive bias with implementation effort. Trials that did not record it
    (written before the setting) are not counted."""
    if not any(c in DEVICE_METRICS for c, _ in objectives):
        return
    runtimes: dict[str, list[str]] = {}
    for path in paths:
        trials = load_trials(path)
        if RUNTIME_COLUMN in trials:
            for runtime in sorted(set(trials[RUNTIME_COLUMN].dropna())):
                runtimes.setdefault(str(runtime), []).append(str(path))
    if len(runtimes) > 1:
        said = "; ".join(f"{r}: {', '.join(p)}" for r, p in runtimes.items())
        raise ConfigError(f"compare: the studies' throughput was timed in different runtimes ({said}); "
                          "run them again with one throughput.runtime (eager or kernels) to compare their fronts")


def compare_studies(
    paths: Sequence[str | os.PathLike],
    *,
    where: Sequence[str] = (),
    families: Sequence[str] = (),
) -> Comparison:
    """The fronts of the studies at ``paths`` (see the module doc). The studies must share their
    objectives; ``where``/``families`` narrow every study's trials before its front is taken."""
    if len(paths) < 2:
        raise ConfigError("compare: pass at least two study folders")
    given = [str(p) for p in paths]
    paths = [study_dir(p) for p in paths]  # a URI: its staging copy
    seen: dict[Path, str] = {}
    for path, name in zip(paths, given):
        if path.resolve() in seen:
            raise ConfigError(f"compare: {seen[path.resolve()]} and {name} are the same study; pass each study once")
        seen[path.resolve()] = name
    objectives = study_objectives(load_experiment(paths[0]), paths[0])
    for path in paths[1:]:
        other = study_objectives(load_experiment(path), path)
        if sorted(other) != sorted(objectives):
            raise ConfigError(
                f"{path} optimises {', '.join(f'{c} {m}' for c, m in other)} but {paths[0]} optimises "
                f"{', '.join(f'{c} {m}' for c, m in objectives)}; fronts compare only on the same objectives"
            )
    _one_runtime(paths, objectives)
    families = list(families)
    if families:
        known = set()
        for path in paths:
            trials = load_trials(path)
            known |= set(trials["family"].dropna()) if "family" in trials else set()
        unknown = [f for f in families if f not in known]
        if unknown:
            raise ConfigError(f"--family {','.join(unknown)}: no trial of that family in any of the studies; "
                              f"they have {', '.join(sorted(known)) or 'no finished trial'}")

    labels = _labels([Path(g.partition("?")[0]) if "://" in g else Path(g) for g in given])
    fronts, summary = [], []
    for label, path, where_given in zip(labels, paths, given):
        trials = load_trials(path, objectives)
        front = _study_front(path, trials, objectives, where=where, families=families)
        fronts.append(front.assign(study=label))
        summary.append({"study": label, "path": where_given, "trials": len(trials),
                        "complete": int((trials["state"] == "COMPLETE").sum()), "front": len(front)})

    columns = [c for c, _ in objectives]
    modes = [m for _, m in objectives]
    nonempty = [f for f in fronts if not f.empty]
    stacked = pd.concat(nonempty, ignore_index=True) if nonempty else fronts[0].iloc[0:0]
    values = stacked[columns].to_numpy(dtype=float, na_value=np.nan)
    # Studies measured on different devices do not compete: one joint front per device.
    groups = device_groups(stacked[DEVICE_COLUMN].tolist() if DEVICE_COLUMN in stacked else None, objectives)
    stacked.insert(0, "joint_front", pareto_mask(values, modes=modes, groups=groups) if len(stacked) else [])
    stacked.insert(0, "study", stacked.pop("study"))
    order = {label: i for i, label in enumerate(labels)}
    stacked = stacked.assign(_study_order=stacked["study"].map(order)).sort_values(
        [columns[0], "_study_order"], ascending=[modes[0] == "min", True], kind="stable"
    ).drop(columns="_study_order").reset_index(drop=True)

    finite = values[~np.isnan(values).any(axis=1)] if len(values) else values
    reference = None
    if len(finite):
        reference = [float(finite[:, j].min() if m == "max" else finite[:, j].max()) for j, m in enumerate(modes)]
    for row, front in zip(summary, fronts):
        row["hypervolume"] = 0.0 if reference is None else front_hypervolume(front, objectives=objectives, reference=reference)
    return Comparison(objectives=objectives, front=stacked, studies=pd.DataFrame(summary), reference=reference)
