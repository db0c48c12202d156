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


def _mhsa_pair(dim: int = 48, heads: int = 4):
    from timm.models.vision_transformer import Attention as TimmAttention
    from trainers.models._common import MHSA

    torch.manual_seed(0)
    ref = TimmAttention(dim, num_heads=heads)
    ours = MHSA(dim, num_heads=heads)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_mhsa_matches_timm_attention_forward_and_gradients():
    ref, ours = _mhsa_pair()
    x = torch.randn(3, 17, 48, requires_grad=True)
    y_ref, y_ours = ref(x), ours(x)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-6)
    (g_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    (g_ours,) = torch.autograd.grad(y_ours.square().sum(), x)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


def test_mlp_gelu_in_place_matches_timm_and_keeps_its_input():
    """The blocks' Mlp: timm's output bit for bit with the GELU in place (no autograd) and out of
    place (autograd recording, gradients as timm's); the caller's tensor is never overwritten."""
    from timm.layers import Mlp as TimmMlp
    from trainers.models._common import Mlp

    torch.manual_seed(0)
    ref = TimmMlp(in_features=24, hidden_features=96)
    ours = Mlp(in_features=24, hidden_features=96)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 10, 24)
    kept = x.clone()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(ours(x), ref(x)), mode
    assert torch.equal(x, kept)
    calls = []
    handle = ours.act.register_forward_hook(lambda *args: calls.append("act module"))
    with torch.no_grad():
        ours(x)
    assert calls == []  # in place: the GELU module is bypassed
    x.requires_grad_(True)
    y_ours, y_ref = ours(x), ref(x)
    assert calls == ["act module"] and torch.equal(y_ours, y_ref)
    handle.remove()
    torch.testing.assert_close(torch.autograd.grad(y_ours.sum(), x)[0], torch.autograd.grad(y_ref.sum(), x)[0],
                               rtol=0, atol=0)
    assert torch.equal(x.detach(), kept)


def _bf16_core(layer, x, core_dtype):
    """The MHSA forward under CPU bf16 autocast, its attention core computed in `core_dtype`."""
    B, N, C = x.shape
    H, d = layer.num_heads, layer.head_dim
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = layer.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
        with torch.autocast("cpu", enabled=False):
            core = torch.nn.functional.scaled_dot_product_attention(
                q.to(core_dtype), k.to(core_dtype), v.to(core_dtype)).to(torch.bfloat16)
        return layer.proj(core.transpose(1, 2).reshape(B, N, C))


def test_mhsa_trains_in_bf16_with_a_float32_core_and_infers_with_the_bf16_kernel(monkeypatch):
    # CPU training under bf16 autocast on a CPU without bf16 hardware (with it, the explicit core:
    # tests/trainers/kernels/test_gpsa_fast.py): the fused core runs in float32 (torch's bf16 CPU kernel is several
    # times slower with a backward); inference keeps the bf16 kernel (faster there).
    from trainers.kernels import _attention_core

    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: False)
    _, layer = _mhsa_pair()
    x = torch.randn(4, 50, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _bf16_core(layer, x, torch.float32))
    assert not torch.equal(y, _bf16_core(layer, x, torch.bfloat16))  # the two cores do differ
    (g,) = torch.autograd.grad(y.float().square().sum(), x)
    (g_fp32,) = torch.autograd.grad(layer(x).square().sum(), x)
    torch.testing.assert_close(g, g_fp32, rtol=0.05, atol=0.05 * g_fp32.abs().max().item())
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x.detach()), _bf16_core(layer, x.detach(), torch.bfloat16))
