"""One trial of a study as a standalone YAML file that ``python -m search train`` retrains.

The file holds what the trial ran with, resolved the way the search resolved it (through
:func:`search.study.trainable.trial_config`): the model and its full constructor arguments (fixed and
searched), the dataset request, every training setting with the searched ones applied, the
epochs (the study's ``max_epochs``), patience, seed and throughput settings. ``source:`` records
where it came from (study, trial, how it was picked, what the study measured); training ignores
it. Nothing in it refers back to the study folder, which may be deleted.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pandas as pd
import yaml
from pydantic import Field, model_validator

from search.results.location import is_uri
from search.results.query import load_experiment, study_dir
from search.spec import DatasetSpec, ParamSpec, SearchSpec, ThroughputSettingsField, TrainSettingsField, to_plain
from search.spec.validation import FieldError, Record, SpecLocation, Whole, from_plain
from trainers import atomic_write, check_output_file
from trainers.data import DatasetRequest
from trainers.errors import ConfigError

__all__ = ["EXPORT_VERSION", "ExportedModel", "ExportedDataset", "ExportedTrial", "export_trial", "sampled_config", "write_export", "load_export"]

EXPORT_VERSION = 1


class ExportedModel(Record):
    name: str  # a timm model name (this project's families are registered with timm)
    args: dict[str, Any] = Field(default_factory=dict)  # constructor keyword arguments


class ExportedDataset(DatasetSpec):
    """The spec's dataset section plus the seed that picked its validation split."""

    seed: Annotated[Whole, Field(ge=0)] = 0

    def request(self, *, data_dir: str | None = None) -> DatasetRequest:
        return DatasetRequest(
            name=self.name,
            data_dir=data_dir if data_dir is not None else self.data_dir,
            train_fraction=self.train_fraction,
            val_fraction=self.val_fraction,
            image_size=self.image_size,
            seed=self.seed,
        )


class ExportedTrial(Record):
    """An exported config as read back by :func:`load_export`."""

    version: Whole
    model: ExportedModel
    dataset: ExportedDataset
    epochs: Whole
    train: TrainSettingsField  # type: ignore[valid-type]
    throughput: ThroughputSettingsField  # type: ignore[valid-type]
    seed: Annotated[Whole, Field(ge=0)]
    patience: Whole | None = None
    source: dict[str, Any] = Field(default_factory=dict)  # provenance; not used to train

    @model_validator(mode="after")
    def _check(self) -> "ExportedTrial":
        if self.version != EXPORT_VERSION:
            raise FieldError("version", f"this project reads version {EXPORT_VERSION}, got {self.version}; export the trial again")
        if self.epochs < 1:
            raise FieldError("epochs", f"must be at least 1, got {self.epochs}")
        if self.patience is not None and self.patience < 1:
            raise FieldError("patience", f"must be at least 1 epoch (or null), got {self.patience}")
        return self


def _native(value: Any) -> Any:
    """numpy/pandas scalars -> plain Python, NaN/NA -> None, timestamps -> ISO strings."""
    if isinstance(value, Mapping):
        return {str(k): _native(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_native(v) for v in value]
    if isinstance(value, (pd.Timestamp, dt.datetime)):
        return value.isoformat()
    if isinstance(value, np.generic):
        value = value.item()
    if value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _same_option(option: Any, stored: Any) -> bool:
    """Whether a stored choice value is ``option``: numbers by value (a [1, 0.5] choice is stored
    as doubles), anything else by its text (a mixed-type choice is stored as strings)."""
    if isinstance(option, bool) and isinstance(stored, bool):
        return option == stored
    numbers = (int, float)
    if isinstance(option, numbers) and isinstance(stored, numbers) and not isinstance(option, bool) and not isinstance(stored, bool):
        return option == stored
    return str(option) == str(stored)


def _knob_value(key: str, param: ParamSpec, value: Any, where: str) -> Any:
    """A stored knob value as the search sampled it (choices come back as one of their values)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        raise ConfigError(f"{where}: no value for the knob {key!r}; export a COMPLETE trial of this model")
    if param.type == "choice":
        for option in param.values or ():
            if _same_option(option, _native(value)):
                return option
        raise ConfigError(f"{where}: {key}={value!r} is not one of the space's values {list(param.values or ())}")
    if param.type == "int":
        return int(value)
    return float(value)


def sampled_config(spec: SearchSpec, row: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The Tune config that ran ``row`` (a trials.parquet row), as the search sampled it: its knobs
    (``model`` too in a conditional space); ``where`` names the row in errors."""
    models = {m.name: m for m in spec.candidates}
    model = _native(row.get("model")) or spec.candidates[0].name
    if model not in models:
        raise ConfigError(f"{where}: model {model!r} is not one of the study's models ({', '.join(models)})")
    knobs = {**spec.space, **models[model].space}
    sampled: dict[str, Any] = {key: _knob_value(key, param, row.get(key), where) for key, param in knobs.items()}
    if spec.conditional:
        sampled["model"] = model
    return sampled


def _study_spec(study: Path, meta: Mapping[str, Any]) -> SearchSpec:
    where = SpecLocation(f"{study}/experiment.json", "spec")
    if not isinstance(meta.get("spec"), dict):
        raise where.error("missing; the study predates exports, or was not written by `python -m search run`")
    return from_plain(SearchSpec, meta["spec"], where)


def _dataset(spec: SearchSpec, seed: int) -> dict[str, Any]:
    """The spec's dataset and the seed that drew the trial's split: the study's, or with
    ``split_seed: trial`` the trial's own (the key left out where unset, as before it existed)."""
    plain = {k: v for k, v in to_plain(spec.dataset).items() if not (k in ("split_seed", "corruptions") and v is None)}
    return {**plain, "seed": seed if spec.dataset.split_per_trial else spec.algorithm.seed}


def export_trial(
    study: str | os.PathLike,
    trial: pd.Series | Mapping[str, Any],
    *,
    selected_by: str | None = None,
    where: Sequence[str] = (),
    families: Sequence[str] = (),
) -> dict[str, Any]:
    """The exported config (plain data, ready for :func:`write_export`) of ``trial``, a row of the
    study's trials.parquet. ``selected_by``/``where``/``families`` only go into ``source:``."""
    from search.study.trainable import TrialTemplate, trial_config  # torch, timm: only when exporting

    recorded = str(study) if is_uri(study) else str(Path(study).resolve())
    study = study_dir(study)
    meta = load_experiment(study)
    spec = _study_spec(study, meta)
    row = dict(trial)
    trial_id = _native(row.get("trial_id"))
    label = f"{study}: trial {trial_id}"
    sampled = sampled_config(spec, row, where=label)
    template = TrialTemplate(
        models={m.name: dict(m.args) for m in spec.candidates},
        data=None,  # type: ignore[arg-type]  # the dataset is prepared by `train`, not here
        epochs=spec.budget.max_epochs,
        train=spec.train,
        throughput=spec.throughput,
        patience=spec.budget.patience,
        # the seed the trial trained with: a grid's trials (and replicates) have their own
        seed=int(_native(row.get("seed")) if _native(row.get("seed")) is not None else spec.algorithm.seed),
    )
    cfg = trial_config(template, sampled)
    measured = ("family", "epochs_run", "stop_reason", "val_acc", "val_loss", "final_val_acc", "test_acc",
                "test_acc_low", "test_acc_high", "test_epoch", "throughput", "throughput_device", "params", "flops",
                "seed", "spec_hash", "git_commit")
    source = {
        "study": recorded,
        "experiment": meta.get("name"),
        "trial_id": trial_id,
        "trial_name": _native(row.get("trial_name")),
        "selected_by": selected_by,
        "where": list(where),
        "families": list(families),
        **{key: _native(row.get(key)) for key in measured},
        "dataset_content_hash": (meta.get("dataset") or {}).get("content_hash"),
        "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return _native({
        "version": EXPORT_VERSION,
        "model": {"name": cfg.model, "args": cfg.model_args},
        "dataset": _dataset(spec, cfg.seed),
        "epochs": cfg.epochs,
        "patience": cfg.patience,
        "seed": cfg.seed,
        "train": to_plain(cfg.train),
        "throughput": to_plain(cfg.throughput),
        "source": source,
    })


def check_export_path(path: str | os.PathLike) -> Path:
    """``path`` as a file `write_export` can write (ConfigError naming the fix otherwise), checked
    before the trial is selected and printed."""
    return check_output_file(path, option="--export", example="best.yaml")


def write_export(config: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``config`` to ``path`` as YAML (safe_dump), atomically; an existing file is replaced
    and a missing folder created."""
    path = check_export_path(path)
    source = config.get("source") or {}
    header = (
        f"# Trial {source.get('trial_id')} of the study {source.get('study')}"
        + (f", selected by {source['selected_by']}" if source.get("selected_by") else "")
        + f".\n# Retrain it from scratch and test it once: python -m search train {path}\n"
        + "# `source:` is provenance only; every other key is what training reads.\n"
    )
    text = header + yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)
    atomic_write(path, lambda handle: handle.write(text.encode()))
    return path


def load_export(path: str | os.PathLike) -> ExportedTrial:
    """Read and validate an exported config; every problem is a one-line :class:`ConfigError`."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; pass the YAML file `python -m search pareto STUDY --export FILE` wrote")
    if not path.is_file():
        raise ConfigError(
            f"{path}: no such file; export a trial first: python -m search pareto STUDY --select knee --export {path}"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{line}: {getattr(exc, 'problem', None) or 'not valid YAML'}; fix the YAML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file; pass a YAML file written by `pareto --export`") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top (version:, model:, dataset:, train:, ...)")
    if "space" in data or "objectives" in data:
        raise ConfigError(
            f"{path}: this is a search spec, not an exported trial; run it with `python -m search run {path}`, "
            "or export one trial of a study with `python -m search pareto STUDY --export best.yaml`"
        )
    return from_plain(ExportedTrial, data, SpecLocation(str(path)))
