"""What one trial runs: model families, FFCV data pipelines, the training loop, throughput.

The names below are the public API that ``search`` and ``benchmarks`` use; the modules behind
them whose names start with an underscore (``trainers._x``) are private. Names resolve on first use (PEP 562), so ``import trainers`` stays light: torch is
imported only when a name that needs it (the training loop, the model placement) is first used,
and ``python -m search pareto`` never imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    # the settings of a trial (trainers.config, trainers.errors)
    "TrialConfig",
    "TrainSettings",
    "ThroughputSettings",
    "Constraint",
    "TRAIN_KEYS",
    "SettingError",
    "ConfigError",
    # the data (trainers.data)
    "DatasetRequest",
    "PreparedDataset",
    "prepare_dataset",
    "load_catalog",
    "make_loader",
    # the training loop (trainers.train, trainers.precision)
    "train_trial",
    "build_model",
    "evaluate",
    "pick_device",
    "autocast_for",
    "eval_loader",  # a trial's evaluation loader: its validation split, or its test split (search train)
    # the held-out test (trainers.heldout)
    "score_held_out",  # a model's weights scored once on the test split
    "selection_in",  # the selected (best validation epoch's) weights in a trial's checkpoint
    "HeldOutScore",
    # the pieces of train_trial that benchmarks time on their own
    "trial_loaders",  # the trial's training and validation loaders
    "training_step",  # the trial's training step (lr, forward, loss, backward, AdamW), eager or graphed
    # the model on its device (trainers._memory_format, trainers._cuda_graph)
    "place_model",
    "runs_channels_last",  # whether a model and its images run channels_last on a device
    "capture_inference",  # a model's inference forward captured as one CUDA graph
    "GraphedInference",  # what capture_inference returns: call it on a batch to replay the graph
    "CaptureError",  # a forward that cannot be captured (run it eagerly)
    # files, the checkout, the process, the CPU
    "atomic_write",
    "check_output_file",
    "folder_problem",
    "PROJECT_ROOT",
    "git_commit",
    "tracked_files_modified",  # whether tracked files differ from the commit (benchmark results say so)
    "retain_freed_memory",  # keep freed heap memory in the process (glibc), as a trial does
    "freed_memory_retained",  # whether retain_freed_memory is in effect in this process
    "cpu_has_native_bf16",
    "cpu_family",  # the x86 CPU family (/proc/cpuinfo's "cpu family"), or None
    "cpuinfo_field",  # a /proc/cpuinfo field's value (e.g. "model name"), or None
    "prebuild_cpu_kernels",
]

# name -> the module that defines it, imported on first use
_HOME = {
    "TrialConfig": "trainers.config",
    "TrainSettings": "trainers.config",
    "ThroughputSettings": "trainers.config",
    "Constraint": "trainers.config",
    "TRAIN_KEYS": "trainers.config",
    "SettingError": "trainers.config",
    "ConfigError": "trainers.errors",
    "DatasetRequest": "trainers.data",
    "PreparedDataset": "trainers.data",
    "prepare_dataset": "trainers.data",
    "load_catalog": "trainers.data",
    "make_loader": "trainers.data",
    "train_trial": "trainers.train",
    "build_model": "trainers.train",
    "evaluate": "trainers.train",
    "pick_device": "trainers.train",
    "autocast_for": "trainers.precision",
    "eval_loader": "trainers.train",
    "trial_loaders": "trainers.train",
    "training_step": "trainers.train",
    "score_held_out": "trainers.heldout",
    "selection_in": "trainers.heldout",
    "HeldOutScore": "trainers.heldout",
    "place_model": "trainers._memory_format",
    "runs_channels_last": "trainers._memory_format",
    "capture_inference": "trainers._cuda_graph",
    "GraphedInference": "trainers._cuda_graph",
    "CaptureError": "trainers._cuda_graph",
    "atomic_write": "trainers._atomic",
    "check_output_file": "trainers._atomic",
    "folder_problem": "trainers._atomic",
    "PROJECT_ROOT": "trainers._source",
    "git_commit": "trainers._source",
    "tracked_files_modified": "trainers._source",
    "retain_freed_memory": "trainers._malloc",
    "freed_memory_retained": "trainers._malloc",
    "prebuild_cpu_kernels": "trainers.kernels",
    "cpu_has_native_bf16": "trainers._cpu",
    "cpu_family": "trainers._cpu",
    "cpuinfo_field": "trainers._cpu",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    # not cached here: a name always reads its home module's current value (what tests patch)
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ resolves these
    from trainers._atomic import atomic_write, check_output_file, folder_problem
    from trainers._cpu import cpu_family, cpu_has_native_bf16, cpuinfo_field
    from trainers._cuda_graph import CaptureError, GraphedInference, capture_inference
    from trainers._malloc import freed_memory_retained, retain_freed_memory
    from trainers._memory_format import place_model, runs_channels_last
    from trainers._source import PROJECT_ROOT, git_commit, tracked_files_modified
    from trainers.config import TRAIN_KEYS, Constraint, SettingError, ThroughputSettings, TrainSettings, TrialConfig
    from trainers.data import DatasetRequest, PreparedDataset, load_catalog, make_loader, prepare_dataset
    from trainers.errors import ConfigError
    from trainers.heldout import HeldOutScore, selection_in, score_held_out
    from trainers.kernels import prebuild_cpu_kernels
    from trainers.precision import autocast_for
    from trainers.train import build_model, eval_loader, evaluate, pick_device, train_trial, trial_loaders, training_step
