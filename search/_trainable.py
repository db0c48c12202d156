"""The one place a trial meets Ray: turn a Tune config into a TrialConfig, report each epoch.

Everything else a trial does lives in ``trainers`` and runs without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import torch

from trainers.config import TRAIN_KEYS, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import PreparedDataset
from trainers.train import train_trial

__all__ = ["TrialTemplate", "trial_config", "run_tune_trial"]

STATE_FILE = "trial_state.pt"


@dataclasses.dataclass(frozen=True)
class TrialTemplate:
    """What every trial of a study shares; the searched values fill in the rest."""

    model: str
    model_args: dict[str, Any]
    data: PreparedDataset
    epochs: int
    train: TrainSettings
    throughput: ThroughputSettings
    patience: int | None
    seed: int


def trial_config(template: TrialTemplate, sampled: dict[str, Any]) -> TrialConfig:
    """Searched training settings replace the template's; the rest are model arguments."""
    train_values = {k: v for k, v in sampled.items() if k in TRAIN_KEYS}
    model_values = {k: v for k, v in sampled.items() if k not in TRAIN_KEYS}
    return TrialConfig(
        model=template.model,
        model_args={**template.model_args, **model_values},
        data=template.data,
        epochs=template.epochs,
        train=dataclasses.replace(template.train, **train_values),
        throughput=template.throughput,
        patience=template.patience,
        seed=template.seed,
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
        with tempfile.TemporaryDirectory() as directory:
            torch.save(get_state(), os.path.join(directory, STATE_FILE))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    train_trial(cfg, on_epoch=report, resume=resume)
