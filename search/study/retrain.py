"""``python -m search train best.yaml``: retrain an exported trial (no Ray), test it once.

    exported config --prepare_dataset--> FFCV files (cached, as for the search)
                    --train_trial-------> the weights after the last epoch
                    --evaluate----------> loss and accuracy on the test split, once
    <out>/model.pt        the model's state_dict (torch.load(weights_only=True) reads it)
    <out>/result.parquet  one row: RESULT_COLUMNS, then the model arguments and training settings

The test split is read here and nowhere in the search. The weights tested (and saved) are those
after the last epoch trained, not those of the best validation epoch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa

from search.results.location import default_cache_dir
from search.results.store import TRIAL_COLUMNS, write_atomic
from search.spec import ModelSpec, check_model
from search.spec.validation import SpecLocation
from search.study.export import ExportedTrial, load_export
from trainers import atomic_write, folder_problem, git_commit
from trainers.config import TrialConfig
from trainers.data import prepare_dataset
from trainers.errors import ConfigError

__all__ = ["retrain", "RetrainResult", "RESULT_COLUMNS", "default_out_dir"]

# column -> (arrow type, meaning); columns shared with the trial store take its definitions.
# docs/store.md's "`train`'s `result.parquet`" table is this list.
RESULT_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "model": (pa.string(), "timm model name"),
    "family": (pa.string(), "model family (convit, ...)"),
    "params": TRIAL_COLUMNS["params"],
    "flops": TRIAL_COLUMNS["flops"],
    "throughput": (pa.float64(), "inference images/s (measured as in the search)"),
    "throughput_device": TRIAL_COLUMNS["throughput_device"],
    "throughput_batch": TRIAL_COLUMNS["throughput_batch"],
    "throughput_precision": TRIAL_COLUMNS["throughput_precision"],
    "throughput_threads": TRIAL_COLUMNS["throughput_threads"],
    "throughput_cuda_graph": TRIAL_COLUMNS["throughput_cuda_graph"],
    "val_acc": (pa.float64(), "best validation accuracy over the epochs run"),
    "val_loss": (pa.float64(), "lowest validation loss over the epochs run"),
    "final_val_acc": (pa.float64(), "validation accuracy after the last epoch (the weights saved and tested)"),
    "train_precision": TRIAL_COLUMNS["train_precision"],
    "test_acc": (pa.float64(), "test-split accuracy of the saved weights"),
    "test_loss": (pa.float64(), "test-split mean cross-entropy of the saved weights"),
    "test_images": (pa.int64(), "images in the test split"),
    "epochs": (pa.int64(), "epochs asked for (the config's, or --epochs)"),
    "epochs_run": (pa.int64(), "epochs trained"),
    "stop_reason": (pa.string(), "max_epochs or patience"),
    "seed": (pa.int64(), "training seed"),
    "dataset": (pa.string(), "catalog name of the dataset"),
    "dataset_content_hash": (pa.string(), "content hash of the prepared dataset"),
    "num_classes": (pa.int64(), "classes (a constructor argument taken from the dataset)"),
    "in_chans": (pa.int64(), "image channels (a constructor argument taken from the dataset)"),
    "img_size": (pa.int64(), "image side in pixels (passed to models that take img_size)"),
    "model_args": (pa.string(), "the config's constructor arguments, as JSON"),
    "device": (pa.string(), "device that trained and tested"),
    "source_study": (pa.string(), "study the config was exported from"),
    "source_trial_id": (pa.string(), "trial of that study"),
    "source_val_acc": (pa.float64(), "that trial's val_acc in the study"),
    "config_file": (pa.string(), "the exported config trained"),
    "git_commit": (pa.string(), "commit of this project that trained"),
    "started_at": (pa.timestamp("us", tz="UTC"), "start of training"),
    "ended_at": (pa.timestamp("us", tz="UTC"), "end of the test"),
    "duration_s": (pa.float64(), "wall time: dataset, training and test"),
}


@dataclasses.dataclass(frozen=True)
class RetrainResult:
    out: Path  # the folder holding model.pt and result.parquet
    row: dict[str, Any]  # result.parquet's one row


def default_out_dir(config: str | os.PathLike) -> Path:
    """``runs/best.yaml`` -> ``runs/best-train/``."""
    config = Path(config)
    return config.with_name(f"{config.stem}-train")


def _check_out_dir(out: Path, *, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; pass a folder")
    problem = folder_problem(out)
    if problem:
        raise ConfigError(f"--out {out}: {problem}; pass a folder you can write to")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out}: not empty; pass another --out, or --force to overwrite model.pt and result.parquet there")


_ARROW_OF = {int: pa.int64(), float: pa.float64(), bool: pa.bool_(), str: pa.string()}


def _config_columns(config: ExportedTrial) -> dict[str, pa.Array]:
    """Training settings (typed by their fields) and model arguments (typed by their values) as
    columns named as in the space, as in trials.parquet; a name that is also a result column
    stays only in ``model_args``."""
    hints = typing.get_type_hints(type(config.train))
    columns: dict[str, pa.Array] = {}
    for name, value in dataclasses.asdict(config.train).items():
        kinds = [t for t in typing.get_args(hints[name]) or (hints[name],) if t is not type(None)]
        columns[name] = pa.array([value], type=_ARROW_OF.get(kinds[0]) if len(kinds) == 1 else None)
    for name, value in config.model.args.items():
        columns[name] = pa.array([value])
    return {k: v for k, v in columns.items() if k not in RESULT_COLUMNS}


def retrain(
    config_path: str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    epochs: int | None = None,
    data_dir: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
    log: TextIO | None = None,
) -> RetrainResult:
    """Train the exported config at ``config_path`` from scratch, test it once, write the results
    (see the module doc). ``epochs`` and ``data_dir`` override the config's; progress goes to
    ``log`` (default: stdout)."""
    log = log or sys.stdout
    config_path = Path(config_path)
    config = load_export(config_path)
    if epochs is not None and epochs < 1:
        raise ConfigError(f"--epochs {epochs}: must be at least 1")
    out = Path(out) if out is not None else default_out_dir(config_path)
    _check_out_dir(out, force=force)
    check_model(ModelSpec(name=config.model.name, args=dict(config.model.args)), {}, SpecLocation(str(config_path)), "model")

    # torch, timm and FFCV only once the config is known to be good (and not for `import search`)
    import torch

    from trainers import pick_device, score_held_out, train_trial

    started = dt.datetime.now(dt.timezone.utc)
    clock = time.perf_counter()
    data = prepare_dataset(config.dataset.request(data_dir=data_dir), cache_dir=cache_dir or default_cache_dir())
    expected_hash = config.source.get("dataset_content_hash")
    if expected_hash and expected_hash != data.content_hash:
        print(f"warning: the dataset's content differs from the study's (hash {data.content_hash[:16]}, "
              f"study {str(expected_hash)[:16]}); results are not comparable with the study's", file=log, flush=True)
    cfg = TrialConfig(
        model=config.model.name,
        model_args=dict(config.model.args),
        data=data,
        epochs=epochs or config.epochs,
        train=config.train,
        throughput=config.throughput,
        patience=config.patience,
        seed=config.seed,
        # The search's per-architecture measurements: the same architecture on the same device
        # reuses the study's throughput instead of measuring it again.
        throughput_cache_dir=str(Path(cache_dir or default_cache_dir()) / "throughput"),
    )
    print(f"training {cfg.model} on {data.name} ({data.counts['train']} train / {data.counts['val']} val / "
          f"{data.counts['test']} test images) for up to {cfg.epochs} epochs", file=log, flush=True)

    final: dict[str, Any] = {}

    def on_epoch(metrics: dict[str, Any], get_state) -> None:
        print(f"  epoch {metrics['epoch']}/{cfg.epochs}  train_loss {metrics['train_loss']:.4f}  "
              f"val_acc {metrics['val_acc']:.4f}  ({metrics['epoch_time_s']:.1f} s)", file=log, flush=True)
        if "stop_reason" in metrics:  # the last epoch: keep these weights (on the CPU, copied)
            state = get_state()
            final["model"] = {k: v.detach().to("cpu", copy=True) for k, v in state["model"].items()}
            final["reparametrised"] = state["reparametrised"]

    outcome = train_trial(cfg, on_epoch=on_epoch)
    last = outcome.history[-1]

    # -- the one test: the saved weights, as validation scored them (trainers.heldout) -----------
    score = score_held_out(cfg, final["model"], reparametrised=final["reparametrised"], epoch=len(outcome.history))
    test_loss, test_acc = score.test_loss, score.test_acc
    ended = dt.datetime.now(dt.timezone.utc)

    measurement = outcome.measurement
    # What build_model passed for these (the config's arguments win over the dataset's values).
    dataset_args = {"num_classes": data.num_classes, "in_chans": data.channels, "img_size": data.image_size}
    constructor = {k: cfg.model_args.get(k, v) for k, v in dataset_args.items()}
    row: dict[str, Any] = {
        **{k: measurement.get(k) for k in ("family", "params", "flops", "throughput", "throughput_device",
                                            "throughput_batch", "throughput_precision", "throughput_threads",
                                            "throughput_cuda_graph")},
        "model": cfg.model,
        "val_acc": outcome.best_val_acc,
        "val_loss": last["best_val_loss"],
        "final_val_acc": last["val_acc"],
        "train_precision": last.get("train_precision"),  # absent from checkpoints of older versions
        "test_acc": test_acc,
        "test_loss": test_loss,
        "test_images": data.counts["test"],
        "epochs": cfg.epochs,
        "epochs_run": outcome.epochs_run,
        "stop_reason": outcome.stop_reason,
        "seed": cfg.seed,
        "dataset": data.name,
        "dataset_content_hash": data.content_hash,
        **constructor,
        "model_args": json.dumps(cfg.model_args, sort_keys=True),
        "device": str(pick_device(cfg.device)),
        "source_study": config.source.get("study"),
        "source_trial_id": config.source.get("trial_id"),
        "source_val_acc": config.source.get("val_acc"),
        "config_file": str(config_path.resolve()),
        "git_commit": git_commit(),
        "started_at": started,
        "ended_at": ended,
        "duration_s": time.perf_counter() - clock,
    }
    schema = pa.schema([(name, typ) for name, (typ, _) in RESULT_COLUMNS.items()])
    table = pa.Table.from_pylist([{k: row[k] for k in RESULT_COLUMNS}], schema=schema)
    for name, column in _config_columns(config).items():
        table = table.append_column(name, column)

    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.pt", lambda handle: torch.save(final["model"], handle))
    write_atomic(table, out / "result.parquet")
    row.update({name: column[0].as_py() for name, column in _config_columns(config).items()})

    source = f" (the study's trial {row['source_trial_id']}: val_acc {row['source_val_acc']:.4f})" if row["source_val_acc"] is not None else ""
    print(
        f"\n{cfg.model}: {outcome.epochs_run} epochs ({outcome.stop_reason}) in {row['duration_s']:.0f} s\n"
        f"  test_acc {test_acc:.4f}  test_loss {test_loss:.4f}  ({data.counts['test']} test images)\n"
        f"  val_acc {outcome.best_val_acc:.4f} best, {last['val_acc']:.4f} last{source}\n"
        f"  params {row['params'] / 1e6:.2f}M  flops {row['flops'] / 1e6:.1f}M  "
        f"throughput {row['throughput']:,.0f} img/s ({row['throughput_device']})\n"
        f"wrote {out / 'model.pt'}, {out / 'result.parquet'}",
        file=log, flush=True,
    )
    return RetrainResult(out=out, row=row)
