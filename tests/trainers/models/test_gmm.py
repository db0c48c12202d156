"""GMM family (trainers/models/ls_gmm.py): mask against Algorithm 1, limits, underflow, interface."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import trainers.models  # noqa: F401  (registers ls_gmm_* with timm)
from trainers.models.ls_gmm import GMM_EPS, GMMAttention, LocalityGMMViT, gmm_mask, grid_sq_distances

NANO = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)  # 7 x 7 = 49 patches


def _algorithm1(n: int, alpha: torch.Tensor, sigma: torch.Tensor, eps: float) -> torch.Tensor:
    """Algorithm 1 of the paper, literally (Python loops and math.exp), per head: (H, N, N) float64."""
    side = math.isqrt(n)
    H, K = alpha.shape
    out = torch.zeros(H, n, n, dtype=torch.float64)
    for h in range(H):
        for i in range(n):
            for j in range(n):
                dx = i % side - j % side
                dy = i // side - j // side
                m = 0.0
                for k in range(K):
                    a, s = float(alpha[h, k]), float(sigma[h, k])
                    m += a * math.exp(-(dx * dx + dy * dy) / (2 * s * s + eps))
                out[h, i, j] = m
    return out


def _attention(H: int = 2, dim: int = 12, K: int = 3, seed: int = 0, **kwargs) -> GMMAttention:
    torch.manual_seed(seed)
    return GMMAttention(dim, num_heads=H, num_kernels=K, **kwargs).double()


def _plain_attention(layer: GMMAttention, x: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) from the qkv weights, written out independently of the module."""
    B, N, C = x.shape
    H = layer.num_heads
    d = C // H
    qkv = F.linear(x, layer.qkv.weight, layer.qkv.bias)
    q, k = (qkv[..., i * C:(i + 1) * C].reshape(B, N, H, d).transpose(1, 2) for i in range(2))
    return torch.softmax(torch.einsum('bhnd,bhmd->bhnm', q, k) / math.sqrt(d), dim=-1)


# --- the mask ------------------------------------------------------------------------------------

def test_mask_matches_algorithm1_loop():
    gen = torch.Generator().manual_seed(0)
    alpha = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 2
    sigma = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 2 + 1
    sigma[0, 0] = -1.5  # sign must not matter, sigma only enters as sigma^2
    sigma[1, 2] = 0.0  # "self only" kernel: exp(-d2 / eps)
    ref = _algorithm1(9, alpha, sigma, GMM_EPS)
    ours = gmm_mask(grid_sq_distances((3, 3)), alpha, sigma, GMM_EPS)
    assert ours.shape == (2, 9, 9)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    # float32 parameters: same mask to float32 precision
    ours32 = gmm_mask(grid_sq_distances((3, 3)), alpha.float(), sigma.float(), GMM_EPS)
    assert ours32.dtype == torch.float32
    torch.testing.assert_close(ours32.double(), ref, atol=1e-5, rtol=1e-5)
    # the module uses exactly this function
    layer = _attention(H=2, K=3)
    with torch.no_grad():
        layer.alpha.copy_(alpha)
        layer.sigma.copy_(sigma)
    torch.testing.assert_close(layer.mask((3, 3)), ref, atol=1e-6, rtol=1e-6)


def test_grid_distances_and_cache():
    d2 = grid_sq_distances((4, 4))
    assert d2.shape == (16, 16) and d2[0, 15] == 18 and d2[5, 6] == 1 and torch.all(d2.diagonal() == 0)
    layer = _attention()
    x = torch.randn(2, 16, 12, dtype=torch.float64)
    layer(x)
    assert layer.d2.shape == (16, 16) and 'd2' not in layer.state_dict()
    layer(torch.randn(2, 25, 12, dtype=torch.float64))  # another square grid rebuilds the cache
    assert layer.d2.shape == (25, 25)
    with pytest.raises(ValueError, match='not a square patch grid'):
        layer(torch.randn(2, 10, 12, dtype=torch.float64))


@pytest.mark.parametrize('sigma', [3.5, 6.0, 10.0, 50.0])
def test_mask_on_32x32_grid_does_not_underflow(sigma):
    """d2 reaches 2 * 31^2 = 1922: exp(-1922 / 2) is 0 in float32, so a power of that base (the
    reference code) is 0 for far pairs. The direct exponent stays > 0 and matches float64 math."""
    d2 = grid_sq_distances((32, 32))
    alpha = torch.ones(2, 1)
    sig = torch.full((2, 1), sigma)
    mask = gmm_mask(d2, alpha, sig)  # float32
    assert mask.dtype == torch.float32
    assert torch.all(mask > 0), f'{int((mask == 0).sum())} entries underflowed'
    exact = torch.exp(-d2.double() / (2 * sigma ** 2 + GMM_EPS))
    torch.testing.assert_close(mask.double(), exact.expand_as(mask), rtol=2e-5, atol=0)
    # the power-of-a-base formulation this replaces does underflow (the test can tell them apart)
    power = torch.exp(-d2 / 2) ** (1 / sigma ** 2)
    assert torch.any(power == 0)


def test_negative_and_zero_sigma_are_finite():
    d2 = grid_sq_distances((5, 5))
    alpha = torch.ones(1, 3)
    m = gmm_mask(d2, alpha, torch.tensor([[-2.0, 0.0, 1e-9]]))
    assert torch.isfinite(m).all()
    torch.testing.assert_close(m[0].diagonal(), torch.full((25,), 3.0))
    torch.testing.assert_close(gmm_mask(d2, torch.ones(1, 1), torch.tensor([[-2.0]])),
                               gmm_mask(d2, torch.ones(1, 1), torch.tensor([[2.0]])))


# --- attention limits ----------------------------------------------------------------------------

def test_alpha_zero_gives_uniform_attention():
    layer = _attention(H=3, dim=12, K=2)
    with torch.no_grad():
        layer.alpha.zero_()
    x = torch.randn(2, 16, 12, dtype=torch.float64) * 3
    attn = layer.attention_map(x)
    assert attn.shape == (2, 3, 16, 16)
    torch.testing.assert_close(attn, torch.full_like(attn, 1 / 16), atol=1e-12, rtol=0)
    # and the output is then the mean of the values, projected
    v = F.linear(x, layer.qkv.weight[24:], None if layer.qkv.bias is None else layer.qkv.bias[24:])
    expected = layer.proj(v.mean(dim=1, keepdim=True).expand_as(v))
    torch.testing.assert_close(layer(x), expected)


def test_one_wide_unit_kernel_gives_plain_attention():
    layer = _attention(H=4, dim=16, K=1, qkv_bias=True)
    with torch.no_grad():
        layer.alpha.fill_(1.0)
        layer.sigma.fill_(1e6)
        layer.qkv.weight.normal_(0, 0.5)  # non-trivial scores
    x = torch.randn(3, 25, 16, dtype=torch.float64)
    attn = layer.attention_map(x)
    torch.testing.assert_close(attn, _plain_attention(layer, x), atol=1e-9, rtol=1e-9)
    # the plain module output through the fused kernel, same weights
    B, N, C = x.shape
    q, k, v = layer.qkv(x).reshape(B, N, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
    ref = layer.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))
    torch.testing.assert_close(layer(x), ref, atol=1e-9, rtol=1e-9)
    # and a real mask changes it (the comparison can fail)
    with torch.no_grad():
        layer.sigma.fill_(1.0)
    assert not torch.allclose(layer(x), ref, atol=1e-4)



def test_mask_off_is_plain_attention_with_or_without_the_kernels():
    layer = _attention(H=4, dim=16, K=3, qkv_bias=True, use_mask=False)
    with torch.no_grad():
        layer.qkv.weight.normal_(0, 0.5)
        layer.sigma.fill_(1.0)  # a narrow mask, were it applied
    x = torch.randn(3, 25, 16, dtype=torch.float64)
    torch.testing.assert_close(layer.attention_map(x), _plain_attention(layer, x), atol=1e-12, rtol=1e-12)
    B, N, C = x.shape
    q, k, v = layer.qkv(x).reshape(B, N, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
    ref = layer.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))
    torch.testing.assert_close(layer(x), ref, atol=1e-9, rtol=1e-9)
    # the same weights with the mask on give another output (the comparison can fail)
    layer.use_mask = True
    assert not torch.allclose(layer(x), ref, atol=1e-4)


def test_mask_off_shares_every_other_weight_with_the_masked_model_and_freezes_the_mask():
    args = dict(NANO, embed_dim=32, depth=2, num_heads=4, num_kernels=3, qkv_bias=True)
    torch.manual_seed(5)
    on = LocalityGMMViT(**args)
    torch.manual_seed(5)
    off = LocalityGMMViT(**args, use_mask=False)
    for (name, a), (_, b) in zip(on.named_parameters(), off.named_parameters()):
        assert torch.equal(a, b), name  # one seed: both arms start from the same weights
    frozen = {n for n, p in off.named_parameters() if not p.requires_grad}
    assert frozen == {f'blocks.{i}.attn.{w}' for i in range(2) for w in ('alpha', 'sigma')}
    grouped = {id(p) for g in off.param_groups(0.05) for p in g['params']}
    assert grouped == {id(p) for n, p in off.named_parameters() if n not in frozen}
    off(torch.randn(2, 1, 28, 28)).logsumexp(-1).sum().backward()
    assert all(p.grad is None for n, p in off.named_parameters() if n in frozen)
    tokens = torch.randn(2, 49, 32) * 10  # and the mask is what differs (the residual hides it at init)
    assert not torch.allclose(on.blocks[0].attn.attention_map(tokens), off.blocks[0].attn.attention_map(tokens),
                              atol=1e-3)


def test_rows_sum_to_one_and_mask_gradients():
    layer = _attention(H=2, dim=12, K=3, qkv_bias=True)
    with torch.no_grad():
        layer.qkv.weight.normal_(0, 0.5)
    x = torch.randn(2, 16, 12, dtype=torch.float64)
    attn = layer.attention_map(x)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 2, 16, dtype=torch.float64))
    layer(x).square().sum().backward()
    for p in (layer.alpha, layer.sigma):
        assert p.grad is not None and torch.isfinite(p.grad).all() and torch.all(p.grad != 0)


def test_init_distribution():
    torch.manual_seed(0)
    layer = GMMAttention(64, num_heads=64, num_kernels=64)  # 4096 draws each
    assert abs(layer.alpha.mean().item() - 0.0) < 0.15 and abs(layer.alpha.std().item() - 2.0) < 0.15
    assert abs(layer.sigma.mean().item() - 10.0) < 0.6 and abs(layer.sigma.std().item() - 10.0) < 0.6
    torch.manual_seed(0)
    m = LocalityGMMViT(**NANO, embed_dim=8, depth=1, num_heads=2, num_kernels=4, alpha_init_mean=1.0,
                       alpha_init_std=0.0, sigma_init_mean=3.0, sigma_init_std=0.0)
    assert torch.all(m.blocks[0].attn.alpha == 1.0) and torch.all(m.blocks[0].attn.sigma == 3.0)


# --- model ---------------------------------------------------------------------------------------

def test_every_registered_variant_builds():
    names = timm.list_models('ls_gmm_*')
    assert set(names) >= {'ls_gmm_nano', 'ls_gmm_micro', 'ls_gmm_tiny', 'ls_gmm_small'}
    for name in names:
        m = timm.create_model(name)
        assert isinstance(m, LocalityGMMViT) and m.family == 'gmm'
        assert all(b.attn.alpha.shape == (b.attn.num_heads, m.num_kernels) for b in m.blocks)
    tiny = timm.create_model('ls_gmm_tiny')
    assert (tiny.embed_dim, len(tiny.blocks), tiny.blocks[0].attn.num_heads, tiny.num_kernels) == (192, 12, 3, 5)
    assert tiny.grid_size == (14, 14)
    micro = timm.create_model('ls_gmm_micro', num_kernels=4, drop_path_rate=0.1)
    assert micro.num_kernels == 4 and micro.embed_dim == 96


def test_nano_forward_backward_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    m = timm.create_model('ls_gmm_nano', qkv_bias=True)
    assert m.pretrained_cfg['mean'] == (0.2860,)
    x = torch.randn(4, 1, 28, 28)
    out = m(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_no_pos_embed_and_other_grid():
    m = LocalityGMMViT(img_size=32, patch_size=4, in_chans=3, num_classes=5, embed_dim=16, depth=1,
                       num_heads=2, num_kernels=1, use_pos_embed=False)
    assert m.pos_embed is None and m(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    assert m.blocks[0].attn.d2.shape == (64, 64)


@pytest.mark.parametrize('mask_wd', [False, True])
def test_param_groups_cover_every_parameter_once(mask_wd):
    m = timm.create_model('ls_gmm_nano', qkv_bias=True, mask_weight_decay=mask_wd)
    groups = m.param_groups(0.05)
    ids = [id(p) for g in groups for p in g['params']]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert all(set(g) == {'params', 'weight_decay', 'lr_scale'} and g['lr_scale'] == 1.0 for g in groups)
    wd = {id(p): g['weight_decay'] for g in groups for p in g['params']}
    for name, p in m.named_parameters():
        if name.endswith(('attn.alpha', 'attn.sigma')):
            assert wd[id(p)] == (0.05 if mask_wd else 0.0), name
        elif p.ndim <= 1 or name == 'pos_embed':
            assert wd[id(p)] == 0.0, name
        else:
            assert wd[id(p)] == 0.05, name
    assert ('blocks.0.attn.alpha' in m.no_weight_decay()) == (not mask_wd)


@pytest.mark.parametrize('kwargs, arg', [
    (dict(num_kernels=0), 'num_kernels'),
    (dict(embed_dim=30), 'embed_dim'),
    (dict(patch_size=5), 'img_size'),
    (dict(alpha_init_std=-1.0), 'alpha_init_std'),
    (dict(sigma_init_std=float('nan')), 'sigma_init_std'),
    (dict(mask_weight_decay=1), 'mask_weight_decay'),
    (dict(drop_rate=1.0), 'drop_rate'),
    (dict(qkv_bias=1), 'qkv_bias'),
    (dict(use_pos_embed='no'), 'use_pos_embed'),
    (dict(use_mask=0), 'use_mask'),
])
def test_bad_arguments_name_the_argument(kwargs, arg):
    base = dict(NANO, embed_dim=32, depth=1, num_heads=4, num_kernels=2)
    with pytest.raises(ValueError, match=arg):
        LocalityGMMViT(**dict(base, **kwargs))
    with pytest.raises(ValueError, match='weight_decay'):
        LocalityGMMViT(**base).param_groups(-0.1)


def test_the_kernel_widths_are_reported_as_mechanisms_and_none_with_the_mask_off():
    from trainers.hooks import ReportsMechanisms, mechanisms

    torch.manual_seed(0)
    m = LocalityGMMViT(**NANO, embed_dim=8, depth=2, num_heads=2, num_kernels=3)
    with torch.no_grad():
        m.blocks[1].attn.sigma[1, 2] = -4.0  # the mask is even in sigma: its width is 4
    widths = mechanisms(m)
    assert isinstance(m, ReportsMechanisms) and len(widths) == 2 * 2 * 3
    assert widths['sigma.1.1.2'] == 4.0
    assert widths['sigma.0.1.0'] == pytest.approx(abs(float(m.blocks[0].attn.sigma[1, 0])))
    assert mechanisms(LocalityGMMViT(**NANO, embed_dim=8, depth=1, num_heads=2, use_mask=False)) is None
    assert mechanisms(torch.nn.Linear(2, 2)) is None  # a model without the hook
