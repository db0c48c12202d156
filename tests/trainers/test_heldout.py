"""The held-out test's half in trainers: the best validation epoch's weights kept in every
checkpoint, and scored on the test split as validation scored them."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

import trainers.train
from trainers import selection_in, score_held_out
from trainers.corruptions import corruption_names
from trainers.config import ThroughputSettings, TrainSettings, TrialConfig
from trainers.data import DatasetRequest, prepare_dataset
from trainers.train import train_trial

FAST_THROUGHPUT = ThroughputSettings(batch_size=16, warmup=0, repeats=1)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return prepare_dataset(DatasetRequest(name="synthetic", val_fraction=0.2), cache_dir=tmp_path_factory.mktemp("cache"))


def _config(data, *, epochs: int) -> TrialConfig:
    return TrialConfig(model="ls_convit_nano", model_args={}, data=data, epochs=epochs,
                       train=TrainSettings(batch_size=64, num_workers=1, warmup_epochs=0.5),
                       throughput=FAST_THROUGHPUT, patience=None, seed=0, device="cpu")


def test_the_checkpoint_keeps_the_best_validation_epochs_weights_and_they_score_as_validation_did(synthetic, monkeypatch):
    # Validation says epoch 2 was best (0.5, 0.7, 0.6), whatever the model learnt: the selection
    # must follow what validation reported, not the last epoch.
    reported = iter([0.5, 0.7, 0.6])
    real: list[float] = []
    evaluate = trainers.train.evaluate

    def said(model, loader, *, autocast, probe=None):
        loss, acc = evaluate(model, loader, autocast=autocast, probe=probe)
        real.append(acc)
        return loss, next(reported)

    monkeypatch.setattr(trainers.train, "evaluate", said)
    states = []

    def save(metrics, get_state):  # as the Tune adapter does: serialised inside the callback
        buffer = io.BytesIO()
        torch.save(get_state(), buffer)
        states.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))

    cfg = _config(synthetic, epochs=3)
    outcome = train_trial(cfg, on_epoch=save)
    monkeypatch.undo()
    assert [h["best_epoch"] for h in outcome.history] == [1, 2, 2]
    last = states[-1]
    assert last["selected"]["epoch"] == 2 and last["selected"]["reparametrised"] is False
    for name, tensor in last["selected"]["model"].items():  # epoch 2's weights, not epoch 3's
        assert torch.equal(tensor, states[1]["model"][name]), name
    assert any(not torch.equal(t, last["model"][n]) for n, t in last["selected"]["model"].items())
    assert selection_in(last)["epoch"] == 2

    # scored on the validation split standing in for the test split: what validation measured at epoch 2
    as_val = dataclasses.replace(cfg, data=dataclasses.replace(synthetic, test_path=synthetic.val_path,
                                                                counts={**synthetic.counts, "test": synthetic.counts["val"]}))
    score = score_held_out(as_val, last["selected"]["model"], epoch=2)
    assert score.test_acc == pytest.approx(real[1], abs=1e-9)
    assert score.test_images == synthetic.counts["val"] and score.test_epoch == 2
    # and on the real test split: another set of images, scored once
    held_out = score_held_out(cfg, last["selected"]["model"], epoch=2)
    assert held_out.test_images == synthetic.counts["test"] > 0
    assert 0.0 <= held_out.test_acc <= 1.0 and held_out.test_corrupted is None  # not asked for
    # and on the corrupted copies, where asked: the clean score the same, one more per corruption
    corrupted = score_held_out(cfg, last["selected"]["model"], epoch=2, corruptions=True)
    assert corrupted.test_acc == held_out.test_acc
    assert sorted(corrupted.test_corrupted) == sorted(corruption_names()) and len(corrupted.test_corrupted) == 9
    assert all(0.0 <= v <= 1.0 for v in corrupted.test_corrupted.values())
    again = score_held_out(cfg, last["selected"]["model"], epoch=2, corruptions=True)
    assert again.test_corrupted == corrupted.test_corrupted  # the same noise each time: comparisons are paired


def test_a_resumed_trial_keeps_the_selection_it_had(synthetic):
    states = []

    def save(metrics, get_state):
        buffer = io.BytesIO()
        torch.save(get_state(), buffer)
        states.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))

    train_trial(_config(synthetic, epochs=1), on_epoch=save)
    resumed = []
    train_trial(_config(synthetic, epochs=2), resume=states[0],
                on_epoch=lambda m, get_state: resumed.append((m, get_state())))
    metrics, state = resumed[-1]
    best = 1 if metrics["val_acc"] <= states[0]["best_val_acc"] else 2
    assert metrics["best_epoch"] == state["selected"]["epoch"] == best


def test_checkpoints_from_before_the_selection_was_kept():
    weights = {"w": torch.ones(1)}
    # the last epoch was the best: its weights are the selected ones
    old = {"model": weights, "epoch": 3, "best_val_acc": 0.8, "reparametrised": False,
           "history": [{"val_acc": 0.7}, {"val_acc": 0.75}, {"val_acc": 0.8}]}
    assert selection_in(old) == {"model": weights, "epoch": 3, "reparametrised": False}
    # an earlier epoch was: its weights are gone, nothing to test
    assert selection_in({**old, "history": [{"val_acc": 0.8}, {"val_acc": 0.79}, {"val_acc": 0.7}]}) is None
    # kept: taken as they are
    kept = {"model": {"w": torch.zeros(1)}, "epoch": 1, "reparametrised": True}
    assert selection_in({**old, "selected": kept}) == kept
