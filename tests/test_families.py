"""Every registered family, through its tiny variant: builds, trains one step, reports its family."""

from __future__ import annotations

import timm
import torch
import pytest

import trainers.models  # noqa: F401  (registers the families)

NANOS = sorted(timm.list_models("ls_*_nano"))
# timm's ResNets zero-init each block's last BatchNorm, so at step 0 the conv before it gets no
# gradient; build them without that init here to see every parameter learn.
NANO_ARGS = {"ls_tcnn_nano": {"zero_init_last": False}}


def test_every_family_has_a_nano_variant():
    families = {name.split("_")[1] for name in timm.list_models("ls_*")}
    assert families >= {"convit", "gmm", "refiner"}
    assert {name.split("_")[1] for name in NANOS} == families


@pytest.mark.parametrize("name", NANOS)
def test_nano_forward_backward(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7, **NANO_ARGS.get(name, {}))
    assert model.family == name.split("_")[1]
    x = torch.randn(4, 1, 28, 28)
    logits = model(x)
    assert logits.shape == (4, 7) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, f"{name}: {pname} gets no gradient"
    groups = model.param_groups(weight_decay=0.05)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in NANOS if not n.startswith("ls_tcnn")])
def test_transformer_blocks_get_contiguous_tokens(name):
    """PatchEmbed's tokens are a transposed view; carried through the residual adds, that layout
    makes every LayerNorm and linear copy its input (see trainers/models/_common._patch_tokens)."""
    model = timm.create_model(name, num_classes=7).eval()
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        model(torch.randn(2, 1, 28, 28))
    assert seen and all(seen), seen
