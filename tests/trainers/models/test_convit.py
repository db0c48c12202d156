"""ConViT family (trainers/models/ls_convit.py): exactness against timm, GPSA properties, interface."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.convit import GPSA as TimmGPSA
from timm.models.convit import ConVit as TimmConVit

import trainers.models  # noqa: F401  (registers ls_convit_* with timm)
from trainers import kernels
from trainers.kernels import _gpsa
from trainers.kernels._attention_core import gated_attention
from trainers.models.ls_convit import GPSA, LocalityConViT, rel_indices

NANO = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)  # 7 x 7 = 49 patches


def _perturb(module: torch.nn.Module, scale: float = 0.3, seed: int = 0) -> None:
    """Move every parameter off its init so content, position and gates all matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _timm_gpsa(dim: int, heads: int, seed: int = 0, **kwargs) -> TimmGPSA:
    torch.manual_seed(seed)
    ref = TimmGPSA(dim, num_heads=heads, **kwargs).double()
    ref.local_init()
    _perturb(ref, seed=seed)
    return ref


def _ours_like(ref: TimmGPSA, **kwargs) -> GPSA:
    ours = GPSA(ref.dim, num_heads=ref.num_heads, qkv_bias=ref.qk.bias is not None, **kwargs).double()
    ours.load_state_dict(ref.state_dict())
    return ours


def _content_attention(layer: GPSA, x: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) from the qk weights, written out independently of GPSA."""
    B, N, C = x.shape
    H = layer.num_heads
    d = C // H
    qk = x @ layer.qk.weight.T
    if layer.qk.bias is not None:
        qk = qk + layer.qk.bias
    q = qk[..., :C].reshape(B, N, H, d).transpose(1, 2)
    k = qk[..., C:].reshape(B, N, H, d).transpose(1, 2)
    return torch.softmax(torch.einsum('bhnd,bhmd->bhnm', q, k) / math.sqrt(d), dim=-1)


# --- GPSA against timm --------------------------------------------------------------------------

@pytest.mark.parametrize('heads, tokens, qkv_bias', [(4, 49, False), (9, 36, True), (5, 16, False)])
def test_gpsa_matches_timm_forward_and_gradients(heads, tokens, qkv_bias):
    dim = 6 * heads
    ref = _timm_gpsa(dim, heads, qkv_bias=qkv_bias)
    ours = _ours_like(ref)
    x = torch.randn(3, tokens, dim, dtype=torch.float64)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    torch.testing.assert_close(y_ours, y_ref, rtol=0, atol=1e-10)
    assert y_ref.abs().max() > 1e-2  # a non-trivial output

    w = torch.randn_like(y_ref)  # a random cotangent, not just sum()
    (y_ref * w).sum().backward()
    (y_ours * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-10)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=0, atol=1e-10, msg=name)
    assert ref_params['gating_param'].grad.abs().max() > 1e-6  # the gates are really exercised


def test_gpsa_explicit_dropout_path_matches_timm():
    ref = _timm_gpsa(24, 4, attn_drop=0.3).train()
    ours = _ours_like(ref, attn_drop=0.3).train()
    x = torch.randn(2, 49, 24, dtype=torch.float64)
    torch.manual_seed(123)
    y_ref = ref(x)
    torch.manual_seed(123)
    y_ours = ours(x)
    torch.testing.assert_close(y_ours, y_ref, rtol=0, atol=1e-10)
    ours.eval()  # no dropout in eval: the fast path, equal to timm in eval
    torch.testing.assert_close(ours(x), ref.eval()(x), rtol=0, atol=1e-10)


def test_rel_indices_match_timm_square_and_are_cached():
    layer = GPSA(16, num_heads=4)
    timm_layer = TimmGPSA(16, num_heads=4)
    for side in (1, 3, 7):
        torch.testing.assert_close(rel_indices((side, side)), timm_layer.get_rel_indices(side * side)[0])
    # rectangular grid: patch n = row * W + col, r = (dcol, drow, dcol^2 + drow^2), key minus query
    r = rel_indices((2, 3))
    assert r.shape == (6, 6, 3)
    assert r[0, 5].tolist() == [2.0, 1.0, 5.0] and r[5, 0].tolist() == [-2.0, -1.0, 5.0]

    x = torch.randn(2, 49, 16)
    layer(x)
    cached = layer.rel_indices
    layer(x)
    assert layer.rel_indices is cached  # not recomputed per forward
    assert 'rel_indices' not in layer.state_dict()  # non-persistent
    layer(torch.randn(2, 25, 16))  # a new grid rebuilds it
    assert layer.rel_indices.shape == (25, 25, 3)
    with pytest.raises(ValueError, match='grid_size'):
        layer(torch.randn(2, 50, 16))


# --- the CPU training core (gated_attention) -----------------------------------------------------

def _gated_inputs(B=2, H=3, N=5, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(3, B, H, N, d, generator=gen, dtype=torch.float64)
    gate = torch.sigmoid(torch.randn(H, generator=gen, dtype=torch.float64))
    pos = torch.softmax(torch.randn(H, N, N, generator=gen, dtype=torch.float64), dim=-1)
    return qkv, gate, pos


def test_gated_attention_matches_the_formula_and_gradcheck():
    qkv, gate, pos = _gated_inputs()
    q, k, v = qkv
    scale = 0.37
    attn = (1 - gate.view(-1, 1, 1)) * torch.softmax(q @ k.transpose(-2, -1) * scale, -1) + gate.view(-1, 1, 1) * pos
    torch.testing.assert_close(gated_attention(qkv, gate, pos, scale), attn @ v, rtol=0, atol=1e-12)
    inputs = tuple(t.clone().requires_grad_() for t in (qkv, gate, pos))
    assert torch.autograd.gradcheck(lambda a, b, c: gated_attention(a, b, c, scale), inputs)
    # the gates at their extremes (s = 0: pure content, s = 1: pure position)
    for s in (0.0, 1.0):
        inputs = (qkv.clone().requires_grad_(), torch.full_like(gate, s).requires_grad_(), pos.clone().requires_grad_())
        assert torch.autograd.gradcheck(lambda a, b, c: gated_attention(a, b, c, scale), inputs)


def test_gated_attention_frozen_gate_and_positions_give_the_same_qkv_gradient():
    qkv, gate, pos = _gated_inputs(seed=1)
    w = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    grads = []
    for needs in (True, False):
        x = qkv.clone().requires_grad_()
        g, p = gate.clone().requires_grad_(needs), pos.clone().requires_grad_(needs)
        (gated_attention(x, g, p, 0.5) * w).sum().backward()
        grads.append(x.grad)
        assert (g.grad is not None) == needs and (p.grad is not None) == needs
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gpsa_explicit_core_and_fused_path_agree(dtype, monkeypatch):
    torch.manual_seed(0)
    layer = GPSA(24, num_heads=4).to(dtype)
    _perturb(layer)
    x = torch.randn(3, 49, 24, dtype=dtype)
    with torch.no_grad():
        y_core_no_grad = layer(x)  # the CPU path without autograd
    with monkeypatch.context() as m:  # the CUDA / autocast path, forced on the CPU
        m.setattr(_gpsa, 'takes_cpu_core', lambda x: False)
        y_fused = layer(x)
        assert y_fused.grad_fn is not None
        y_fused = y_fused.detach()
    y_core = layer(x.requires_grad_())  # grad on the CPU: gated_attention with its backward
    assert y_core.grad_fn is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(y_core_no_grad, y_fused, rtol=0, atol=tol)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(y_core.detach(), y_fused, rtol=0, atol=tol)
    # frozen gates and positions (e.g. fine-tuning the rest): same gradient for x
    (y_core * y_fused).sum().backward()
    gx = x.grad.clone()
    layer.gating_param.requires_grad_(False)
    layer.pos_proj.requires_grad_(False)
    x.grad = None
    (layer(x) * y_fused).sum().backward()
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=tol)


def test_positional_attention_is_reused_without_grad_until_the_parameters_change():
    torch.manual_seed(0)
    layer = GPSA(16, num_heads=4).eval()
    with torch.inference_mode():
        first = layer.positional_attention((7, 7))
        assert layer.positional_attention((7, 7)) is first  # reused
    with torch.no_grad():
        layer.pos_proj.weight.mul_(2.)  # e.g. an optimizer step
    with torch.inference_mode():
        second = layer.positional_attention((7, 7))
    assert second is not first
    torch.testing.assert_close(second, layer._positional_attention((7, 7)), rtol=0, atol=0)
    layer.load_state_dict(GPSA(16, num_heads=4).state_dict())
    with torch.inference_mode():
        third = layer.positional_attention((7, 7))
    torch.testing.assert_close(third, layer._positional_attention((7, 7)), rtol=0, atol=0)
    assert layer.positional_attention((5, 5)).shape == (4, 25, 25)  # another grid: recomputed
    p = layer.positional_attention((7, 7))  # with grad: never cached, part of the graph
    assert p.requires_grad and 'pos' not in layer._frozen_cache


def _mixing_terms(layer: GPSA, grid: tuple, dtype: torch.dtype) -> tuple:
    """GPSA's s * P and 1 - s as `kernels.gated_attention` computes and keeps them for `layer`."""
    return _gpsa.mixing_terms(layer.gating_param, layer.positional_attention(grid),
                              (layer.pos_proj.weight, layer.pos_proj.bias), grid, dtype, layer._frozen_cache)


def test_mixing_terms_kept_per_dtype():
    """s * P and 1 - s (the CUDA path's) kept for inference in each dtype asked for: alternating
    bf16 and fp32 calls reuse both instead of recomputing at every switch; an update recomputes."""
    layer = GPSA(16, num_heads=4).eval()
    with torch.inference_mode():
        fp32, bf16 = _mixing_terms(layer, (7, 7), torch.float32), _mixing_terms(layer, (7, 7), torch.bfloat16)
        assert fp32[0].dtype == torch.float32 and bf16[0].dtype == torch.bfloat16
        assert _mixing_terms(layer, (7, 7), torch.float32)[0] is fp32[0]
        assert _mixing_terms(layer, (7, 7), torch.bfloat16)[0] is bf16[0]
    with torch.no_grad():
        layer.gating_param.add_(1.)
    with torch.inference_mode():
        again = _mixing_terms(layer, (7, 7), torch.float32)
    assert again[0] is not fp32[0]
    gate = torch.sigmoid(layer.gating_param.detach())
    torch.testing.assert_close(again[1], (1 - gate).view(-1, 1))
    torch.testing.assert_close(again[0], gate.view(-1, 1, 1) * layer._positional_attention((7, 7)))


def test_positional_attention_drops_only_negligible_entries():
    torch.manual_seed(0)
    layer = GPSA(16, num_heads=4, locality_strength=3.).double()
    P = layer.positional_attention((14, 14))  # far keys sit hundreds of units below the peak
    exact = torch.softmax(layer.pos_proj(layer.rel_indices).permute(2, 0, 1), dim=-1)
    torch.testing.assert_close(P, exact, rtol=0, atol=1e-15)  # rounding
    assert (P == 0).any() and exact[P == 0].max() < 1e-29  # only negligible entries were dropped
    assert (P[P > 0] >= 1e-33).all()  # none left near the subnormal range
    torch.testing.assert_close(P.sum(-1), torch.ones(4, 196, dtype=torch.float64))


# --- GPSA properties ----------------------------------------------------------------------------

def test_attention_rows_sum_to_one_and_gates_select_the_terms():
    torch.manual_seed(0)
    layer = GPSA(24, num_heads=4).double()
    _perturb(layer)
    x = torch.randn(2, 49, 24, dtype=torch.float64)
    attn = layer.get_attention_map(x)
    assert attn.shape == (2, 4, 49, 49)
    assert (attn >= 0).all()
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 4, 49, dtype=torch.float64))

    content = _content_attention(layer, x)
    pos = layer.positional_attention((7, 7))
    assert not torch.allclose(content, pos.expand_as(content), atol=1e-3)  # the two terms differ
    v = (x @ layer.v.weight.T).reshape(2, 49, 4, 6).transpose(1, 2)
    with torch.no_grad():
        for gate, expected in ((1e4, pos.expand_as(content)), (-1e4, content)):
            layer.gating_param.fill_(gate)
            torch.testing.assert_close(layer.get_attention_map(x), expected, rtol=0, atol=1e-12)
            # the fast forward agrees with the independent formula at both extremes
            out = (expected @ v).transpose(1, 2).reshape(2, 49, 24)
            torch.testing.assert_close(layer(x), layer.proj(out), rtol=0, atol=1e-10)


@pytest.mark.parametrize('alpha', [1.0, 3.0])
def test_local_init_peaks_at_kernel_offsets_3x3(alpha):
    layer = GPSA(27, num_heads=9, locality_strength=alpha)
    torch.testing.assert_close(layer.v.weight, torch.eye(27))
    pos = layer.positional_attention((7, 7))  # (9, 49, 49)
    query = 3 * 7 + 3  # the centre patch (row 3, col 3)
    for h1 in range(3):
        for h2 in range(3):
            head = h1 + 3 * h2
            dx, dy = h2 - 1, h1 - 1  # timm: weight[:, 0] (dx) from h2, weight[:, 1] (dy) from h1
            expected = (3 + dy) * 7 + (3 + dx)
            assert pos[head, query].argmax().item() == expected, head
            assert pos[head, query, expected] > 0.25


def test_local_init_2x2_kernel_ties_and_unlocal_heads():
    # 5 heads: floor(sqrt(5))^2 = 4 local heads; a 2 x 2 kernel has half-integer centres, so each
    # local head spreads evenly over the 2 x 2 block of patches around its centre
    layer = GPSA(20, num_heads=5, locality_strength=2.0)
    pos = layer.positional_attention((7, 7)).reshape(5, 49, 7, 7)
    query = 3 * 7 + 3
    for h1 in range(2):
        for h2 in range(2):
            head = h1 + 2 * h2
            rows = [3 + h1 - 1, 3 + h1]  # centre at dy = h1 - 0.5
            cols = [3 + h2 - 1, 3 + h2]  # centre at dx = h2 - 0.5
            block = pos[head, query][rows][:, cols]
            torch.testing.assert_close(block, block[0, 0].expand(2, 2))
            assert torch.isclose(pos[head, query].max(), block[0, 0])
            assert (pos[head, query] > block[0, 0] * (1 - 1e-6)).sum() == 4
    # head 4 is not local: it keeps its small random v_pos (times alpha)
    assert layer.pos_proj.weight[4].abs().max() < 0.5
    assert layer.pos_proj.weight[:4, 2].tolist() == [-2.0] * 4  # scaled by alpha


# --- the model -----------------------------------------------------------------------------------

def _seq_lengths(model: LocalityConViT, x: torch.Tensor) -> list:
    lengths = []
    hooks = [blk.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1])) for blk in model.blocks]
    model(x)
    for h in hooks:
        h.remove()
    return lengths


@pytest.mark.parametrize('local', [0, 1, 2, 3])
def test_class_token_added_exactly_once(local):
    model = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=local).eval()
    lengths = _seq_lengths(model, torch.randn(2, 1, 28, 28))
    if local < 3:
        assert lengths == [49] * local + [50] * (3 - local)
        assert model.cls_token is not None
    else:  # every layer GPSA: no class token, average pooling
        assert lengths == [49] * 3
        assert model.cls_token is None and model.global_pool == 'avg'
    assert [isinstance(b.attn, GPSA) for b in model.blocks] == [i < local for i in range(3)]
    assert model.forward_features(torch.randn(2, 1, 28, 28)).shape == (2, 49 if local == 3 else 50, 16)


@pytest.mark.parametrize('local', [0, 2, 3])
def test_every_parameter_gets_a_gradient_and_param_groups_cover_them(local):
    model = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=local,
                           gate_lr_mult=10.0, drop_rate=0.1, drop_path_rate=0.1)
    loss = F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,)))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.numel() > 0, name
        assert torch.isfinite(p.grad).all(), name
        # the positional-score bias shifts every score of a head alike: softmax ignores it (as in timm)
        if not name.endswith('pos_proj.bias'):
            assert p.grad.abs().max() > 0, name

    groups = model.param_groups(weight_decay=0.05)
    assert all(set(g) == {'params', 'weight_decay', 'lr_scale'} and g['params'] for g in groups)
    ids = [id(p) for g in groups for p in g['params']]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        for p in g['params']:
            name = names[id(p)]
            if name.endswith('gating_param'):
                assert (g['lr_scale'], g['weight_decay']) == (10.0, 0.0), name
            elif p.ndim <= 1 or name in ('pos_embed', 'cls_token'):
                assert (g['lr_scale'], g['weight_decay']) == (1.0, 0.0), name
            else:
                assert (g['lr_scale'], g['weight_decay']) == (1.0, 0.05), name
    n_gates = sum(n.endswith('gating_param') for n in names.values())
    assert n_gates == local and len(groups) == (3 if local else 2)
    torch.optim.AdamW(groups, lr=1e-3).step()  # the groups are valid optimizer groups

    model.patch_embed.proj.weight.requires_grad_(False)  # frozen parameters are left out
    assert len([p for g in model.param_groups(0.05) for p in g['params']]) == len(ids) - 1


@pytest.mark.parametrize('heads, per_head, depth, local, qkv_bias', [
    (4, 8, 3, 2, False),
    (9, 4, 2, 1, True),
    (4, 8, 2, 0, False),  # DeiT
])
def test_model_matches_timm_convit(heads, per_head, depth, local, qkv_bias):
    cfg = dict(**NANO, depth=depth, num_heads=heads, local_up_to_layer=local, qkv_bias=qkv_bias,
               locality_strength=1.5)
    torch.manual_seed(0)
    ref = TimmConVit(embed_dim=per_head, **cfg).double().eval()  # timm: embed_dim per head
    ours = LocalityConViT(embed_dim=heads * per_head, **cfg).double().eval()  # ours: total width
    assert ours.state_dict().keys() == ref.state_dict().keys()
    _perturb(ref, scale=0.1)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64, requires_grad=True)
    y_ref, y_ours = ref(x), ours(x)
    torch.testing.assert_close(y_ours, y_ref, rtol=0, atol=1e-8)
    assert y_ref.std() > 1e-2
    g_ref, = torch.autograd.grad(y_ref.square().sum(), x)
    g_ours, = torch.autograd.grad(y_ours.square().sum(), x)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-8)
    with torch.inference_mode():  # the inference core (q, k, v laid out heads first), twice: cached weights
        for _ in range(2):
            torch.testing.assert_close(ours(x.detach()), y_ref.detach(), rtol=0, atol=1e-8)


def test_init_matches_timm_structure():
    torch.manual_seed(0)
    model = LocalityConViT(**NANO, embed_dim=36, num_heads=9, depth=2, local_up_to_layer=1,
                           locality_strength=2.0, gate_init=0.5)
    gpsa = model.blocks[0].attn
    torch.testing.assert_close(gpsa.v.weight, torch.eye(36))
    torch.testing.assert_close(gpsa.gating_param, torch.full((9,), 0.5))
    assert gpsa.pos_proj.weight[:, 2].tolist() == [-2.0] * 9
    assert gpsa.pos_proj.bias.abs().max() == 0


def test_table_3_ablation_without_the_convolutional_init_keeps_the_random_one():
    torch.manual_seed(0)
    local = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=2, local_up_to_layer=1, gate_init=0.5)
    torch.manual_seed(0)
    model = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=2, local_up_to_layer=1, gate_init=0.5,
                           use_local_init=False)
    gpsa = model.blocks[0].attn
    # the same draws up to the convolutional init: every weight it leaves alone is equal
    for (name, a), b in zip(local.named_parameters(), model.parameters()):
        if not name.endswith(('attn.v.weight', 'pos_proj.weight')):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert not torch.allclose(gpsa.v.weight, torch.eye(16))  # W_val random, not I
    assert gpsa.pos_proj.weight.abs().max() < 0.1  # v_pos as trunc_normal(std .02) left it: no kernel offsets
    torch.testing.assert_close(gpsa.gating_param, torch.full((4,), 0.5))  # the gates still start at gate_init


def test_table_3_ablation_frozen_gates_stay_at_zero_and_are_not_optimised():
    model = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=2, gate_init=1.0,
                           train_gating=False)
    gates = [blk.attn.gating_param for blk in model.blocks[:2]]
    assert all(not g.requires_grad and g.abs().max() == 0 for g in gates)  # lambda = 0: sigma = 1/2
    assert not any(p is g for grp in model.param_groups(0.05) for p in grp['params'] for g in gates)
    assert model.mechanism_metrics()['gate.0.0'] == pytest.approx(0.5)
    opt = torch.optim.AdamW(model.param_groups(0.05), lr=1e-2)
    for kernels_on in (False, True):  # both attention paths train with the gates frozen
        was = kernels.enabled()
        kernels.set_enabled(kernels_on)
        try:
            F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,))).backward()
        finally:
            kernels.set_enabled(was)
        opt.step()
        opt.zero_grad()
    assert all(g.abs().max() == 0 and g.grad is None for g in gates)


# --- timm registry ------------------------------------------------------------------------------

def test_create_model_passes_kwargs():
    model = timm.create_model('ls_convit_nano', num_classes=5, locality_strength=2.0)
    assert isinstance(model, LocalityConViT) and model.family == 'convit'
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 5)
    assert model.blocks[0].attn.pos_proj.weight[0, 2].item() == -2.0
    with pytest.raises(TypeError):
        timm.create_model('ls_convit_nano', not_an_argument=1)
    with pytest.raises(TypeError):
        timm.create_model('ls_convit_nano', attn_drop_rate=0.1)


def test_every_registered_variant_builds():
    names = timm.list_models('ls_convit_*')
    assert set(names) >= {'ls_convit_nano', 'ls_convit_micro', 'ls_convit_tiny', 'ls_convit_small', 'ls_convit_base'}
    assert not set(names) & set(timm.list_models('convit_*'))  # nothing of timm's is overwritten
    for name in names:
        cfg = timm.get_pretrained_cfg(name)
        assert not cfg.has_weights and cfg.num_classes > 0 and len(cfg.mean) == cfg.input_size[0]
        if cfg.input_size[-1] <= 32:  # the small ones: build for real and run
            model = timm.create_model(name).eval()
            x = torch.randn(2, *cfg.input_size)
            assert model(x).shape == (2, cfg.num_classes), name
        else:  # ImageNet-sized: build on the meta device, compare with timm's convit_* of that size
            with torch.device('meta'):
                model = timm.create_model(name)
                ref = timm.create_model(name.replace('ls_', ''))
            assert isinstance(model, LocalityConViT)
            shapes = {k: v.shape for k, v in model.state_dict().items()}
            assert shapes == {k: v.shape for k, v in ref.state_dict().items()}, name
            assert model.local_up_to_layer == ref.local_up_to_layer == 10


# --- argument checks ----------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs, arg', [
    (dict(embed_dim=30, num_heads=4), 'embed_dim'),
    (dict(local_up_to_layer=3, depth=2), 'local_up_to_layer'),
    (dict(local_up_to_layer=-1), 'local_up_to_layer'),
    (dict(img_size=30, patch_size=4), 'img_size'),
    (dict(img_size=(28, 30), patch_size=4), 'img_size'),
    (dict(depth=0), 'depth'),
    (dict(num_heads=2.0), 'num_heads'),
    (dict(drop_rate=1.0), 'drop_rate'),
    (dict(drop_path_rate=-0.1), 'drop_path_rate'),
    (dict(locality_strength=-1.0), 'locality_strength'),
    (dict(gate_lr_mult=-1.0), 'gate_lr_mult'),
    (dict(gate_init=float('nan')), 'gate_init'),
    (dict(mlp_ratio=0.0), 'mlp_ratio'),
    (dict(qkv_bias=1), 'qkv_bias'),
    (dict(use_pos_embed='no'), 'use_pos_embed'),
    (dict(use_local_init=0), 'use_local_init'),
    (dict(train_gating='yes'), 'train_gating'),
])
def test_bad_arguments_name_the_argument(kwargs, arg):
    base = dict(NANO, embed_dim=16, num_heads=4, depth=2, local_up_to_layer=1)
    with pytest.raises(ValueError, match=arg):
        LocalityConViT(**{**base, **kwargs})


def test_param_groups_rejects_negative_weight_decay():
    model = timm.create_model('ls_convit_nano')
    with pytest.raises(ValueError, match='weight_decay'):
        model.param_groups(-0.1)


def test_the_gates_are_reported_as_mechanisms_per_gpsa_block_and_head():
    from trainers.hooks import ReportsMechanisms, mechanisms

    model = LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=3, local_up_to_layer=2, gate_init=0.0)
    gates = mechanisms(model)
    assert isinstance(model, ReportsMechanisms)
    assert gates == {f'gate.{i}.{h}': 0.5 for i in range(2) for h in range(4)}  # sigmoid(0); block 2 is plain SA
    with torch.no_grad():
        model.blocks[1].attn.gating_param[3] = math.log(3.0)  # sigmoid(log 3) = 3 / 4
    assert mechanisms(model)['gate.1.3'] == pytest.approx(0.75)
    assert mechanisms(LocalityConViT(**NANO, embed_dim=16, num_heads=4, depth=2, local_up_to_layer=0)) is None  # a DeiT


def test_nonlocality_on_probe_images_is_the_papers_eq_8():
    """Uniform attention on a 2 x 2 patch grid (queries and keys zeroed, GPSA's gate shut): from any
    query the keys lie 0, 1, 1 and sqrt(2) patches away, so Eq. 8 gives (2 + sqrt 2) / 4 for every
    head; the plain block after the class token, its class-token column left out, gives the same."""
    from trainers.hooks import mechanisms

    model = LocalityConViT(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=8, num_heads=2, depth=2,
                           local_up_to_layer=1)
    with torch.no_grad():
        model.blocks[0].attn.qk.weight.zero_()
        model.blocks[0].attn.gating_param.fill_(-60.0)  # sigmoid(-60): no positional attention
        model.blocks[1].attn.qkv.weight[:16].zero_()  # q and k
    model.train()
    reported = mechanisms(model, torch.randn(5, 1, 8, 8))
    expected = (2 + math.sqrt(2)) / 4
    assert {k: round(v, 6) for k, v in reported.items() if k.startswith('nonlocality.')} == {
        f'nonlocality.{b}.{h}': round(expected, 6) for b in range(2) for h in range(2)}
    assert model.training  # left as it was
    assert set(mechanisms(model)) == {'gate.0.0', 'gate.0.1'}  # without images: the gates alone
