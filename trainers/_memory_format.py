"""Which memory format a model's images and weights run in: channels_last where it is faster.

On CUDA every model runs channels_last (tensor cores want NHWC). On the CPU it depends on the
model: oneDNN's convolutions run faster on NHWC, so a network of overlapping convolutions (a
ResNet, a T-CNN before and after its conversion) gains; a vision transformer's only convolution
is its patch embedding, whose kernel equals its stride, and its time goes to matmuls on tokens,
where the format does not matter, so those stay NCHW. The rule: channels_last on the CPU only
for a model whose gain is measured, by `python -m benchmarks models --groups micro tiny`
(`channels_last_gain`: the T-CNNs timed in both formats).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["has_overlapping_convs", "place_model", "runs_channels_last"]


def has_overlapping_convs(model: nn.Module) -> bool:
    """Whether `model` has a 2D convolution whose kernel is larger than its stride (a CNN layer,
    not a patch embedding, whose kernel equals its stride)."""
    return any(
        isinstance(m, nn.Conv2d) and any(k > s for k, s in zip(m.kernel_size, m.stride))
        for m in model.modules()
    )


def runs_channels_last(model: nn.Module, device: torch.device) -> bool:
    """Whether `model` and its images should be channels_last on `device` (see the module doc)."""
    return device.type == "cuda" or has_overlapping_convs(model)


def place_model(model: nn.Module, device: torch.device) -> bool:
    """Move `model` (in place) to `device`, in the memory format it runs in there; returns whether
    that is channels_last, which its images must then be too (`make_loader(channels_last=...)`)."""
    channels_last = runs_channels_last(model, device)
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    return channels_last
