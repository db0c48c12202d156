"""Reading a finished (or running) study back: its trials, its front, printed for people."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from search._pareto import pareto_front
from search._store import TRIAL_COLUMNS, read_table
from trainers.errors import ConfigError

__all__ = ["load_experiment", "load_trials", "front_of", "format_front"]


def _experiment_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "trials.parquet").is_file():
        raise ConfigError(
            f"{path}: no trials.parquet here; pass a study folder such as results/convit_locality "
            "(the storage directory joined with the study name)"
        )
    return path


def load_experiment(path: str | Path) -> dict:
    """experiment.json: the spec, its objectives and versions."""
    path = _experiment_dir(path)
    meta = path / "experiment.json"
    if not meta.is_file():
        raise ConfigError(f"{meta}: missing; the folder is not a study written by `python -m search run`")
    return json.loads(meta.read_text())


def load_trials(path: str | Path) -> pd.DataFrame:
    return read_table(_experiment_dir(path) / "trials.parquet").to_pandas()


def front_of(path: str | Path) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """The Pareto front of the study's COMPLETE trials on its own objectives."""
    objectives = [tuple(o) for o in load_experiment(path)["objectives"]]
    trials = load_trials(path)
    complete = trials[trials["state"] == "COMPLETE"]
    return pareto_front(complete, objectives=objectives), objectives


def format_front(front: pd.DataFrame, objectives: list[tuple[str, str]], *, fmt: str) -> str:
    config_columns = [c for c in front.columns if c not in TRIAL_COLUMNS]
    objective_columns = [c for c, _ in objectives]
    columns = ["trial_id", "family"] + objective_columns
    columns += [c for c in ("params", "flops", "epochs_run", "throughput_device") if c not in columns]
    columns += config_columns
    view = front[columns]
    if fmt == "json":
        return view.to_json(orient="records", indent=2)
    if fmt == "csv":
        return view.to_csv(index=False)
    if view.empty:
        return "(the front is empty: no trial has completed yet)"
    shown = view.copy()
    if "throughput" in shown:
        shown["throughput"] = shown["throughput"].map(lambda v: f"{v:,.0f}")
    if "params" in shown:
        shown["params"] = shown["params"].map(lambda v: f"{v / 1e6:.2f}M")
    if "flops" in shown:
        shown["flops"] = shown["flops"].map(lambda v: f"{v / 1e6:.1f}M")
    for column in config_columns + [c for c in ("val_acc", "val_loss") if c in shown]:
        if shown[column].dtype.kind == "f":
            shown[column] = shown[column].map(lambda v: f"{v:.4g}")
    return shown.to_string(index=False)
