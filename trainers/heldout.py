"""The held-out test: a model's weights scored once on the dataset's test split.

    weights (a trial's selected epoch, or retrain's last) --build_model, load--> model on its device
        --eval_loader(test split), in the precision it trained in--> (loss, accuracy) over every image

The search selects on the validation split: a trial's ``val_acc`` is its best epoch there, and the
front is chosen on those numbers, so they are biased upwards as estimates of how the model does on
new images. The test split is used for nothing but this score. A trial keeps the weights of its
best validation epoch in every checkpoint (``selected``, ``trainers.train.selected_weights``):
those are the model selection picked, and the ones tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainers.config import TrialConfig

__all__ = ["HeldOutScore", "selection_in", "score_held_out"]


@dataclasses.dataclass(frozen=True)
class HeldOutScore:
    test_acc: float
    test_loss: float  # mean cross-entropy
    test_images: int  # what test_acc's binomial interval rests on
    test_epoch: int | None  # the epoch whose weights were scored (None: not known)
    # accuracy on corrupted copies of the test split, {KIND.SEVERITY: acc} (trainers.corruptions);
    # None: not asked for
    test_corrupted: dict[str, float] | None = None


def selection_in(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The selected weights in a trial's checkpoint (``train_trial``'s state): its best validation
    epoch's. A checkpoint written before they were kept holds only the last epoch's, which are the
    selected ones when the last epoch was the best; else None (nothing to test)."""
    if state.get("selected") is not None:
        return dict(state["selected"])
    history = state.get("history") or []
    if history and history[-1].get("val_acc") is not None and history[-1]["val_acc"] >= state["best_val_acc"]:
        return {"model": state["model"], "epoch": int(state["epoch"]), "reparametrised": bool(state.get("reparametrised"))}
    return None


def score_held_out(cfg: TrialConfig, weights: Mapping[str, Any], *, reparametrised: bool = False,
                   epoch: int | None = None, corruptions: bool = False) -> HeldOutScore:
    """``weights`` (a state_dict of ``cfg``'s model; converted first where ``reparametrised``)
    scored on ``cfg.data``'s test split, as validation scored the trial: the same loader settings,
    the same precision. With ``corruptions``, also on each of `trainers.corruptions`' corrupted
    copies of it (9 more passes)."""
    from trainers._memory_format import place_model
    from trainers.precision import autocast_for
    from trainers.train import build_model, eval_loader, evaluate, pick_device

    device = pick_device(cfg.device)
    model = build_model(cfg)
    if reparametrised:
        model.reparametrise()
    model.load_state_dict(weights)
    channels_last = place_model(model, device)  # as train_trial ran it
    loader = eval_loader(cfg, cfg.data.test_path, device=device, channels_last=channels_last)
    autocast = autocast_for(cfg.train.precision, device)
    loss, acc = evaluate(model, loader, autocast=autocast)
    corrupted = None
    if corruptions:
        from trainers.corruptions import CORRUPTIONS

        corrupted = {f"{kind}.{severity}": evaluate(model, _corrupted(loader, kind, severity, cfg.data), autocast=autocast)[1]
                     for kind in CORRUPTIONS for severity in (1, 2, 3)}
    return HeldOutScore(test_acc=acc, test_loss=loss, test_images=int(cfg.data.counts["test"]), test_epoch=epoch,
                        test_corrupted=corrupted)


def _corrupted(loader, kind: str, severity: int, data):
    """``loader``'s batches, corrupted (trainers.corruptions.corrupt), each image seeded by its index."""
    from trainers.corruptions import corrupt

    seen = 0
    for images, labels in loader:
        yield corrupt(images, kind, severity, mean=data.mean, std=data.std, first_index=seen), labels
        seen += labels.numel()
