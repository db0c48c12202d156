"""Which memory format a trial runs a model in: channels_last on CUDA, and for CNNs on the CPU."""

from __future__ import annotations

import pytest
import timm
import torch

import trainers.models  # noqa: F401  (registers the families)
from trainers.hooks import ConvertsDuringTraining
from trainers._memory_format import has_overlapping_convs, runs_channels_last

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device's type is read: no GPU needed


@pytest.mark.parametrize("name", ["ls_convit_micro", "ls_gmm_micro", "ls_refiner_micro", "deit_tiny_patch16_224"])
def test_vision_transformers_stay_nchw_on_the_cpu(name):
    model = timm.create_model(name)  # a patch embedding only: kernel == stride
    assert not has_overlapping_convs(model)
    assert not runs_channels_last(model, CPU) and runs_channels_last(model, CUDA)


@pytest.mark.parametrize("name", ["ls_tcnn_nano", "ls_tcnn_resnet10_micro_s", "resnet18"])
def test_cnns_run_channels_last_on_the_cpu_before_and_after_the_conversion(name):
    model = timm.create_model(name)
    assert runs_channels_last(model, CPU) and runs_channels_last(model, CUDA)
    if isinstance(model, ConvertsDuringTraining):
        model.reparametrise()  # the last stage's 3x3s become attention; the earlier stages stay convs
        assert runs_channels_last(model, CPU)


def test_a_strided_patch_embedding_is_not_a_cnn_layer_but_an_overlapping_stem_is():
    patchify = torch.nn.Sequential(torch.nn.Conv2d(3, 8, kernel_size=4, stride=4), torch.nn.Flatten())
    assert not has_overlapping_convs(patchify)
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, kernel_size=(3, 4), stride=(2, 4)))  # rows overlap
    assert has_overlapping_convs(stem)
    assert not has_overlapping_convs(torch.nn.Linear(3, 3))
