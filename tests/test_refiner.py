"""Refiner family (trainers/models/ls_refiner.py): identity, dense-conv equivalence, DLA form, interface."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import trainers.models  # noqa: F401  (registers ls_refiner_* with timm)
from trainers.models.ls_refiner import LocalityRefinerViT, RefinedAttention, Refiner

NANO = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)  # 7 x 7 = 49 patches


def _random_maps(B: int, H: int, N: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, N, generator=gen, dtype=torch.float64).softmax(-1)


def _randomise(refiner: Refiner, seed: int = 0) -> Refiner:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in refiner.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return refiner


def _reference_refine(refiner: Refiner, a: torch.Tensor) -> torch.Tensor:
    """The refiner as one dense H -> H conv over the key grid per query row, composed here from E, C, R
    (differentiable); the class-token key column mixed by R @ E, not convolved."""
    B, H, N, _ = a.shape
    (gh, gw), k = refiner.grid_size, refiner.kernel_size
    E, C, R = refiner.expand, refiner.kernel, refiner.reduce
    w_dense = torch.einsum('oe,eab,ei->oiab', R, C, E)  # (H, H, k, k)
    patches = a[..., 1:].permute(0, 2, 1, 3).reshape(B * N, H, gh, gw)  # (B*N, H, h, w)
    conv = F.conv2d(patches, w_dense, padding=k // 2).reshape(B, N, H, gh * gw).permute(0, 2, 1, 3)
    cls = torch.einsum('oi,bin->bon', R @ E, a[..., 0]).unsqueeze(-1)
    return torch.cat((cls, conv), dim=-1)


# --- exactness ----------------------------------------------------------------------------------

def test_identity_refiner_gives_plain_softmax_attention():
    torch.manual_seed(0)
    dim, H, grid = 24, 4, (3, 5)  # non-square grid: catches a transposed reshape
    attn = RefinedAttention(dim, H, grid, qkv_bias=True, ratio=1, kernel_size=3).double()
    with torch.no_grad():  # identity by assignment, not via identity_()
        attn.refiner.expand.copy_(torch.eye(H))
        attn.refiner.reduce.copy_(torch.eye(H))
        attn.refiner.kernel.zero_()
        attn.refiner.kernel[:, 1, 1] = 1.
    x = torch.randn(2, 1 + 15, dim, dtype=torch.float64)
    # independent plain attention
    B, N, C = x.shape
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // H), dim=-1)
    ref = attn.proj((a @ v).transpose(1, 2).reshape(B, N, C))
    torch.testing.assert_close(attn(x), ref, atol=1e-6, rtol=0)
    # and it is not the identity once the kernel is moved
    with torch.no_grad():
        attn.refiner.kernel[:, 0, 1] = 0.5
    assert (attn(x) - ref).abs().max() > 1e-3


@pytest.mark.parametrize('path', ['matmul', 'conv', 'dense'])
def test_refined_attention_matches_the_explicit_formula(path):
    """The layer (heads-first internally) equals softmax maps -> reference refiner -> @ V -> proj."""
    torch.manual_seed(0)
    dim, H, grid = 24, 4, (3, 5)
    attn = RefinedAttention(dim, H, grid, qkv_bias=True, ratio=2, kernel_size=3).double()
    _randomise(attn.refiner, seed=5).force_path = path
    x = torch.randn(3, 1 + 15, dim, dtype=torch.float64)
    B, N, C = x.shape
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
    a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // H), dim=-1)  # (B, H, N, N)
    expected = attn.proj((_reference_refine(attn.refiner, a) @ v).transpose(1, 2).reshape(B, N, C))
    torch.testing.assert_close(attn(x), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize('ratio', [1, 2, 3])
def test_identity_method_is_exact_for_any_ratio(ratio):
    ref = Refiner(3, ratio, 5, (4, 4)).double().identity_()
    a = _random_maps(2, 3, 17)
    torch.testing.assert_close(ref(a), a, atol=1e-12, rtol=0)
    init = Refiner(3, ratio, 3, (4, 4)).double()  # default init: close to, not exactly, the identity
    assert 0 < (init(a) - a).abs().max() < 0.3


_SHAPES = [(4, 2, 3, (5, 4)), (3, 3, 5, (4, 4)), (2, 1, 1, (3, 3)), (2, 3, 1, (2, 3))]  # H, ratio, k, grid


@pytest.mark.parametrize('H, ratio, k, grid, path', [
    (*shape, path) for shape in _SHAPES for path in ('matmul', 'conv', 'dense', 'mix')
    if path != 'mix' or shape[2] == 1])  # 'mix' is the k = 1 path
def test_expand_conv_reduce_equals_one_dense_conv(H, ratio, k, grid, path):
    refiner = _randomise(Refiner(H, ratio, k, grid).double(), seed=H + k)
    refiner.force_path = path
    gh, gw = grid
    B, N = 2, 1 + gh * gw
    a = _random_maps(B, H, N, seed=1).requires_grad_()
    E, C, R = refiner.expand, refiner.kernel, refiner.reduce
    expected = _reference_refine(refiner, a)
    got = refiner(a)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(refiner.dense_kernel(), torch.einsum('oe,eab,ei->oiab', R, C, E))
    # and the same gradients, for the maps and for every refiner weight
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs = (a, E, C, R)
    for g_got, g_expected in zip(torch.autograd.grad(got, inputs, upstream),
                                 torch.autograd.grad(expected, inputs, upstream)):
        torch.testing.assert_close(g_got, g_expected, atol=1e-10, rtol=1e-10)


def test_default_path_choice():
    assert Refiner(4, 1, 3, (7, 7)).choose_path(49) == 'matmul'  # small grid, small r: banded matrices
    assert Refiner(4, 2, 3, (7, 7)).choose_path(49) == 'dense'  # r large enough: the composed operator
    assert Refiner(4, 2, 3, (7, 7)).choose_path(49, backward=False) == 'matmul'  # forward alone: later
    assert Refiner(4, 3, 3, (7, 7)).choose_path(49, backward=False) == 'dense'
    assert Refiner(3, 1, 3, (14, 14)).choose_path(196) == 'conv'  # large grid: depthwise conv2d
    assert Refiner(3, 6, 3, (14, 14)).choose_path(196) == 'conv'
    assert Refiner(4, 6, 1, (7, 7)).choose_path(49) == 'mix'  # 1 x 1 kernels: one H x H mixing


@pytest.mark.parametrize('path', ['matmul', 'conv', 'dense'])
def test_refined_map_times_v_is_distributed_local_attention(path):
    """sum_j A*[i, j] v_j == sum_offsets w[o] * sum_j A[i, j + o] v_j, written with explicit loops."""
    gh, gw, k, d = 4, 3, 3, 5
    refiner = Refiner(1, 1, k, (gh, gw)).double()
    refiner.force_path = path
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        refiner.expand.fill_(1.)
        refiner.reduce.fill_(1.)
        refiner.kernel.copy_(torch.randn(1, k, k, generator=gen, dtype=torch.float64))
    N = 1 + gh * gw
    a = _random_maps(1, 1, N, seed=4)
    v = torch.randn(N, d, generator=gen, dtype=torch.float64)
    got = (refiner(a)[0, 0] @ v)  # (N, d)
    w, A, c = refiner.kernel[0].detach(), a[0, 0], k // 2
    expected = torch.zeros(N, d, dtype=torch.float64)
    for i in range(N):
        expected[i] += A[i, 0] * v[0]  # class-token key: not convolved
        for dy in range(-c, c + 1):
            for dx in range(-c, c + 1):
                for y in range(gh):
                    for x in range(gw):
                        ys, xs = y + dy, x + dx  # key j + o
                        if 0 <= ys < gh and 0 <= xs < gw:  # zero padding outside the grid
                            expected[i] += w[dy + c, dx + c] * A[i, 1 + ys * gw + xs] * v[1 + y * gw + x]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


# --- model interface ----------------------------------------------------------------------------

def _variants():
    return sorted(timm.list_models('ls_refiner_*'))


def test_every_registered_variant_builds():
    names = _variants()
    assert {'ls_refiner_nano', 'ls_refiner_micro', 'ls_refiner_tiny', 'ls_refiner_small'} <= set(names)
    for name in names:
        with torch.device('meta'):  # no memory or init cost for the 224 px ones
            model = timm.create_model(name)
        assert isinstance(model, LocalityRefinerViT) and model.family == 'refiner'
        assert model.refiner_blocks == len(model.blocks)
        assert model.pretrained_cfg['input_size'][1:] == tuple(s * p for s, p in zip(
            model.grid_size, model.patch_embed.patch_size))


def test_nano_forward_backward_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = timm.create_model('ls_refiner_nano')
    assert model.pretrained_cfg['mean'] == (0.2860,)
    x = torch.randn(4, 1, 28, 28)
    out = model(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    refiner_params = [n for n, _ in model.named_parameters() if '.refiner.' in n]
    assert len(refiner_params) == 3 * 2
    shapes = {n.rsplit('.', 1)[-1]: p.shape for n, p in model.named_parameters() if '.refiner.' in n}
    assert shapes == {'expand': (8, 4), 'kernel': (8, 3, 3), 'reduce': (4, 8)}


def test_refiner_blocks_zero_is_plain_deit_and_partial_counts():
    model = timm.create_model('ls_refiner_nano', refiner_blocks=0)
    assert not [n for n, _ in model.named_parameters() if 'refiner' in n]
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    one = timm.create_model('ls_refiner_nano', refiner_blocks=1)
    assert [b.use_refiner for b in one.blocks] == [True, False]


def test_identity_refiners_equal_the_plain_deit():
    torch.manual_seed(0)
    refined = timm.create_model('ls_refiner_nano').double().eval()
    plain = timm.create_model('ls_refiner_nano', refiner_blocks=0).double().eval()
    plain.load_state_dict({k: v for k, v in refined.state_dict().items() if 'refiner' not in k})
    for m in refined.modules():
        if isinstance(m, Refiner):
            m.identity_()
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(refined(x), plain(x), atol=1e-10, rtol=0)


def test_param_groups_cover_every_parameter_exactly_once():
    model = timm.create_model('ls_refiner_nano')
    groups = model.param_groups(0.05)
    ids = [id(p) for g in groups for p in g['params']]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(set(g) == {'params', 'weight_decay', 'lr_scale'} and g['lr_scale'] == 1.0 for g in groups)
    no_decay = {id(p) for g in groups if g['weight_decay'] == 0.0 for p in g['params']}
    named = dict(model.named_parameters())
    for name in ('cls_token', 'pos_embed', 'blocks.0.attn.refiner.kernel', 'blocks.0.norm1.weight', 'head.bias'):
        assert id(named[name]) in no_decay, name
    assert id(named['blocks.0.attn.qkv.weight']) not in no_decay
    with pytest.raises(ValueError, match='weight_decay'):
        model.param_groups(-1.0)


def test_create_model_passes_kwargs_and_non_square_images():
    model = LocalityRefinerViT(img_size=(16, 28), patch_size=4, in_chans=1, num_classes=3, embed_dim=16,
                               depth=1, num_heads=2, refiner_ratio=2, refiner_kernel=5)
    assert model.grid_size == (4, 7)
    assert model(torch.randn(2, 1, 16, 28)).shape == (2, 3)
    m = timm.create_model('ls_refiner_nano', refiner_kernel=5, refiner_ratio=1, use_pos_embed=False)
    assert m.pos_embed is None and m.blocks[0].attn.refiner.kernel.shape == (4, 5, 5)


@pytest.mark.parametrize('kwargs, arg', [
    (dict(refiner_ratio=0), 'refiner_ratio'),
    (dict(refiner_ratio=1.5), 'refiner_ratio'),
    (dict(refiner_kernel=4), 'refiner_kernel'),
    (dict(refiner_kernel=0), 'refiner_kernel'),
    (dict(refiner_kernel=15), 'refiner_kernel'),
    (dict(refiner_blocks=3), 'refiner_blocks'),
    (dict(refiner_blocks=-1), 'refiner_blocks'),
    (dict(embed_dim=30), 'embed_dim'),
    (dict(patch_size=5), 'img_size'),
    (dict(drop_rate=1.0), 'drop_rate'),
    (dict(qkv_bias=1), 'qkv_bias'),
    (dict(use_pos_embed='no'), 'use_pos_embed'),
])
def test_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        LocalityRefinerViT(**{**NANO, **dict(embed_dim=32, depth=2, num_heads=4), **kwargs})
