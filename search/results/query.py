"""Reading a finished (or running) study back: its trials, its front, printed for people.

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

from search.results.filter import Condition, filter_trials
from search.results.hypervolume import front_hypervolume
from search.results.location import StudyLocation, is_uri
from search.results.intervals import mark_ties
from search.results.pareto import DEVICE_COLUMN, device_groups, pareto_front
from search.results.replicates import REPLICATE_COLUMN, fold_replicates
from search.results.select import select
from search.results.store import EPOCH_COLUMNS, TRIAL_COLUMNS, read_table
from trainers.errors import ConfigError

__all__ = [
    "study_dir", "load_experiment", "load_trials", "front_of", "front_devices", "format_front", "format_trial", "fixed_settings", "load", "Experiment",
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


def _objectives(meta: dict, path: str | Path) -> list[tuple[str, str]]:
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


def _complete_front(
    trials: pd.DataFrame,
    objectives: Sequence[tuple[str, str]],
    *,
    where: Sequence[str | Condition] = (),
    families: Sequence[str] = (),
    device: str | None = None,
    mix_devices: bool = False,
) -> pd.DataFrame:
    trials = filter_trials(trials, where=where, families=families)
    if device is not None:
        known = sorted(set(trials[DEVICE_COLUMN].dropna())) if DEVICE_COLUMN in trials else []
        if device not in known:
            raise ConfigError(f"device {device!r}: no trial was measured there; the study's devices: {known or 'none yet'}")
        trials = trials[trials[DEVICE_COLUMN] == device]
    trials = _configs(trials, objectives)
    # Pruned and failed trials stopped early; their numbers do not compete with finished ones.
    front = pareto_front(trials[trials["state"] == "COMPLETE"], objectives=objectives, mix_devices=mix_devices)
    split = not mix_devices and bool(front_devices(front, objectives))
    return mark_ties(front, objectives, groups=DEVICE_COLUMN if split else None)


def _configs(trials: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """One row per config: confirmation replicates folded into their search trial's row (see
    search.results.replicates); a study without replicates as it is, with ``seeds`` 1."""
    if REPLICATE_COLUMN not in trials or not trials[REPLICATE_COLUMN].notna().any():
        return trials.assign(seeds=1)
    rows = fold_replicates(trials.to_dict("records"), objectives)
    return pd.DataFrame.from_records(rows, columns=list(trials.columns)).astype(
        {c: t for c, t in trials.dtypes.items() if c not in ("seeds", "val_acc_sd", *(o for o, _ in objectives))},
        errors="ignore")


def front_devices(front: pd.DataFrame, objectives: Sequence[tuple[str, str]]) -> list[str]:
    """The devices whose fronts ``front`` holds side by side (empty: one front, nothing split)."""
    if DEVICE_COLUMN not in front or device_groups(front[DEVICE_COLUMN].tolist(), objectives) is None:
        return []
    return list(dict.fromkeys(front[DEVICE_COLUMN].fillna("").tolist()))


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
) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """The Pareto front of the study's COMPLETE trials on its own objectives, after ``where``
    and ``families`` have narrowed the trials (see :func:`search.filter_trials`); one front per
    measuring device unless ``device`` picks one or ``mix_devices``."""
    objectives = _objectives(load_experiment(path), path)
    front = _complete_front(load_trials(path, objectives), objectives, where=where, families=families, device=device,
                            mix_devices=mix_devices)
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
              mix_devices: bool = False) -> pd.DataFrame:
        """The Pareto front of the COMPLETE trials, best first on the first objective; ``where``
        and ``families`` narrow the trials first (see :func:`search.filter_trials`). Trials whose
        throughput was measured on different devices get one front per device (sorted by
        device) unless ``device`` picks one or ``mix_devices`` compares them anyway."""
        return _complete_front(self.trials, self.objectives, where=where, families=families, device=device,
                               mix_devices=mix_devices)

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
    objectives = _objectives(meta, path)
    return Experiment(path=Path(path), spec=meta, objectives=objectives, trials=load_trials(path, objectives),
                      epochs=epochs)


def format_front(
    front: pd.DataFrame, objectives: list[tuple[str, str]], *, fmt: str, leading: Sequence[str] = (),
    empty: str = "no trial has completed yet",
) -> str:
    """``front`` as a table, JSON records or CSV; ``leading`` columns (e.g. ``study``) go first;
    ``empty``: why the front is empty, for the table."""
    config_columns = [c for c in front.columns if c not in TRIAL_COLUMNS and c not in leading]
    objective_columns = [c for c, _ in objectives]
    columns = list(leading) + ["trial_id", "family"]
    for column in objective_columns:  # each objective, then its interval where recorded
        columns += [column] + [f"{column}_{end}" for end in ("low", "high") if f"{column}_{end}" in front]
    if "seeds" in front and (front["seeds"].fillna(1) > 1).any():  # a confirmed study: what each mean rests on
        columns += ["seeds"] + (["val_acc_sd"] if "val_acc_sd" in front else [])
    columns += [c for c in ("tied_with", "params", "flops", "epochs_run", "throughput_device") if c in front and c not in columns]
    columns += config_columns
    view = front[columns]
    if fmt == "json":
        return view.to_json(orient="records", indent=2)
    if fmt == "csv":
        return view.to_csv(index=False)
    if view.empty:
        return f"(the front is empty: {empty})"
    shown = view.copy()
    for column in objective_columns:  # the interval beside its value, as "low-high" ('?': not recorded)
        if f"{column}_low" in shown and f"{column}_high" in shown:
            spec = ",.0f" if column == "throughput" else ".4f"
            shown.insert(shown.columns.get_loc(f"{column}_low"), f"{column} 95%", [
                "?" if lo != lo or hi != hi else f"{lo:{spec}}-{hi:{spec}}"
                for lo, hi in zip(shown.pop(f"{column}_low").astype(float), shown.pop(f"{column}_high").astype(float))])
    if "tied_with" in shown:
        shown["tied_with"] = shown["tied_with"].map(lambda v: v if isinstance(v, str) and v else "-")
    if "throughput" in shown:
        shown["throughput"] = shown["throughput"].map(lambda v: f"{v:,.0f}")
    if "params" in shown:
        shown["params"] = shown["params"].map(lambda v: f"{v / 1e6:.2f}M")
    if "flops" in shown:
        shown["flops"] = shown["flops"].map(lambda v: f"{v / 1e6:.1f}M")
    for column in config_columns + [c for c in ("val_acc", "val_loss", "val_acc_sd") if c in shown]:
        if shown[column].dtype.kind == "f":
            shown[column] = shown[column].map(lambda v: f"{v:.4g}")
    return shown.to_string(index=False)


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


def format_trial(
    row: pd.Series, objectives: list[tuple[str, str]], *, fmt: str, fixed: Mapping[str, object] | None = None
) -> str:
    """One trial (e.g. what :func:`search.select` picked) with every column that has a value, and
    the ``fixed`` settings (:func:`fixed_settings`) after them: ``KEY  VALUE`` lines, a JSON object
    (``fixed`` under its own key), or a one-row CSV of the columns."""
    present = {k: v for k, v in row.items() if not (v is None or (not isinstance(v, (list, tuple)) and pd.isna(v)))}
    leading = ["trial_id", "model", "family"] + [c for c, _ in objectives]
    order = [c for c in leading if c in present] + [c for c in present if c not in leading]
    view = pd.DataFrame([{k: present[k] for k in order}])
    fixed = dict(fixed or {})
    if fmt == "json":
        record = json.loads(view.to_json(orient="records", date_format="iso", double_precision=15))[0]
        return json.dumps({**record, "fixed": fixed} if fixed else record, indent=2, default=str)
    if fmt == "csv":
        return view.to_csv(index=False)
    width = max(map(len, order + list(fixed)))
    lines = []
    for key in order + ([""] if fixed else []) + list(fixed):
        if not key:
            lines.append("fixed by the spec:")
            continue
        value = present[key] if key in present else fixed[key]
        if key in ("throughput", "throughput_before_conversion"):
            text = f"{value:,.0f}"
        elif isinstance(value, float):
            text = f"{value:.6g}"
        else:
            text = str(value)
        lines.append(f"{key:<{width}}  {text}")
    return "\n".join(lines)
