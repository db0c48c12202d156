"""The one place a trial meets Ray: turn a Tune config into a TrialConfig, report each epoch.

Everything else a trial does lives in ``trainers`` and runs without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import torch

from search.results.location import default_cache_dir
from trainers import train_trial
from trainers.config import TRAIN_KEYS, Constraint, ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, PreparedDataset, prepare_dataset
from trainers.errors import ConfigError

__all__ = ["TrialTemplate", "trial_config", "run_tune_trial", "STATE_FILE", "EARLIER_EPOCHS", "SEED_KEY", "REPLICATE_KEY"]

STATE_FILE = "trial_state.pt"
EARLIER_EPOCHS = "epochs_before_restore"  # result key: the metrics of the epochs a restored trial had run
# Config keys of a confirmation replicate (search.study.confirm): its training seed, and the search
# trial whose config it trains again. Not knobs: they go to the trial's row, not to the model.
SEED_KEY = "seed"
REPLICATE_KEY = "replicate_of"


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
    # Set for trials that may run on another node: each node prepares ``dataset`` itself (once,
    # under a lock) in ``cache_dir``, or in its own default cache when that is None, and checks
    # that it got the driver's content (``data.content_hash``).
    dataset: DatasetRequest | None = None
    cache_dir: str | None = None
    # dataset.split_seed: trial: the driver's dataset as each training seed draws it ({seed: data});
    # a trial trains on its own seed's. None: ``data`` for every trial.
    seed_data: dict[int, PreparedDataset] | None = None


_prepared_here: dict[tuple[DatasetRequest, str], PreparedDataset] = {}  # per process: reused actors skip the hash


def on_this_node(template: TrialTemplate, seed: int | None = None) -> TrialTemplate:
    """``template`` with the dataset and the throughput cache of the node this trial runs on (with
    ``seed_data``: the dataset as the trial's ``seed`` draws it)."""
    if template.dataset is None:
        return template
    request, expected = template.dataset, template.data
    if template.seed_data is not None:
        seed = template.seed if seed is None else seed
        # a seed the driver did not plan has nothing of the driver's to compare with
        request, expected = dataclasses.replace(request, seed=seed), template.seed_data.get(seed)
    cache_dir = str(template.cache_dir or default_cache_dir())
    key = (request, cache_dir)
    data = _prepared_here.get(key)
    if data is None or not all(os.path.isfile(p) for p in (data.train_path, data.val_path)):
        data = prepare_dataset(request, cache_dir=cache_dir)
        _prepared_here[key] = data
    if expected is not None and data.content_hash != expected.content_hash:
        raise ConfigError(
            f"dataset {data.name} on this node ({os.uname().nodename}, from {template.dataset.data_dir or 'the catalog path'}) "
            f"differs from the driver's (content {data.content_hash[:12]} vs {expected.content_hash[:12]}); "
            "put the same files at the same path on every node"
        )
    throughput_dir = template.throughput_cache_dir or os.path.join(cache_dir, "throughput")
    return dataclasses.replace(template, data=data, throughput_cache_dir=throughput_dir)


def trial_config(template: TrialTemplate, sampled: dict[str, Any]) -> TrialConfig:
    """``model`` (searched when there are several) picks the model; searched training settings
    replace the template's; ``seed`` (a replicate's) replaces the study's; the rest are arguments
    of that model's constructor."""
    sampled = dict(sampled)
    model = sampled.pop("model", None) or next(iter(template.models))
    seed = int(sampled.pop(SEED_KEY, template.seed))
    sampled.pop(REPLICATE_KEY, None)
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
        seed=seed,
        constraints=template.constraints,
        throughput_cache_dir=template.throughput_cache_dir,
    )


def run_tune_trial(config: dict[str, Any], template: TrialTemplate) -> None:
    """Ray Tune function trainable: one ``tune.report`` (with a checkpoint) per epoch."""
    import ray
    from ray import tune

    # the trial's own seed (a grid's, a replicate's): with dataset.split_seed trial it draws the data too
    cfg = trial_config(on_this_node(template, int(config.get(SEED_KEY, template.seed))), config)
    resume = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            resume = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)

    node_id = ray.get_runtime_context().get_node_id()
    # The epochs before the restored checkpoint go with the first report: the store may not have
    # them all (it writes every few seconds; a stale snapshot may restore a newer checkpoint).
    earlier = list(resume["history"]) if resume is not None else []

    def report(metrics: dict[str, Any], get_state) -> None:
        metrics = {**metrics, "node_id": node_id}
        if earlier:
            metrics[EARLIER_EPOCHS] = earlier.copy()
            earlier.clear()
        if get_state is None:  # rejected before training: nothing to checkpoint
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory() as directory:
            torch.save(get_state(), os.path.join(directory, STATE_FILE))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))

    train_trial(cfg, on_epoch=report, resume=resume)
