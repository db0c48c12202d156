"""The results store: plain Parquet files any reader opens without this project.

    <storage>/<name>/experiment.json   the spec, its hash, the objectives, versions
    <storage>/<name>/trials.parquet    one row per finished trial (schema: TRIAL_COLUMNS + config)
    <storage>/<name>/epochs.parquet    one row per trial and epoch (schema: EPOCH_COLUMNS)
    <storage>/<name>/pareto.parquet    the front's members (search.results.front), same schema as trials
    <storage>/<name>/progress.parquet  one row per finished trial: the front's size and hypervolume then

Every file is written whole to a temporary name in the same folder and renamed over the old
one, so a reader sees the previous version or the new one, never half of one. A reader must
open the file once (``pq.read_table(pa.OSFile(path))``, as :func:`read_table` does): pyarrow's
path-based reader takes the size from one ``stat`` and the bytes from a later ``open``, and a
rename in between makes it read a mix of two versions. The file is opened by pyarrow, not as a
Python file object: pyarrow (seen with 26.0.1) finishes closing a Python file read by
``read_table`` in a background thread, which aborts the interpreter at exit more often than not
("terminate called without an active exception", exit code 134; apache/arrow#33975).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from search.results.front import compute_front
from search.results.hypervolume import hypervolume
from search.results.intervals import wilson_interval
from search.results.pareto import DEVICE_COLUMN
from search.results.replicates import REPLICATE_COLUMN
from trainers import atomic_write
from trainers.errors import ConfigError, DiskFullError

if TYPE_CHECKING:
    from search.results.location import StudyLocation

__all__ = [
    "ResultsStore",
    "TRIAL_COLUMNS",
    "EPOCH_COLUMNS",
    "PROGRESS_COLUMNS",
    "TRIAL_VALUE_OF",
    "config_type",
    "write_atomic",
    "read_table",
]

# column -> (arrow type, meaning). docs/store.md's "Schemas" table is this list.
TRIAL_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "trial_id": (pa.string(), "Ray Tune trial id"),
    "trial_name": (pa.string(), "readable name: the trial id and its searched values"),
    "experiment": (pa.string(), "study name"),
    "model": (pa.string(), "timm model name"),
    "family": (pa.string(), "model family (convit, ...)"),
    "state": (pa.string(), "COMPLETE (ran to max_epochs or stopped by patience), PRUNED (stopped by the scheduler or the time limit), REJECTED (broke a constraint, never trained), FAILED"),
    "stop_reason": (pa.string(), "max_epochs, patience, scheduler, time_limit, constraint or error"),
    "error": (pa.string(), "why a FAILED trial failed (one line)"),
    "rejected_by": (pa.string(), "the constraints a REJECTED trial broke, with the measured values"),
    "epochs_run": (pa.int64(), "epochs trained"),
    "epochs_budget": (pa.int64(), "epochs a trial may run (budget.max_epochs): epochs_run < epochs_budget is a cut-short trial"),
    "val_acc": (pa.float64(), "best validation accuracy over the epochs run"),
    "val_loss": (pa.float64(), "lowest validation loss over the epochs run"),
    "final_val_acc": (pa.float64(), "validation accuracy after the last epoch run"),
    "train_precision": (pa.string(), "autocast precision the trial trained in: fp32, bf16 or fp16 (train.precision, auto resolved on its device)"),
    "throughput": (pa.float64(), "inference images/s of the architecture the trial ended with (measured after its first epoch, or before training where constraints judge it; T-CNN: again at the conversion)"),
    "throughput_before_conversion": (pa.float64(), "T-CNN: inference images/s of the CNN before the conversion (null otherwise)"),
    "converted_at_epoch": (pa.int64(), "T-CNN: epochs trained as a CNN before the conversion (null: never converted)"),
    "val_images": (pa.int64(), "validation images val_acc was measured on (what its binomial interval rests on)"),
    "val_acc_low": (pa.float64(), "val_acc's 95% Wilson interval over val_images, lower bound (the validation set's noise, not the seed's)"),
    "val_acc_high": (pa.float64(), "val_acc's 95% Wilson interval, upper bound"),
    "throughput_low": (pa.float64(), "throughput's interval, lower bound: a 95% interval of the median batch cost (distribution-free), at least throughput.noise_floor below the value"),
    "throughput_high": (pa.float64(), "throughput's interval, upper bound (as throughput_low, above the value)"),
    "seed": (pa.int64(), "training seed (the study's algorithm.seed; a replicate's own)"),
    "replicate_of": (pa.string(), "confirmation replicate (budget.confirm): the search trial whose config it trains again with its own seed; null for the search's trials"),
    "seeds": (pa.int64(), "seeds the row's estimate rests on: 1 in trials.parquet; in pareto.parquet, a confirmed config's fresh COMPLETE seeds (its replicates; the selecting search trial is not averaged in, see search.results.replicates)"),
    "val_acc_sd": (pa.float64(), "in pareto.parquet: the seed SD of val_acc pooled across the study's confirmed configs, part of val_acc's interval (null: unknown, no config has two fresh seeds)"),
    "val_acc_sd_df": (pa.int64(), "in pareto.parquet: the degrees of freedom of the pooled val_acc_sd (sum over confirmed configs of their fresh seeds - 1)"),
    "selection_val_acc": (pa.float64(), "in pareto.parquet, a confirmed config: the val_acc of the search trial that selected it, reported apart from the fresh seeds' estimate (winner's curse)"),
    "test_acc": (pa.float64(), "held-out accuracy: the weights of the trial's best validation epoch (the one selection used) scored once on the dataset's test split, at the study's end, for the trials the front rests on (search.study.heldout); in pareto.parquet, a confirmed config: the mean over its fresh seeds; null: not scored"),
    "test_acc_low": (pa.float64(), "test_acc's 95% interval, lower bound: Wilson over test_images (in pareto.parquet, a confirmed config: its seeds' and the test set's noise, as val_acc's)"),
    "test_acc_high": (pa.float64(), "test_acc's 95% interval, upper bound"),
    "test_loss": (pa.float64(), "mean test-split cross-entropy of the weights test_acc scored"),
    "test_images": (pa.int64(), "test images test_acc was measured on"),
    "test_epoch": (pa.int64(), "the epoch whose weights test_acc scored (the trial's best validation epoch)"),
    "test_corrupted": (pa.map_(pa.string(), pa.float64()), "where the spec asks (dataset.corruptions): the same weights' accuracy on corrupted copies of the test split, KIND.SEVERITY (trainers.corruptions: gaussian_noise, gaussian_blur, contrast at severities 1-3) -> accuracy; null: not asked, or a confirmed config's (one per seed)"),
    "tied_with": (pa.string(), "on the Pareto front: the other front members whose intervals overlap this one's on every objective (comma-separated trial ids; null: separated from all, or not on the front)"),
    "dominated_by": (pa.string(), "a Pareto-optimal config that left the front because members that stay on it dominate it within noise: at least level within noise on every objective and better beyond noise on one (comma-separated trial ids; null: on the front, or dominated outright); see search.results.intervals"),
    "throughput_timed": (pa.float64(), "inference images/s as the architecture's own fastest round read (CPU: throughput is the reference's number over the cost ratio timed beside it)"),
    "throughput_reference": (pa.string(), "architecture fingerprint of the reference the CPU measurement was timed beside (the model as named, default arguments); null on GPUs"),
    "throughput_device": (pa.string(), "device that measured throughput"),
    "throughput_runtime": (pa.string(), "what the timed forward ran on (throughput.runtime): eager (torch's stock ops) or kernels (this project's fused paths)"),
    "throughput_batch": (pa.int64(), "batch size of the throughput measurement"),
    "throughput_precision": (pa.string(), "fp32, bf16 or fp16"),
    "throughput_threads": (pa.int64(), "torch CPU threads during the measurement"),
    "throughput_cuda_graph": (pa.bool_(), "GPU: the forward was timed as replays of one captured CUDA graph (throughput.cuda_graph; false: eagerly, the setting off or the model not capturable); null on the CPU"),
    "throughput_cached": (pa.bool_(), "the measurement came from the per-architecture cache (an earlier trial measured this architecture, as its model or as the reference it was timed beside)"),
    "architecture": (pa.string(), "fingerprint of the measured architecture (same value: same network, whatever the training knobs)"),
    "torch_version": (pa.string(), "torch version of the trial"),
    "params": (pa.int64(), "trainable + frozen parameters"),
    "flops": (pa.int64(), "forward FLOPs per image (multiply-add = 2), as the model computes them at inference (e.g. the Refiner's path, see `choose_path`; the CPU kernels' products counted as on torch ops)"),
    "spec_hash": (pa.string(), "hash of the search spec (without storage and trial count)"),
    "git_commit": (pa.string(), "commit of this project that ran the study"),
    "node_ip": (pa.string(), "IP address of the Ray node that ran the trial (its last attempt)"),
    "hostname": (pa.string(), "host name of that node"),
    "node_id": (pa.string(), "Ray node id of that node (unique even for nodes sharing an IP)"),
    "failures": (pa.int64(), "attempts that failed (e.g. their node died) and were retried from the last checkpoint"),
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
    "best_epoch": (pa.int64(), "the epoch of best_val_acc (the first to reach it): the weights a held-out test scores"),
    "lr": (pa.float64(), "learning rate at the epoch's last step"),
    "epoch_time_s": (pa.float64(), "wall time of the epoch (train + validate)"),
    "train_images_per_s": (pa.float64(), "training images/s of the epoch"),
    "train_loader_wait_s": (pa.float64(), "of the epoch's training, the seconds spent waiting for the loader's batches "
                                          "(a large share: the trial is input-bound; more train.num_workers or resources.cpus)"),
    "converted": (pa.bool_(), "T-CNN: the epoch trained the converted model (the first true row is the conversion epoch)"),
    "mechanisms": (pa.map_(pa.string(), pa.float64()), "what the model reports of its own mechanism after the epoch "
                   "(trainers.hooks.ReportsMechanisms): ConViT's gates sigma(lambda) as gate.BLOCK.HEAD and each head's "
                   "nonlocality (the paper's Eq. 8, on the first 256 validation images) as nonlocality.BLOCK.HEAD, "
                   "GMM's kernel widths abs(sigma) as sigma.BLOCK.HEAD.KERNEL; null for other models"),
    "node_id": (pa.string(), "Ray node that trained the epoch (null: taken from a restored checkpoint's history)"),
    "reported_at": (pa.timestamp("us", tz="UTC"), "when the epoch was reported (null: as node_id)"),
}

PROGRESS_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "finished": (pa.int64(), "trials finished so far, this one included"),
    "trial_id": (pa.string(), "the trial that just finished"),
    "state": (pa.string(), "its state"),
    "epochs_spent": (pa.int64(), "epochs trained by all finished trials"),
    "elapsed_s": (pa.float64(), "seconds since the study started"),
    "front_size": (pa.int64(), "COMPLETE trials on the Pareto front (one front per throughput device: all of them)"),
    "hypervolume": (pa.float64(), "hypervolume of the front (reference point: the spec's; null when a minimised objective has none); "
                    "with several throughput devices, of the front of the one with the most COMPLETE trials"),
    "hypervolume_device": (pa.string(), "the device whose front the hypervolume measures"),
    "best_val_acc": (pa.float64(), "best val_acc of the COMPLETE trials"),
    "at": (pa.timestamp("us", tz="UTC"), "when the trial finished"),
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


def _upsert(rows: dict, key: Any, row: dict[str, Any]) -> None:
    """Put ``row`` under ``key`` as the newest entry (a replaced row moves to the end)."""
    rows.pop(key, None)
    rows[key] = row


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so readers never see a partial file."""
    atomic_write(path, lambda handle: pq.write_table(table, handle))


def write_json_atomic(data: Any, path: Path) -> None:
    atomic_write(path, lambda handle: handle.write(json.dumps(data, indent=2, sort_keys=True, default=str).encode()))


def read_table(path: str | os.PathLike) -> pa.Table:
    """One version of a store file, even while the search rewrites it (see the module doc).
    ConfigError where it is there but not a Parquet file pyarrow can read (a damaged study)."""
    try:
        with pa.OSFile(os.fspath(path)) as handle:  # one open; its size is the opened file's
            return pq.read_table(handle)
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{path}: not a readable Parquet file ({reason}); the study's files are damaged: "
                          "restore this one from a copy, or run the spec again under another name") from None


class ResultsStore:
    """Collects trial and epoch rows on the driver and rewrites the Parquet files atomically.

    Tune calls its callbacks from the driver's one event loop, so there is no locking here."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        space: Mapping[str, Mapping[str, Any]],
        objectives: Sequence[tuple[str, str]],
        reference: Sequence[float] | None = None,
        location: "StudyLocation | None" = None,
    ) -> None:
        self.directory = Path(directory)
        # the study's place: unpickled by a resume as where the study is now (search.results.location);
        # with a URI every flush uploads the files there
        self.location = location
        self.objectives = list(objectives)
        self.reference = None if reference is None else [float(v) for v in reference]
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
        self.progress_schema = pa.schema([(name, typ) for name, (typ, _) in PROGRESS_COLUMNS.items()])
        # Rows by key, in the order they were (last) added: an upsert is O(1), not a list scan.
        self._trials: dict[Any, dict[str, Any]] = {}  # trial_id -> row
        self._epochs: dict[Any, dict[str, Any]] = {}  # (trial_id, epoch) -> row
        self._progress: dict[Any, dict[str, Any]] = {}  # trial_id -> row
        self._front_rows: list[dict[str, Any]] | None = None  # the front of _trials (None: not computed since they changed)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled by a resumed Tune run: the study's folder now (moved since, or on another
        # machine: its own staging folder for a URI).
        self.__dict__.update(state)
        self._front_rows = None
        location = state.get("location")
        if location is not None:
            self.directory = location.local

    # -- rows ---------------------------------------------------------------------------
    # A resumed study can hear about a trial or an epoch a second time (the driver died after
    # writing a row but before Tune's snapshot recorded it); the later row replaces the earlier,
    # unless ``replace`` is false (an epoch told again from a checkpoint's history).
    def add_epoch(self, row: Mapping[str, Any], *, replace: bool = True) -> None:
        out = {name: row.get(name) for name in EPOCH_COLUMNS}
        key = (out["trial_id"], out["epoch"])
        if replace or key not in self._epochs:
            _upsert(self._epochs, key, out)

    def add_trial(self, row: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        out = {name: row.get(name) for name in TRIAL_COLUMNS}
        for key, typ in self._config_types.items():
            value = config.get(key)
            out[key] = None if value is None else (str(value) if typ == pa.string() else value)
        _upsert(self._trials, out["trial_id"], out)
        self._front_rows = None

    def add_test(self, trial_id: str, score: Mapping[str, Any]) -> None:
        """The held-out score of ``trial_id`` (search.study.heldout): ``test_acc``, ``test_loss``,
        ``test_images``, ``test_epoch`` (and ``test_corrupted`` where asked), with test_acc's Wilson
        interval."""
        row = self._trials[trial_id]
        row.update({k: score.get(k) for k in ("test_acc", "test_loss", "test_images", "test_epoch", "test_corrupted")})
        row["test_acc_low"], row["test_acc_high"] = wilson_interval(row["test_acc"], row["test_images"])
        self._front_rows = None

    def load_existing(self) -> None:
        """Take up the rows already in the folder's files (a resumed study)."""
        for name, schema, rows, key in (
                ("trials.parquet", self.trial_schema, self._trials, lambda r: r["trial_id"]),
                ("epochs.parquet", self.epoch_schema, self._epochs, lambda r: (r["trial_id"], r["epoch"])),
                ("progress.parquet", self.progress_schema, self._progress, lambda r: r["trial_id"])):
            path = self.directory / name
            if path.is_file():
                table = read_table(path)
                rows.clear()
                for row in table.to_pylist():
                    out = {c: row.get(c) for c in schema.names}
                    _upsert(rows, key(out), out)
        self._front_rows = None

    def forget_trials(self, keep: set[str], *, replicates: bool = False) -> list[str]:
        """Drop the rows of trials not in ``keep``; their ids. (After a resume: trials that
        finished after Tune's last snapshot, so Tune will sample their slots again.) Only rows of
        one stage are looked at: the search's trials, or the confirmation ``replicates``."""
        stage = {k for k, t in self._trials.items() if (t.get(REPLICATE_COLUMN) is not None) == replicates}
        gone = sorted(stage - keep)
        if gone:
            drop = set(gone)
            self._trials = {k: t for k, t in self._trials.items() if t["trial_id"] not in drop}
            self._epochs = {k: e for k, e in self._epochs.items() if e["trial_id"] not in drop}
            self._progress = {k: p for k, p in self._progress.items() if p["trial_id"] not in drop}
            self._front_rows = None
        return gone

    def add_progress(self, *, trial_id: str, state: str, elapsed_s: float, at: Any) -> dict[str, Any]:
        """The study's standing after ``trial_id`` finished (call after its add_trial). A trial
        recorded again as it ended before (a resumed study's Tune re-reports a trial the killed
        driver had recorded) keeps the row of when it first finished."""
        recorded = self._progress.get(trial_id)
        if recorded is not None and recorded["state"] == state:
            return recorded
        front = self._members()
        complete = [t["val_acc"] for t in self._trials.values() if t["state"] == "COMPLETE" and t.get("val_acc") is not None]
        # Fronts of different devices are not comparable: the hypervolume is the main device's.
        counts: dict[Any, int] = {}
        for t in self._trials.values():
            if t["state"] == "COMPLETE":
                counts[t.get(DEVICE_COLUMN)] = counts.get(t.get(DEVICE_COLUMN), 0) + 1
        device = max(counts, key=counts.get) if counts else None
        volume = None
        if self.reference is not None:
            points = [[t[c] for c, _ in self.objectives] for t in front if len(counts) < 2 or t.get(DEVICE_COLUMN) == device]
            volume = hypervolume(points, modes=[m for _, m in self.objectives], reference=self.reference) if points else 0.0
        row = {
            "finished": len(self._trials),
            "trial_id": trial_id,
            "state": state,
            "epochs_spent": sum(int(t.get("epochs_run") or 0) for t in self._trials.values()),
            "elapsed_s": elapsed_s,
            "front_size": len(front),
            "hypervolume": volume,
            "hypervolume_device": device,
            "best_val_acc": max(complete) if complete else None,
            "at": at,
        }
        _upsert(self._progress, trial_id, row)
        return row

    @property
    def trials(self) -> list[dict[str, Any]]:
        return list(self._trials.values())

    @property
    def progress(self) -> list[dict[str, Any]]:
        return list(self._progress.values())

    @property
    def elapsed_s(self) -> float:
        """Seconds the study had run when its last trial was recorded (0 before any was): where a
        resumed study's clock, and its time limit, count on from."""
        return max((p["elapsed_s"] for p in self._progress.values() if p.get("elapsed_s") is not None), default=0.0)

    # -- files --------------------------------------------------------------------------
    def trials_table(self) -> pa.Table:
        marks = {t["trial_id"]: (t["tied_with"], t["dominated_by"]) for t in self._front()}
        return pa.Table.from_pylist([{**t, **dict(zip(("tied_with", "dominated_by"), marks.get(t["trial_id"], (None, None))))}
                                     for t in self.trials], schema=self.trial_schema)

    def pareto_table(self) -> pa.Table:
        """The front's members (no other COMPLETE config dominates them, nor another member within
        noise), best first, with their ties."""
        return pa.Table.from_pylist(self._members(), schema=self.trial_schema)

    def _front(self) -> list[dict[str, Any]]:
        """The front of the trials so far (search.results.front), computed once after they change:
        a flush writes it to pareto.parquet, its ties to trials.parquet, and add_progress counts it."""
        if self._front_rows is None:
            trials = pa.Table.from_pylist(self.trials, schema=self.trial_schema).to_pandas()
            front = compute_front(trials, self.objectives, dominated=True) if len(trials) else trials
            self._front_rows = pa.Table.from_pandas(front, schema=self.trial_schema, preserve_index=False).to_pylist()
        return self._front_rows

    def _members(self) -> list[dict[str, Any]]:
        return [t for t in self._front() if t.get("dominated_by") is None]

    def flush(self) -> None:
        try:
            write_atomic(pa.Table.from_pylist(list(self._epochs.values()), schema=self.epoch_schema), self.directory / "epochs.parquet")
            write_atomic(self.trials_table(), self.directory / "trials.parquet")
            write_atomic(self.pareto_table(), self.directory / "pareto.parquet")
            write_atomic(pa.Table.from_pylist(list(self._progress.values()), schema=self.progress_schema), self.directory / "progress.parquet")
        except DiskFullError as exc:  # the files written before stay whole; the study goes on from them
            raise DiskFullError(f"{exc.path}: the disk is full; the study's files are as the last write left them: "
                                f"free space on {self.directory}'s file system, then python -m search resume "
                                f"{self.location or self.directory}", path=exc.path) from None
        if self.location is not None:
            try:
                self.location.push()  # the Parquet files and the Optuna journal beside them
            except OSError as exc:  # e.g. the network: the staged files are whole; the next flush retries
                print(f"warning: {self.location.unreachable(exc)}; the files are kept in {self.directory} and "
                      "uploaded at the next write", file=sys.stderr, flush=True)
