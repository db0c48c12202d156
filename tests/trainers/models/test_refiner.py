"""Refiner family (trainers/models/ls_refiner.py): identity, dense-conv equivalence, DLA form, interface."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import trainers.models  # noqa: F401  (registers ls_refiner_* with timm)
from trainers.models.ls_refiner import LocalityRefinerViT, RefinedAttention, Refiner
from trainers.throughput import count_flops

from tests._layers import float32_kernel_or_skip, run_layer

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
    (differentiable); the prefix (class-token) key columns mixed by R @ E, not convolved."""
    B, H, Q, N = a.shape
    (gh, gw), k, P = refiner.grid_size, refiner.kernel_size, refiner.num_prefix_tokens
    E, C, R = refiner.expand, refiner.kernel, refiner.reduce
    w_dense = torch.einsum('oe,eab,ei->oiab', R, C, E)  # (H, H, k, k)
    patches = a[..., P:].permute(0, 2, 1, 3).reshape(B * Q, H, gh, gw)  # (B*Q, H, h, w)
    conv = F.conv2d(patches, w_dense, padding=k // 2).reshape(B, Q, H, gh * gw).permute(0, 2, 1, 3)
    prefix = torch.einsum('oi,biqp->boqp', R @ E, a[..., :P])
    return torch.cat((prefix, conv), dim=-1)


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
    # on the float32 kernel where its multiply-adds are a quarter of the composed operator's or fewer
    assert Refiner(4, 2, 3, (7, 7)).choose_path(49, on_kernel=True) == 'kernel'  # 4 * 8 * 17 <= 16 * 50
    assert Refiner(4, 3, 3, (7, 7)).choose_path(49, on_kernel=True) == 'dense'  # 4 * 12 * 17 > 16 * 50
    assert Refiner(4, 2, 5, (7, 7)).choose_path(49, on_kernel=True) == 'dense'  # 4 * 8 * 33 > 16 * 50
    assert Refiner(3, 3, 3, (14, 14)).choose_path(196, on_kernel=True) == 'kernel'
    assert Refiner(4, 6, 1, (7, 7)).choose_path(49, on_kernel=True) == 'mix'
    # against the bf16 GEMMs of the torch paths under CPU autocast: the same rule for the forward
    # alone, an eighth for forward + backward
    low = dict(on_kernel=True, low_precision_gemms=True)
    assert Refiner(4, 2, 3, (7, 7)).choose_path(49, backward=False, **low) == 'kernel'
    assert Refiner(4, 1, 3, (7, 7)).choose_path(49, **low) == 'kernel'  # 8 * 4 * 17 <= 16 * 50
    assert Refiner(4, 2, 3, (7, 7)).choose_path(49, **low) == 'dense'  # 8 * 8 * 17 > 16 * 50
    # large grids, where the torch path would be the depthwise conv2d: the kernel whatever r
    assert Refiner(3, 12, 3, (14, 14)).choose_path(196, on_kernel=True) == 'kernel'  # 4 * 36 * 15 > 9 * 197
    assert Refiner(3, 6, 3, (14, 14)).choose_path(196, **low) == 'kernel'
    assert Refiner(3, 12, 3, (14, 14)).choose_path(196) == 'conv'


# H, ratio, k, grid, prefix keys: k = 3 (compiled for it) and any odd k (5; 7 on a 3 x 3 grid, whose
# taps reach past every border), grids whose patch count leaves a vector tail, no prefix key
_KERNEL_SHAPES = [(4, 2, 3, (7, 7), 1), (3, 3, 5, (4, 6), 1), (2, 1, 3, (5, 4), 0), (3, 2, 3, (14, 14), 1),
                  (2, 2, 7, (3, 3), 2), (1, 1, 3, (1, 9), 1)]


@pytest.mark.parametrize('H, ratio, k, grid, prefix', _KERNEL_SHAPES)
def test_the_float32_kernel_matches_the_dense_conv_in_float64(H, ratio, k, grid, prefix):
    """The fused per-row pass (csrc/refiner_fp32.h): maps and every gradient as the float64 reference."""
    float32_kernel_or_skip()
    ref64 = _randomise(Refiner(H, ratio, k, grid, num_prefix_tokens=prefix).double(), seed=H + k)
    ref32 = Refiner(H, ratio, k, grid, num_prefix_tokens=prefix)
    ref32.load_state_dict(ref64.state_dict())
    gh, gw = grid
    B, N = 3, prefix + gh * gw
    a64 = _random_maps(B, H, N, seed=1).requires_grad_()
    a32 = a64.detach().float().requires_grad_()
    assert ref32._kernel_usable(a32)
    ref32.force_path = 'kernel'  # whether or not `choose_path` would take it for this shape
    expected, got = _reference_refine(ref64, a64), ref32(a32)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected.detach(), atol=2e-6 * scale, rtol=0)
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads64 = torch.autograd.grad(expected, (a64, ref64.expand, ref64.kernel, ref64.reduce), upstream)
    grads32 = torch.autograd.grad(got, (a32, ref32.expand, ref32.kernel, ref32.reduce), upstream.float())
    for name, g32, g64 in zip(('maps', 'expand', 'kernel', 'reduce'), grads32, grads64):
        torch.testing.assert_close(g32.double(), g64, atol=5e-6 * g64.abs().max().item(), rtol=0, msg=name)


def test_the_kernels_weight_gradients_do_not_depend_on_the_thread_count():
    """Summed per fixed chunk of rows, then over the chunks in order: the same bits on 1 or 2 threads."""
    ops = float32_kernel_or_skip()
    gen = torch.Generator().manual_seed(0)
    H, eh, k = 4, 8, 3
    maps, d_out = torch.rand(H, 1000, 50, generator=gen), torch.randn(H, 1000, 50, generator=gen)
    weights = (torch.randn(eh, H, generator=gen), torch.randn(eh, k, k, generator=gen), torch.randn(H, eh, generator=gen))
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(ops.refine_backward(d_out, maps, *weights, 7, 7))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_the_kernel_refuses_bad_inputs_with_a_message():
    ops = float32_kernel_or_skip()
    maps = torch.rand(4, 10, 50)
    E, C, R = torch.randn(8, 4), torch.randn(8, 3, 3), torch.randn(4, 8)
    for args, message in [((maps.double(), E, C, R, 7, 7), 'maps: a contiguous'),
                          ((maps, E[:, :3], C, R, 7, 7), 'expand: \\(rH, H\\)'),
                          ((maps, E, torch.randn(8, 2, 2), R, 7, 7), 'k odd'),
                          ((maps, E, C, R.T.contiguous(), 7, 7), 'reduce: \\(H, rH\\)'),
                          ((maps, E, C, R, 8, 7), 'grid: h \\* w <= N')]:
        with pytest.raises(RuntimeError, match=message):
            ops.refine_forward(*args)


class _RefineOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the float32 kernel's refine ops."""

    def __enter__(self):
        self.calls = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == 'locality_search_fp32' and func.overloadpacket.__name__.startswith('refine'):
            self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('ratio, train, on_kernel', [(2, False, True), (1, True, True), (2, True, False)])
def test_under_bf16_autocast_the_maps_go_to_the_kernel_in_float32_where_the_rule_takes_it(ratio, train, on_kernel):
    """RefinedAttention under CPU bf16 autocast: where `takes_float32_maps` (the kernel against bf16
    GEMMs: r <= 2 for the forward alone on 7 x 7, r = 1 for forward + backward) the softmax writes
    float32 maps and the float32 kernel refines them; elsewhere bf16 maps on torch ops. Either way the
    output and gradients are as close to the float64 layer's as bf16 allows, the float32 maps no
    less close than the bf16 ones."""
    import copy

    float32_kernel_or_skip()
    torch.manual_seed(0)
    layer = RefinedAttention(32, 4, (7, 7), ratio=ratio, kernel_size=3)
    _randomise(layer.refiner)
    x = torch.randn(3, 50, 32)
    upstream = torch.randn(3, 50, 32)

    def run(module, dtype, bf16):
        return run_layer(module, x, dtype=dtype, bf16=bf16, train=train, upstream=upstream)

    reference = run(copy.deepcopy(layer).double(), torch.float64, False)
    assert layer.refiner.takes_float32_maps(x.device, backward=train) == on_kernel
    with _RefineOps() as recorder:
        got = run(layer, torch.float32, True)
    assert recorder.calls == ((['refine_forward', 'refine_backward'] if train else ['refine_forward'])
                              if on_kernel else [])
    original = Refiner.takes_float32_maps
    try:  # the same layer handing bf16 maps to the torch paths
        Refiner.takes_float32_maps = lambda self, device, *, backward: False
        bf16_maps = run(layer, torch.float32, True)
    finally:
        Refiner.takes_float32_maps = original
    for a, b, ref in zip(got, bf16_maps, reference):
        error, bf16_error = ((t.double() - ref).abs().max().item() / ref.abs().max().item() for t in (a, b))
        assert error < 3e-2 and (error < 1.5 * bf16_error + 1e-3 if on_kernel else error == bf16_error)


def test_flops_count_what_the_kernel_computes(kernel_backends):
    """`count_flops` (the trials' `flops` column) counts the kernel's multiply-adds: expand, k x k taps
    per patch key, reduce, per query row, in each refined block, in place of the torch path's GEMMs."""
    float32_kernel_or_skip()
    model = timm.create_model('ls_refiner_nano', **NANO)
    refiner = model.blocks[0].attn.refiner
    kernel_backends(libraries=False)
    on_torch_ops, torch_path = count_flops(model, (1, 28, 28)), refiner.choose_path(49, backward=False)
    kernel_backends(libraries=True)
    on_kernel = count_flops(model, (1, 28, 28))
    H, eh, k, N, patches = refiner.num_heads, refiner.expanded_heads, refiner.kernel_size, 50, 49
    rows = N  # one image: a query row per token
    refined = sum(block.use_refiner for block in model.blocks)
    per_block_kernel = 2 * rows * (eh * H * N + eh * k * k * patches + H * eh * N)
    assert torch_path == 'matmul'  # what the torch path counted: expand, the banded (N, N) GEMM, reduce
    per_block_torch = 2 * rows * (eh * H * N + eh * N * N + H * eh * N)
    assert on_torch_ops - on_kernel == refined * (per_block_torch - per_block_kernel)


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
