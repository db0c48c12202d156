"""Corrupted copies of the test split, for robustness claims (Transformed CNNs: a T-CNN's gain over
its CNN grows with the corruption's severity).

Three corruptions of Hendrycks & Dietterich 2019 (*Benchmarking neural network robustness to common
corruptions and perturbations*, ICLR; ImageNet-C), each at 3 severities, applied to the images in
pixel units [0, 1] and normalised again:

    gaussian_noise  x + N(0, c^2), clipped          c = 0.08, 0.12, 0.18  (ImageNet-C's severities 1-3)
    gaussian_blur   a Gaussian filter of sigma c px  c = 0.5, 1.0, 1.5     (ImageNet-C's 1, 2, 3 px are for
                                                                           224 px; at 28 px its first
                                                                           already erases strokes)
    contrast        (x - mean(x)) * c + mean(x)     c = 0.4, 0.3, 0.2     (ImageNet-C's severities 1-3)

The noise is drawn from a generator seeded by the image's index in the split and the severity, so
every model is scored on the very same corrupted images (its comparisons are paired).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["CORRUPTIONS", "SEVERITIES", "corrupt", "corruption_names"]

SEVERITIES: dict[str, tuple[float, float, float]] = {
    "gaussian_noise": (0.08, 0.12, 0.18),
    "gaussian_blur": (0.5, 1.0, 1.5),
    "contrast": (0.4, 0.3, 0.2),
}
CORRUPTIONS = tuple(SEVERITIES)


def corruption_names() -> list[str]:
    """``KIND.SEVERITY`` (severity 1-3) for every corruption: the keys of ``test_corrupted``."""
    return [f"{kind}.{s}" for kind in CORRUPTIONS for s in (1, 2, 3)]


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = max(1, min(math.ceil(3 * sigma), x.shape[-1] - 1, x.shape[-2] - 1))  # reflection needs a smaller pad
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-t ** 2 / (2 * sigma ** 2))
    kernel = kernel / kernel.sum()
    channels = x.shape[1]
    rows = kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1)
    cols = kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1)
    # separable, edges reflected (as scipy.ndimage.gaussian_filter, which ImageNet-C uses)
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="reflect"), rows, groups=channels)
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="reflect"), cols, groups=channels)


def corrupt(images: torch.Tensor, kind: str, severity: int, *, mean: Sequence[float], std: Sequence[float],
            first_index: int = 0) -> torch.Tensor:
    """``images`` (B, C, H, W), normalised with ``mean``/``std`` (per channel, pixel units [0, 1]),
    corrupted by ``kind`` at ``severity`` (1-3) and normalised again. ``first_index``: the split's
    index of the first image (the noise of image i is the same in every call)."""
    if kind not in SEVERITIES:
        raise ValueError(f"corruption {kind!r}: use one of {', '.join(CORRUPTIONS)}")
    if severity not in (1, 2, 3):
        raise ValueError(f"severity {severity}: use 1, 2 or 3")
    c = SEVERITIES[kind][severity - 1]
    m = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    x = images.float() * s + m  # (B, C, H, W) in [0, 1]
    if kind == "gaussian_noise":
        noise = torch.stack([
            torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(1_000_003 * severity + first_index + i))
            for i in range(x.shape[0])]).to(x.device)
        x = (x + c * noise).clamp(0.0, 1.0)
    elif kind == "gaussian_blur":
        x = _blur(x, c).clamp(0.0, 1.0)
    else:  # contrast: towards each image's mean
        centre = x.mean(dim=(1, 2, 3), keepdim=True)
        x = (x - centre) * c + centre
    return ((x - m) / s).to(images.dtype)
