"""Every family traces into one torch.compile graph (train and eval, fp32 and bf16 autocast).

A graph break costs a compiled model its fusions and adds a round trip to Python per break: on an
H200 (torch 2.11) an untraceable availability check in each GPSA layer made compiled ConViT-Ti run
0.69x its eager self. `torch._dynamo.explain` traces without compiling, so this runs in seconds.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo as dynamo

import trainers.models  # noqa: F401  (registers the ls_* families)

FAMILIES = ["ls_convit_nano", "ls_gmm_nano", "ls_refiner_nano", "ls_tcnn_nano"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_forward_traces_without_a_graph_break(name, train, dtype, device):
    model = timm.create_model(name).to(device).train(train)
    x = torch.randn(4, 1, 28, 28, device=device)
    dynamo.reset()
    with (torch.enable_grad() if train else torch.inference_mode()), \
            torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
        explained = dynamo.explain(model)(x)
    dynamo.reset()  # no traced frames left for later tests in this worker
    assert explained.graph_break_count == 0, [str(reason.reason)[:300] for reason in explained.break_reasons]
    assert explained.graph_count == 1
