"""What a model may implement for the training loop (`trainers.train.train_trial`) to treat it
specially. A plain timm model implements neither and trains as it is.

    ConvertsDuringTraining  changes architecture mid-training (T-CNN: its last-stage convs recast
                            as attention); the loop converts it before ``reparam_epoch_for(epochs)``
    HasParamGroups          builds its own AdamW parameter groups (e.g. ConViT: its own learning
                            rate for the gates); otherwise `param_groups`' rule applies, with
                            no weight decay on what the model's ``no_weight_decay()`` lists
    ReportsMechanisms       says after each epoch what its mechanism has become (ConViT: each
                            gate sigma(lambda) and, on a few validation images, each head's
                            nonlocality; GMM: each kernel's width), recorded with the epoch's
                            metrics (`mechanisms`)

`param_groups` is the one rule every model's groups follow (the families pick out their own
parameters for it).
"""

from __future__ import annotations

import abc
import math
from numbers import Real
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ConvertsDuringTraining", "HasParamGroups", "ReportsMechanisms", "mechanisms", "param_groups"]


class ConvertsDuringTraining(abc.ABC):
    """A model the training loop converts in place before one epoch.

    The loop asks ``reparam_epoch_for(total_epochs)`` once (0: convert before training, the
    total: never) and, before that epoch, calls ``reparametrise()``, places the new layers, measures
    the model again and gives it an optimizer as ``reparam_optimizer`` says: ``'fresh'`` (a new
    AdamW with its own warm-up and cosine decay over the epochs left) or ``'keep'`` (the same
    schedule; parameters that survive the conversion keep their Adam moments).
    ``is_reparametrised`` says whether it has converted; checkpoints record it, and a resumed
    trial converts the model before loading its weights.

    The two attributes are plain instance attributes, set by the model's constructor (the
    defaults here are what a model that sets neither means)."""

    is_reparametrised: bool = False
    reparam_optimizer: Literal["fresh", "keep"] = "fresh"

    @abc.abstractmethod
    def reparam_epoch_for(self, total_epochs: int) -> int:
        """The epoch (0-based, at most ``total_epochs``) before which the model converts."""

    @abc.abstractmethod
    def reparametrise(self) -> list[str]:
        """Convert in place (once: a second call raises); the names of the modules replaced."""


@runtime_checkable
class HasParamGroups(Protocol):
    """A model that builds its own AdamW parameter groups (``lr_scale`` per group is honoured by
    `trainers.train.set_lr`). A Protocol rather than a base class: the families declare the method
    and need not inherit anything for it."""

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The groups, each with its ``params`` and ``weight_decay`` (and optionally ``lr_scale``)."""


@runtime_checkable
class ReportsMechanisms(Protocol):
    """A model whose papers make claims about how a mechanism of theirs evolves in training (ConViT:
    the gates open with depth and training; GMM: the kernels' widths), and that reports it: names
    of its own choosing, each a float, read from the parameters after an epoch."""

    def mechanism_metrics(self, probe: "torch.Tensor | None" = None) -> dict[str, float]:
        """{name: value} as the model stands now: read from its parameters, and with ``probe``
        images (the same few validation images after every epoch) also what it does on them
        (ConViT: each head's nonlocality)."""


def mechanisms(model: Any, probe: "torch.Tensor | None" = None) -> dict[str, float] | None:
    """``model``'s `ReportsMechanisms` metrics (None for a model without them, or with none to give)."""
    if not isinstance(model, ReportsMechanisms):
        return None
    return {str(k): float(v) for k, v in model.mechanism_metrics(probe).items()} or None


def _never(name: str, param: Any) -> bool:
    return False


def param_groups(model: "nn.Module", weight_decay: float, *,
                 no_decay: Callable[[str, "nn.Parameter"], bool] = _never,
                 special: Callable[[str, "nn.Parameter"], bool] = _never,
                 special_weight_decay: float = 0., special_lr_scale: float = 1.) -> list[dict[str, Any]]:
    """AdamW groups {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale): `special(name, p)`
    (a family's gates or masks): `special_weight_decay`, `special_lr_scale`; biases, norms (every
    parameter of at most one dimension) and `no_decay(name, p)`: no weight decay; everything else:
    `weight_decay`. lr_scale 1.0 but for the special group. Frozen parameters are left out; empty
    groups dropped. A ValueError for a `weight_decay` that is not a finite number >= 0."""
    if not (isinstance(weight_decay, Real) and not isinstance(weight_decay, bool) and math.isfinite(weight_decay)
            and weight_decay >= 0):
        raise ValueError(f'weight_decay={weight_decay!r}: expected a finite number >= 0.0')
    decay, no_decay_params, special_params = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if special(name, p):
            special_params.append(p)
        elif p.ndim <= 1 or no_decay(name, p):
            no_decay_params.append(p)
        else:
            decay.append(p)
    groups = [
        dict(params=decay, weight_decay=float(weight_decay), lr_scale=1.0),
        dict(params=no_decay_params, weight_decay=0.0, lr_scale=1.0),
        dict(params=special_params, weight_decay=float(special_weight_decay), lr_scale=float(special_lr_scale)),
    ]
    return [g for g in groups if g['params']]
