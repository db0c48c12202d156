"""What a model may implement for the training loop (`trainers.train.train_trial`) to treat it
specially. A plain timm model implements neither and trains as it is.

    ConvertsDuringTraining  changes architecture mid-training (T-CNN: its last-stage convs recast
                            as attention); the loop converts it before ``reparam_epoch_for(epochs)``
    HasParamGroups          builds its own AdamW parameter groups (e.g. ConViT: its own learning
                            rate for the gates); otherwise `default_param_groups`
"""

from __future__ import annotations

import abc
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["ConvertsDuringTraining", "HasParamGroups"]


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
