"""The corrupted test images (trainers.corruptions) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.corruptions import corrupt, corruption_names

MEAN, STD = (0.25,), (0.5,)


def _normalised(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels - MEAN[0]) / STD[0]


def _pixels(images: torch.Tensor) -> torch.Tensor:
    return images * STD[0] + MEAN[0]


def test_contrast_pulls_each_image_towards_its_mean():
    # half 0, half 1: mean 0.5; severity 3 keeps 0.2 of the contrast: 0.4 and 0.6
    pixels = torch.zeros(1, 1, 4, 4)
    pixels[..., :2] = 1.0
    out = _pixels(corrupt(_normalised(pixels), "contrast", 3, mean=MEAN, std=STD))
    assert torch.allclose(out[..., :2], torch.full((1, 1, 4, 2), 0.6)) and torch.allclose(out[..., 2:], torch.full((1, 1, 4, 2), 0.4))


def test_blur_spreads_a_point_by_the_normalised_gaussian():
    # sigma 0.5 px (severity 1), radius 2: weights exp(-t^2 / 0.5) for t = -2..2 sum to 1 + 2 e^-2 + 2 e^-8;
    # the centre keeps (1 / that)^2 = 0.6187; a constant image stays constant (edges reflected)
    pixels = torch.zeros(1, 1, 9, 9)
    pixels[0, 0, 4, 4] = 1.0
    out = _pixels(corrupt(_normalised(pixels), "gaussian_blur", 1, mean=MEAN, std=STD))
    assert out[0, 0, 4, 4].item() == pytest.approx((1 / (1 + 2 * math.exp(-2) + 2 * math.exp(-8))) ** 2, rel=1e-5)
    assert out.sum().item() == pytest.approx(1.0, rel=1e-5)
    flat = _pixels(corrupt(_normalised(torch.full((1, 1, 6, 6), 0.3)), "gaussian_blur", 3, mean=MEAN, std=STD))
    assert torch.allclose(flat, torch.full_like(flat, 0.3), atol=1e-6)


def test_noise_is_the_same_for_the_same_image_and_clipped_to_the_pixel_range():
    images = _normalised(torch.full((4, 1, 5, 5), 0.5))
    a = corrupt(images, "gaussian_noise", 2, mean=MEAN, std=STD, first_index=10)
    b = torch.cat([corrupt(images[:2], "gaussian_noise", 2, mean=MEAN, std=STD, first_index=10),
                   corrupt(images[2:], "gaussian_noise", 2, mean=MEAN, std=STD, first_index=12)])
    assert torch.equal(a, b)  # image i's noise depends on its index, not on its batch
    assert not torch.equal(a[0], a[1])
    spread = (_pixels(a) - 0.5).std().item()
    assert 0.08 < spread < 0.16  # c = 0.12 at severity 2
    dark = _pixels(corrupt(_normalised(torch.zeros(2, 1, 5, 5)), "gaussian_noise", 3, mean=MEAN, std=STD))
    assert dark.min().item() >= -1e-6 and dark.max().item() <= 1.0 + 1e-6


def test_names_and_bad_input():
    assert corruption_names()[:3] == ["gaussian_noise.1", "gaussian_noise.2", "gaussian_noise.3"]
    with pytest.raises(ValueError, match="use one of"):
        corrupt(torch.zeros(1, 1, 2, 2), "fog", 1, mean=MEAN, std=STD)
    with pytest.raises(ValueError, match="1, 2 or 3"):
        corrupt(torch.zeros(1, 1, 2, 2), "contrast", 4, mean=MEAN, std=STD)
