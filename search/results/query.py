"""Reading a finished (or running) study back: its experiment.json, its trials, its front (search.results.front).

For notebooks, :func:`load` reads a study folder into an :class:`Experiment`::

    exp = search.load("results/convit_locality")
    exp.front()                     # Pareto front of the COMPLETE trials
    exp.select(rule="knee")         # one trial of it
    exp.hypervolume(reference=[0.0, 0.0])
    exp.front(where=["throughput>=5000"], families=["convit"])   # the front of those trials

``where``/``families`` narrow the trials *before* the front is taken (see ``search.results.filter``):
the result is the front of the trials that pass, which can hold trials that the whole study's
front does not (a trial dominated only by trials that were filtered out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from search.results.filter import Condition
from search.results.front import compute_front, front_devices
from search.results.hypervolume import front_hypervolume
from search.results.location import StudyLocation, is_uri
from search.results.pareto import DEVICE_COLUMN
from search.results.select import select
from search.results.store import EPOCH_COLUMNS, read_table
from trainers.errors import ConfigError

__all__ = [
    "study_dir", "load_experiment", "read_experiment_json", "study_objectives", "load_trials", "front_of", "front_devices",
    "fixed_settings", "load", "Experiment",
]


def study_dir(path: str | Path) -> Path:
    """The study's local folder (ConfigError when it is not a study); a study at a URI
    (s3://..., see search.results.location) is downloaded into its staging folder first."""
    return _experiment_dir(path)


def _experiment_dir(path: str | Path) -> Path:
    if is_uri(path):
        location = StudyLocation(path)
        if "trials.parquet" not in location.pull():
            raise ConfigError(f"{path}: no trials.parquet there; pass the URI of a study (the storage URI joined with the study name)")
        return location.local
    path = Path(path)
    if not (path / "trials.parquet").is_file():
        raise ConfigError(
            f"{path}: no trials.parquet here; pass a study folder such as results/convit_locality "
            "(the storage directory joined with the study name)"
        )
    return path


def load_experiment(path: str | Path) -> dict:
    """experiment.json: the spec, its objectives and versions."""
    return read_experiment_json(_experiment_dir(path) / "experiment.json")


def read_experiment_json(meta: Path) -> dict:
    """The experiment.json file ``meta`` as a dict; ConfigError where it is missing or damaged."""
    if not meta.is_file():
        raise ConfigError(f"{meta}: missing; the folder is not a study written by `python -m search run`")
    try:
        data = json.loads(meta.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{meta}: not valid JSON ({exc}); the study's files are damaged: restore it from a copy, "
                          "or run the spec again under another name") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{meta}: a JSON {type(data).__name__}, not the object `python -m search run` writes; "
                          "the study's files are damaged")
    return data


def load_trials(path: str | Path, objectives: Sequence[tuple[str, str]] = ()) -> pd.DataFrame:
    """trials.parquet; ConfigError where it lacks the columns every study has, or those of
    ``objectives`` (the study's own, from experiment.json)."""
    file = _experiment_dir(path) / "trials.parquet"
    trials = read_table(file).to_pandas()
    missing = [c for c in ("trial_id", "state", *(c for c, _ in objectives)) if c not in trials.columns]
    if missing:
        raise ConfigError(f"{file}: no column {', '.join(map(repr, missing))}; its experiment.json and trials.parquet "
                          "are not one study's (the files were edited or mixed)")
    return trials


def study_objectives(meta: dict, path: str | Path) -> list[tuple[str, str]]:
    """The (column, mode) pairs of experiment.json's ``meta`` (read from ``path``); ConfigError where damaged."""
    if "objectives" not in meta:
        raise ConfigError(
            f"{path}/experiment.json: no 'objectives'; the folder is not a study written by `python -m search run`"
        )
    objectives = meta["objectives"]
    if (not isinstance(objectives, list) or not objectives
            or not all(isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) and o[1] in ("min", "max")
                       for o in objectives)):
        raise ConfigError(f"{path}/experiment.json: 'objectives' is {objectives!r}, not a list of [column, min|max] "
                          "pairs; the study's files are damaged")
    return [tuple(o) for o in objectives]


def _one_front(front: pd.DataFrame, objectives: Sequence[tuple[str, str]], what: str) -> pd.DataFrame:
    devices = front_devices(front, objectives)
    if devices:
        raise ConfigError(
            f"{what}: the trials' throughput was measured on {len(devices)} devices ({', '.join(map(repr, devices))}), "
            "one front each; pick one with device=NAME (--device NAME), or mix_devices=True (--mix-devices) to compare them anyway"
        )
    return front


def front_of(
    path: str | Path,
    *,
    where: Sequence[str | Condition] = (),
    families: Sequence[str] = (),
    device: str | None = None,
    mix_devices: bool = False,
    dominated: bool = False,
) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """The Pareto front of the study's COMPLETE trials on its own objectives, after ``where``
    and ``families`` have narrowed the trials (see :func:`search.filter_trials`); one front per
    measuring device unless ``device`` picks one or ``mix_devices``; ``dominated``: the candidates
    dominated within noise after the members (see :func:`search.results.front.compute_front`)."""
    objectives = study_objectives(load_experiment(path), path)
    front = compute_front(load_trials(path, objectives), objectives, where=where, families=families, device=device,
                          mix_devices=mix_devices, dominated=dominated)
    return front, objectives


@dataclass(frozen=True, eq=False)  # eq=False: DataFrames have no truth value to compare by
class Experiment:
    """A study folder as read by :func:`load`: a snapshot; load again to see newer trials."""

    path: Path
    spec: dict  # experiment.json as a whole (the search spec itself is under "spec")
    objectives: list[tuple[str, str]]  # (column, mode) pairs, e.g. ("val_acc", "max")
    trials: pd.DataFrame  # trials.parquet: one row per finished trial, any state
    epochs: pd.DataFrame  # epochs.parquet: one row per trial and epoch (empty when absent)

    def front(self, *, where: Sequence[str] = (), families: Sequence[str] = (), device: str | None = None,
              mix_devices: bool = False, dominated: bool = False) -> pd.DataFrame:
        """The Pareto front of the COMPLETE trials, best first on the first objective; ``where``
        and ``families`` narrow the trials first (see :func:`search.filter_trials`). Trials whose
        throughput was measured on different devices get one front per device (sorted by
        device) unless ``device`` picks one or ``mix_devices`` compares them anyway. Members another
        member dominates within noise are left out; ``dominated`` appends them, with ``dominated_by``."""
        return compute_front(self.trials, self.objectives, where=where, families=families, device=device,
                             mix_devices=mix_devices, dominated=dominated)

    @property
    def devices(self) -> list[str]:
        """The devices that measured the trials' throughput, most trials first."""
        if DEVICE_COLUMN not in self.trials:
            return []
        return self.trials[DEVICE_COLUMN].dropna().value_counts().index.tolist()

    def select(self, *, rule: str = "knee", where: Sequence[str] = (), families: Sequence[str] = (),
               device: str | None = None, mix_devices: bool = False) -> pd.Series:
        """One trial of :meth:`front` (rules: see :func:`search.select`); a front split by device
        needs ``device`` (or ``mix_devices``)."""
        front = self.front(where=where, families=families, device=device, mix_devices=mix_devices)
        return select(_one_front(front, self.objectives, "select"), objectives=self.objectives, rule=rule)

    def hypervolume(self, *, reference: Sequence[float] | Mapping[str, float], device: str | None = None,
                    mix_devices: bool = False) -> float:
        """Hypervolume of the COMPLETE trials up to ``reference`` (see :func:`search.front_hypervolume`);
        a front split by device needs ``device`` (or ``mix_devices``)."""
        front = _one_front(self.front(device=device, mix_devices=mix_devices), self.objectives, "hypervolume")
        return front_hypervolume(front, objectives=self.objectives, reference=reference)


def load(path: str | Path) -> Experiment:
    """Read the study folder ``path`` (e.g. ``results/convit_locality``) into an :class:`Experiment`."""
    path = _experiment_dir(path)  # once: a URI is downloaded once
    meta = load_experiment(path)
    epochs_file = path / "epochs.parquet"
    if epochs_file.is_file():
        epochs = read_table(epochs_file).to_pandas()
    else:  # typed and empty, so column access works before the first epoch is written
        epochs = pa.schema([(n, t) for n, (t, _) in EPOCH_COLUMNS.items()]).empty_table().to_pandas()
    objectives = study_objectives(meta, path)
    return Experiment(path=Path(path), spec=meta, objectives=objectives, trials=load_trials(path, objectives),
                      epochs=epochs)


def fixed_settings(meta: Mapping, row: pd.Series | Mapping) -> dict[str, object]:
    """What the spec in ``meta`` (experiment.json) fixed for ``row``'s trial, i.e. the rest of its
    config: ``model.args.<name>`` and ``train.<name>`` keys, searched ones left out."""
    spec = meta.get("spec") or {}
    entries = [spec["model"]] if spec.get("model") else list(spec.get("models") or [])
    entry = next((m for m in entries if m.get("name") == row.get("model")), entries[0] if len(entries) == 1 else {})
    searched = set(spec.get("space") or {}) | set(entry.get("space") or {})
    fixed = {f"model.args.{k}": v for k, v in (entry.get("args") or {}).items()}
    fixed.update({f"train.{k}": v for k, v in (spec.get("train") or {}).items() if k not in searched})
    return fixed
