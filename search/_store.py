"""The results store: plain Parquet files any reader opens without this project.

    <storage>/<name>/experiment.json   the spec, its hash, the objectives, versions
    <storage>/<name>/trials.parquet    one row per finished trial (schema: TRIAL_COLUMNS + config)
    <storage>/<name>/epochs.parquet    one row per trial and epoch (schema: EPOCH_COLUMNS)
    <storage>/<name>/pareto.parquet    the non-dominated COMPLETE trials, same schema as trials

Every file is written whole to a temporary name in the same folder and renamed over the old
one, so a reader sees the previous version or the new one, never half of one. A reader must
open the file once (``pq.read_table(open(path, "rb"))``, as :func:`read_table` does): pyarrow's
path-based reader takes the size from one ``stat`` and the bytes from a later ``open``, and a
rename in between makes it read a mix of two versions.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from search._pareto import pareto_mask

__all__ = [
    "ResultsStore",
    "TRIAL_COLUMNS",
    "EPOCH_COLUMNS",
    "TRIAL_VALUE_OF",
    "config_type",
    "write_atomic",
    "read_table",
]

# column -> (arrow type, meaning). The README's schema table is this list.
TRIAL_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "trial_id": (pa.string(), "Ray Tune trial id"),
    "trial_name": (pa.string(), "readable name: the trial id and its searched values"),
    "experiment": (pa.string(), "study name"),
    "model": (pa.string(), "timm model name"),
    "family": (pa.string(), "model family (convit, ...)"),
    "state": (pa.string(), "COMPLETE (ran to max_epochs or stopped by patience), PRUNED (stopped by the scheduler or the time limit), FAILED"),
    "stop_reason": (pa.string(), "max_epochs, patience, scheduler, time_limit or error"),
    "error": (pa.string(), "why a FAILED trial failed (one line)"),
    "epochs_run": (pa.int64(), "epochs trained"),
    "val_acc": (pa.float64(), "best validation accuracy over the epochs run"),
    "val_loss": (pa.float64(), "lowest validation loss over the epochs run"),
    "final_val_acc": (pa.float64(), "validation accuracy after the last epoch run"),
    "throughput": (pa.float64(), "inference images/s of the architecture the trial ended with (measured before training; T-CNN: again at the conversion)"),
    "throughput_before_conversion": (pa.float64(), "T-CNN: inference images/s of the CNN before the conversion (null otherwise)"),
    "converted_at_epoch": (pa.int64(), "T-CNN: epochs trained as a CNN before the conversion (null: never converted)"),
    "throughput_device": (pa.string(), "device that measured throughput"),
    "throughput_batch": (pa.int64(), "batch size of the throughput measurement"),
    "throughput_precision": (pa.string(), "fp32, bf16 or fp16"),
    "throughput_threads": (pa.int64(), "torch CPU threads during the measurement"),
    "torch_version": (pa.string(), "torch version of the trial"),
    "params": (pa.int64(), "trainable + frozen parameters"),
    "flops": (pa.int64(), "forward FLOPs per image (multiply-add = 2)"),
    "seed": (pa.int64(), "training seed"),
    "spec_hash": (pa.string(), "hash of the search spec (without storage and trial count)"),
    "git_commit": (pa.string(), "commit of this project that ran the study"),
    "node_ip": (pa.string(), "Ray node that ran the trial"),
    "started_at": (pa.timestamp("us", tz="UTC"), "trial start"),
    "ended_at": (pa.timestamp("us", tz="UTC"), "trial end"),
    "duration_s": (pa.float64(), "wall time of the trial"),
}

EPOCH_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "trial_id": (pa.string(), "Ray Tune trial id"),
    "epoch": (pa.int64(), "1-based epoch"),
    "train_loss": (pa.float64(), "mean training loss of the epoch"),
    "val_loss": (pa.float64(), "validation loss after the epoch"),
    "val_acc": (pa.float64(), "validation accuracy after the epoch"),
    "best_val_acc": (pa.float64(), "best validation accuracy so far"),
    "lr": (pa.float64(), "learning rate at the epoch's last step"),
    "epoch_time_s": (pa.float64(), "wall time of the epoch (train + validate)"),
    "train_images_per_s": (pa.float64(), "training images/s of the epoch"),
    "converted": (pa.bool_(), "T-CNN: the epoch trained the converted model (the first true row is the conversion epoch)"),
    "reported_at": (pa.timestamp("us", tz="UTC"), "when the epoch was reported"),
}

# The per-trial value of an objective: best over the epochs for accuracy/loss, else as measured.
TRIAL_VALUE_OF = {
    "val_acc": "best_val_acc",
    "val_loss": "best_val_loss",
    "throughput": "throughput",
    "params": "params",
    "flops": "flops",
}


def config_type(param: Mapping[str, Any]) -> pa.DataType:
    """Arrow type of a searched knob's column, from its ParamSpec as a plain dict."""
    kind = param["type"]
    if kind == "uniform" or kind == "loguniform":
        return pa.float64()
    if kind == "int":
        return pa.int64()
    values = param["values"]
    if all(isinstance(v, bool) for v in values):
        return pa.bool_()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return pa.int64()
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return pa.float64()
    return pa.string()


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            pq.write_table(table, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(data: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_table(path: str | os.PathLike) -> pa.Table:
    """One version of a store file, even while the search rewrites it (see the module doc)."""
    with open(path, "rb") as handle:
        return pq.read_table(handle)


class ResultsStore:
    """Collects trial and epoch rows on the driver and rewrites the Parquet files atomically.

    Tune calls its callbacks from the driver's one event loop, so there is no locking here."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        space: Mapping[str, Mapping[str, Any]],
        objectives: Sequence[tuple[str, str]],
    ) -> None:
        self.directory = Path(directory)
        self.objectives = list(objectives)
        # "model" (the searched choice between models) is already the trial column of that name.
        self._config_types = {key: config_type(param) for key, param in space.items() if key != "model"}
        clash = set(self._config_types) & set(TRIAL_COLUMNS)
        if clash:
            raise ValueError(f"space keys clash with result columns: {sorted(clash)}")
        self.trial_schema = pa.schema(
            [(name, typ) for name, (typ, _) in TRIAL_COLUMNS.items()]
            + [(name, typ) for name, typ in self._config_types.items()]
        )
        self.epoch_schema = pa.schema([(name, typ) for name, (typ, _) in EPOCH_COLUMNS.items()])
        self._trials: list[dict[str, Any]] = []
        self._epochs: list[dict[str, Any]] = []

    # -- rows ---------------------------------------------------------------------------
    def add_epoch(self, row: Mapping[str, Any]) -> None:
        self._epochs.append({name: row.get(name) for name in EPOCH_COLUMNS})

    def add_trial(self, row: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        out = {name: row.get(name) for name in TRIAL_COLUMNS}
        for key, typ in self._config_types.items():
            value = config.get(key)
            out[key] = None if value is None else (str(value) if typ == pa.string() else value)
        self._trials.append(out)

    @property
    def trials(self) -> list[dict[str, Any]]:
        return list(self._trials)

    # -- files --------------------------------------------------------------------------
    def trials_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.trials, schema=self.trial_schema)

    def pareto_table(self) -> pa.Table:
        """COMPLETE trials that no other COMPLETE trial dominates, best first."""
        complete = [t for t in self.trials if t["state"] == "COMPLETE"]
        if complete:
            values = [[t[c] if t[c] is not None else float("nan") for c, _ in self.objectives] for t in complete]
            mask = pareto_mask(values, modes=[m for _, m in self.objectives])
            front = [t for t, keep in zip(complete, mask) if keep]
            first, mode = self.objectives[0]
            front.sort(key=lambda t: t[first], reverse=mode == "max")
        else:
            front = []
        return pa.Table.from_pylist(front, schema=self.trial_schema)

    def flush(self) -> None:
        write_atomic(pa.Table.from_pylist(self._epochs, schema=self.epoch_schema), self.directory / "epochs.parquet")
        write_atomic(self.trials_table(), self.directory / "trials.parquet")
        write_atomic(self.pareto_table(), self.directory / "pareto.parquet")
