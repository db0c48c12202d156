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
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


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


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_compiled_training_step_matches_eager(name, dtype):
    # `train: {compile: true}` compiles forward and backward (AOT autograd); explain above traces
    # the forward only. GPSA's bf16 step failed here on the CPU core's hand-written backward once
    # two GPSA layers ran it (ls_convit_micro has three; the nano model only one by default).
    torch.manual_seed(0)
    model = timm.create_model(name, **({"local_up_to_layer": 2} if name == "ls_convit_nano" else {})).train()
    x = torch.randn(4, 1, 28, 28)
    labels = torch.tensor([0, 1, 2, 3])

    def step(run):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(run(x).float(), labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = step(model)
    dynamo.reset()
    compiled_loss, compiled_grads = step(torch.compile(model, backend="aot_eager"))
    dynamo.reset()
    assert compiled_grads.keys() == eager_grads.keys()
    if dtype is None:
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
        for n, g in eager_grads.items():
            torch.testing.assert_close(compiled_grads[n], g, rtol=1e-3, atol=1e-5, msg=n)
    else:  # bf16 products in a different order (fused SDPA vs the explicit core): close, not equal
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)
        flat = lambda grads: torch.cat([grads[n].flatten() for n in eager_grads])  # noqa: E731
        cos = torch.nn.functional.cosine_similarity(flat(compiled_grads), flat(eager_grads), dim=0)
        assert cos > 0.99, cos
