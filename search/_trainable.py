"""The one place a trial meets Ray: turn a Tune config into a TrialConfig, report each epoch.

Everything else a trial does lives in ``trainers`` and runs without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import torch

from trainers.config import TRAIN_KEYS, Constraint, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import PreparedDataset
from trainers.train import train_trial

__all__ = ["TrialTemplate", "trial_config", "run_tune_trial"]

STATE_FILE = "trial_state.pt"


@dataclasses.dataclass(frozen=True)
class TrialTemplate:
    """What every trial of a study shares; the searched values fill in the rest."""

    models: dict[str, dict[str, Any]]  # timm model name -> fixed constructor arguments
    data: PreparedDataset
    epochs: int
    train: TrainSettings
    throughput: ThroughputSettings
    patience: int | None
    seed: int
    constraints: tuple[Constraint, ...] = ()
    throughput_cache_dir: str | None = None


def trial_config(template: TrialTemplate, sampled: dict[str, Any]) -> TrialConfig:
    """``model`` (searched when there are several) picks the model; searched training settings
    replace the template's; the rest are arguments of that model's constructor."""
    sampled = dict(sampled)
    model = sampled.pop("model", None) or next(iter(template.models))
    train_values = {k: v for k, v in sampled.items() if k in TRAIN_KEYS}
    model_values = {k: v for k, v in sampled.items() if k not in TRAIN_KEYS}
    return TrialConfig(
        model=model,
        model_args={**template.models[model], **model_values},
        data=template.data,
        epochs=template.epochs,
        train=dataclasses.replace(template.train, **train_values),
        throughput=template.throughput,
        patience=template.patience,
        seed=template.seed,
        constraints=template.constraints,
        throughput_cache_dir=template.throughput_cache_dir,
    )


def run_tune_trial(config: dict[str, Any], template: TrialTemplate) -> None:
    """Ray Tune function trainable: one ``tune.report`` (with a checkpoint) per epoch."""
    from ray import tune

    cfg = trial_config(template, config)
    resume = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            resume = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)

    def report(metrics: dict[str, Any], get_state) -> None:
        if get_state is None:  # rejected before training: nothing to checkpoint
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory() as directory:
            torch.save(get_state(), os.path.join(directory, STATE_FILE))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    train_trial(cfg, on_epoch=report, resume=resume)
