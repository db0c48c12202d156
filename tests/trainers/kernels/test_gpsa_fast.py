"""GPSA's CPU core under reduced precision (bf16 / fp16 autocast, or bf16 tensors): against timm under
the same autocast and against a float64 reference; the eval-mode positional cache under autocast.

The core's batched GEMMs run in bf16 on a CPU with bf16 hardware and in float32 elsewhere
(`trainers._cpu.cpu_has_native_bf16`); the `native_bf16` fixture forces each choice, so both are
checked on any machine (oneDNN emulates bf16 where the hardware lacks it: slower, same numbers).
The same core runs ConViT's plain attention blocks (`MHSA`) where the GEMMs are bf16: tested here
too (and in float32 on the float32 kernel: `test_attention_kernel.py`)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from timm.models.convit import GPSA as TimmGPSA
from timm.models.convit import ConVit as TimmConVit

import trainers.models  # noqa: F401  (registers ls_convit_* with timm)
import trainers.models.ls_convit as ls_convit
from trainers.kernels import _attention_core, _gpsa
from trainers.kernels._attention_core import explicit_core_attention, gated_attention
from trainers.models.ls_convit import GPSA, MHSA, LocalityConViT

NANO = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)


def _perturb(module: torch.nn.Module, scale: float, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _pair(dim=96, heads=4, seed=0):
    torch.manual_seed(seed)
    ref = TimmGPSA(dim, num_heads=heads)
    ref.local_init()
    _perturb(ref, 0.05, seed)
    ours = GPSA(dim, num_heads=heads)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _run(layer, x, w, dtype):
    """output (float64) and gradients (x and parameters, float64) of (layer(x) * w).sum()."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    ctx = torch.autocast('cpu', dtype=dtype) if dtype is not None else torch.autocast('cpu', enabled=False)
    with ctx:
        y = layer(x)
    (y.double() * w).sum().backward()
    return y, x.grad.double(), {n: p.grad.double() for n, p in layer.named_parameters()}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(params=[False, True], ids=['gemms_fp32', 'gemms_bf16'])
def native_bf16(request, monkeypatch, kernel_backends):
    """Run the test as on a CPU without (False) and with (True) bf16 hardware, the core on its torch
    ops (the fused kernel that replaces them with bf16 GEMMs: tests/trainers/kernels/test_attention_kernel.py)."""
    monkeypatch.setattr(_attention_core, 'cpu_has_native_bf16', lambda: request.param)
    kernel_backends(libraries=False)
    return request.param


class _GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every batched GEMM (bmm, baddbmm) dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.seen.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_gpsa_under_autocast_matches_timm_under_autocast(dtype, native_bf16):
    ref, ours = _pair()
    exact = copy.deepcopy(ref).double()
    x = torch.randn(8, 49, 96)
    w = torch.randn(8, 49, 96, dtype=torch.float64)
    assert _gpsa.takes_cpu_core(x)  # the CPU core under autocast, not the fused fallback
    y_ref, gx_ref, gp_ref = _run(ref, x, w, dtype)
    y_ours, gx_ours, gp_ours = _run(ours, x, w, dtype)
    y_64, gx_64, gp_64 = _run(exact, x.double(), w, None)
    assert y_ours.dtype == y_ref.dtype == dtype  # autocast's output dtype, as timm
    # bf16 rounds to 2^-9 relative, fp16 to 2^-12: compare against timm and against float64
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    assert _rel(y_ours.double(), y_ref.double()) < tol
    assert _rel(y_ours.double(), y_64) < tol
    assert torch.isfinite(gx_ours).all()
    assert _rel(gx_ours, gx_ref) < tol and _rel(gx_ours, gx_64) < tol
    for name, g in gp_ours.items():
        assert torch.isfinite(g).all(), name
        assert g.dtype == torch.float64 and ours.get_parameter(name).grad.dtype == torch.float32, name
        if name == 'pos_proj.bias':  # its true gradient is 0 (softmax ignores a per-head shift)
            assert g.abs().max() < 1e-2 * gp_64['pos_proj.weight'].abs().max()
            continue
        assert _rel(g, gp_64[name]) < 2 * tol, name
        assert _rel(g, gp_ref[name]) < 2 * tol, name
    # not worse than timm's own reduced-precision error (with slack for rounding luck)
    assert _rel(y_ours.double(), y_64) < 2 * _rel(y_ref.double(), y_64) + 1e-3
    assert _rel(gx_ours, gx_64) < 2 * _rel(gx_ref, gx_64) + 1e-3


def test_gpsa_under_autocast_inference_matches_training_path(native_bf16):
    ref, ours = _pair(seed=1)
    x = torch.randn(4, 49, 96)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y_grad = ours(x.requires_grad_())  # the autograd function
        with torch.inference_mode():
            y_inf = ours.eval()(x.detach())  # the no-grad core (and the cached P)
            y_inf2 = ours(x.detach())
    # the same core (in float32: lerp vs addcmul, float32 rounding), then one bf16 rounding: an ulp apart
    torch.testing.assert_close(y_inf, y_grad.detach(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(y_inf2, y_inf, rtol=0, atol=0)  # the cached P gives the same numbers


def test_gated_attention_bfloat16_inputs(native_bf16):
    """bf16 qkv (as an autocast linear writes it): the GEMMs in bf16 with bf16 hardware, else in
    float32; softmax and mixing in float32 either way; the gradient back in qkv's dtype and layout."""
    gen = torch.Generator().manual_seed(0)
    B, H, N, d = 3, 4, 16, 8
    qkv = torch.randn(B, N, 3, H, d, generator=gen).bfloat16().permute(2, 0, 3, 1, 4)  # as the linear writes it
    gate = torch.sigmoid(torch.randn(H, generator=gen))
    pos = torch.softmax(torch.randn(H, N, N, generator=gen), -1)
    w = torch.randn(B, H, N, d, generator=gen)
    # reference: the same formula in float32 on the bf16-rounded inputs, autograd through it
    q32 = qkv.float().detach().requires_grad_()
    g32, p32 = gate.clone().requires_grad_(), pos.clone().requires_grad_()
    q, k, v = q32
    soft = torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1)
    attn = (1 - g32.view(-1, 1, 1)) * soft + g32.view(-1, 1, 1) * p32
    y_ref = attn @ v
    (y_ref * w).sum().backward()

    x = qkv.detach().requires_grad_()
    g, p = gate.clone().requires_grad_(), pos.clone().requires_grad_()
    with _GemmDtypes() as gemms:
        y = gated_attention(x, g, p, 0.3)
        (y.float() * w).sum().backward()
    assert gemms.seen == ({torch.bfloat16} if native_bf16 else {torch.float32})
    assert y.dtype == torch.bfloat16 and y.shape == (B, H, N, d)
    if native_bf16:  # the scores and A rounded to bf16 before their GEMMs (as autocast's matmuls)
        with torch.no_grad():
            scores = (q @ k.transpose(-2, -1) * 0.3).bfloat16().float()
            attn_bf16 = ((1 - gate.view(-1, 1, 1)) * torch.softmax(scores, -1) + gate.view(-1, 1, 1) * pos).bfloat16()
            y_bf16 = attn_bf16.float() @ v
        torch.testing.assert_close(y.float(), y_bf16.bfloat16().float(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(y.float(), y_ref.bfloat16().float(), rtol=0, atol=0.02)
    assert x.grad.dtype == torch.bfloat16 and g.grad.dtype == p.grad.dtype == torch.float32
    # the gradient that reaches the core is the bf16-rounded w: compare against that
    torch.testing.assert_close(x.grad.float(), q32.grad, rtol=2e-2, atol=2e-2 * q32.grad.abs().max().item())
    torch.testing.assert_close(g.grad, g32.grad, rtol=2e-2, atol=2e-2 * g32.grad.abs().max().item())
    torch.testing.assert_close(p.grad, p32.grad, rtol=2e-2, atol=2e-2 * p32.grad.abs().max().item())
    # the core's own qkv gradient (a non-leaf input: autograd hands it over as returned) comes laid
    # out as the linear's output (B, N, 3, H, d), so the linear's backward reads it without a copy
    linear_out = qkv.permute(1, 3, 0, 2, 4).detach().requires_grad_()
    as_core_input = linear_out.permute(2, 0, 3, 1, 4)
    d_core_input, = torch.autograd.grad(gated_attention(as_core_input, gate, pos, 0.3).float().sum(), as_core_input)
    assert d_core_input.stride() == as_core_input.stride() and d_core_input.dtype == torch.bfloat16
    with torch.no_grad(), _GemmDtypes() as gemms:  # the inference core: the same numbers
        torch.testing.assert_close(gated_attention(qkv, gate, pos, 0.3), y.detach(), rtol=0, atol=0)
    assert gemms.seen == ({torch.bfloat16} if native_bf16 else {torch.float32})


def test_plain_attention_core_bfloat16_inputs(native_bf16):
    """`attention`, the core without a positional term (plain attention where the GEMMs are bf16):
    against the float32 formula; the gradient in qkv's dtype and layout; inference the same numbers."""
    gen = torch.Generator().manual_seed(0)
    B, H, N, d = 3, 4, 17, 8
    qkv = torch.randn(B, N, 3, H, d, generator=gen).bfloat16().permute(2, 0, 3, 1, 4)  # as the linear writes it
    w = torch.randn(B, H, N, d, generator=gen)
    q32 = qkv.float().detach().requires_grad_()
    q, k, v = q32
    y_ref = torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v
    (y_ref * w).sum().backward()

    linear_out = qkv.permute(1, 3, 0, 2, 4).detach().requires_grad_()
    x = linear_out.permute(2, 0, 3, 1, 4)  # a non-leaf view: its gradient comes as the core returns it
    with _GemmDtypes() as gemms:
        y = explicit_core_attention(x, 0.3)
        d_x, = torch.autograd.grad((y.float() * w).sum(), x)
    assert gemms.seen == ({torch.bfloat16} if native_bf16 else {torch.float32})
    assert y.dtype == torch.bfloat16 and y.shape == (B, H, N, d)
    torch.testing.assert_close(y.float(), y_ref.bfloat16().float(), rtol=0, atol=0.02)
    assert d_x.dtype == torch.bfloat16 and d_x.stride() == x.stride()
    torch.testing.assert_close(d_x.float(), q32.grad, rtol=2e-2, atol=2e-2 * q32.grad.abs().max().item())
    with torch.no_grad():  # the inference core: the same numbers
        torch.testing.assert_close(explicit_core_attention(qkv, 0.3), y.detach(), rtol=0, atol=0)
    # float64: exact up to rounding, and the gradient checked numerically
    q64 = torch.randn(3, 2, 2, 5, 4, dtype=torch.float64, generator=gen).requires_grad_()
    a, b, c = q64
    torch.testing.assert_close(explicit_core_attention(q64, 0.7), torch.softmax(a @ b.transpose(-2, -1) * 0.7, -1) @ c,
                               rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: explicit_core_attention(t, 0.7), (q64,))


@pytest.mark.parametrize('train', [True, False], ids=['train', 'inference'])
def test_mhsa_under_bf16_autocast_runs_the_explicit_core_where_gemms_are_bf16(train, native_bf16, kernel_backends):
    torch.manual_seed(0)
    layer = MHSA(48, num_heads=4)
    exact = copy.deepcopy(layer).double()
    x = torch.randn(4, 50, 48)
    w = torch.randn(4, 50, 48, dtype=torch.float64)
    y_64, gx_64, gp_64 = _run(exact, x.double(), w, None)

    def run():
        with _GemmDtypes() as gemms:
            if train:
                return _run(layer, x, w, torch.bfloat16), gemms.seen
            with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
                return (layer(x), None, None), gemms.seen

    (y, gx, gp), seen = run()
    # with bf16 GEMMs the explicit core (batched GEMMs, in bf16); else torch's fused kernel (none)
    assert seen == ({torch.bfloat16} if native_bf16 else set())
    assert y.dtype == torch.bfloat16 and _rel(y.double(), y_64) < 3e-2
    if train:
        assert _rel(gx, gx_64) < 3e-2
        for name, g in gp.items():
            assert _rel(g, gp_64[name]) < 6e-2, name
    kernel_backends(explicit_plain_attention=False)  # the switch: fused kernel
    (y_fused, _, _), seen = run()
    assert seen == set() and _rel(y_fused.double(), y_64) < 3e-2


def test_gpsa_in_bfloat16_weights():
    ref, ours = _pair(seed=2)
    ours = ours.bfloat16()
    x = torch.randn(4, 49, 96)
    with torch.no_grad():
        y = ours(x.bfloat16())
        y_ref = ref(x)
    assert y.dtype == torch.bfloat16
    assert _rel(y.double(), y_ref.double()) < 5e-2
    xb = x.bfloat16().requires_grad_()
    ours(xb).float().sum().backward()
    assert torch.isfinite(xb.grad.float()).all() and all(torch.isfinite(p.grad.float()).all() for p in ours.parameters())


@pytest.mark.parametrize('local', [1, 2])
def test_model_under_bf16_autocast_matches_timm(local):
    cfg = dict(**NANO, depth=3, num_heads=4, local_up_to_layer=local, locality_strength=1.5)
    torch.manual_seed(0)
    ref = TimmConVit(embed_dim=8, **cfg)
    ours = LocalityConViT(embed_dim=32, **cfg)
    _perturb(ref, 0.1)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 1, 28, 28)
    outs = []
    for model in (ref, ours):
        xx = x.clone().requires_grad_()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            y = model(xx)
        y.float().square().sum().backward()
        outs.append((y.float(), xx.grad, {n: p.grad for n, p in model.named_parameters()}))
    (y_ref, g_ref, p_ref), (y_ours, g_ours, p_ours) = outs
    assert _rel(y_ours, y_ref) < 3e-2
    assert torch.isfinite(g_ours).all() and _rel(g_ours, g_ref) < 5e-2
    for name, g in p_ours.items():
        assert torch.isfinite(g).all(), name
        if not name.endswith('pos_proj.bias'):  # true gradient 0
            assert _rel(g, p_ref[name]) < 1e-1, name
    with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16):
        assert _rel(ours.eval()(x).float(), ref.eval()(x).float()) < 3e-2


def test_cached_positional_attention_under_autocast_follows_weight_updates():
    torch.manual_seed(0)
    model = LocalityConViT(**NANO, embed_dim=32, depth=2, num_heads=4, local_up_to_layer=1)
    x = torch.randn(2, 1, 28, 28)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def infer(m):
        with torch.inference_mode(), torch.autocast('cpu', dtype=torch.bfloat16):
            return m.eval()(x)

    before = infer(model)
    torch.testing.assert_close(infer(model), before, rtol=0, atol=0)  # served from the cache
    model.train()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = model(x).float().square().sum()
    loss.backward()
    assert model.blocks[0].attn.pos_proj.weight.grad.abs().max() > 0
    opt.step()  # changes pos_proj in place: the cache must not serve the old P
    after = infer(model)
    fresh = copy.deepcopy(model)  # no cache at all
    fresh.blocks[0].attn._frozen_cache.clear()
    torch.testing.assert_close(after, infer(fresh), rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_kept_maps_follow_a_fused_adamw_step_taken_after_an_inference():
    """torch's fused AdamW (the trials' optimizer) leaves the parameters' version counters as they
    were: inference between a backward and the step must still not serve the maps and the fused
    qkv weight of before the step (`_kept` counts optimizer steps)."""
    torch.manual_seed(0)
    model = LocalityConViT(**NANO, embed_dim=32, depth=2, num_heads=4, local_up_to_layer=1)
    x = torch.randn(2, 1, 28, 28)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)

    def infer(m):
        with torch.inference_mode():
            return m.eval()(x)

    model.train()(x).square().sum().backward()
    before = infer(model)  # keeps P, the mixing and the fused qkv weight
    optimizer.step()  # (torch 2.15 leaves the version counters as they were)
    after = infer(model)
    fresh = copy.deepcopy(model)
    fresh.blocks[0].attn._frozen_cache.clear()
    torch.testing.assert_close(after, infer(fresh), rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_compiled_inference_traces_the_cached_maps_into_one_graph():
    """Under torch.compile, inference computes P and the fused qkv weights inside the graph (no
    storage-keyed cache: that would break the graph and recompile) and still follows an update."""
    torch.manual_seed(0)
    model = LocalityConViT(**NANO, embed_dim=32, depth=2, num_heads=4, local_up_to_layer=1).eval()
    x = torch.randn(2, 1, 28, 28)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break fails
    with torch.inference_mode():
        before = compiled(x)
    assert not model.blocks[0].attn._frozen_cache  # the compiled path kept nothing on the side
    with torch.inference_mode():
        torch.testing.assert_close(before, model(x))
    with torch.no_grad():
        model.blocks[0].attn.pos_proj.weight.mul_(3.0)  # in place, as an optimizer step
    fresh = copy.deepcopy(model)
    fresh.blocks[0].attn._frozen_cache.clear()
    with torch.inference_mode():
        after = compiled(x)
        torch.testing.assert_close(after, fresh(x))
    assert not torch.equal(after, before)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [None, torch.bfloat16])
def test_cuda_path_matches_timm_and_follows_weight_updates(dtype):
    """The GPU path (fused SDPA + s * P @ V, the mixing terms kept for inference) against timm's
    GPSA: outputs and gradients when training, outputs in inference before and after a step."""
    ref, ours = (layer.cuda() for layer in _pair())
    tol = 1e-4 if dtype is None else 3e-2

    def ctx():
        return torch.autocast('cuda', dtype=dtype) if dtype is not None else torch.autocast('cuda', enabled=False)

    x = torch.randn(8, 49, 96, device='cuda')
    w = torch.randn(8, 49, 96, device='cuda', dtype=torch.float64)
    grads = []
    for layer in (ref, ours):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with ctx():
            y = layer(xi)
        (y.double() * w).sum().backward()
        grads.append((y.double(), xi.grad.double(), {n: p.grad.double() for n, p in layer.named_parameters()}))
    (y_ref, gx_ref, gp_ref), (y_ours, gx_ours, gp_ours) = grads
    assert _rel(y_ours, y_ref) < tol and _rel(gx_ours, gx_ref) < tol
    for name in gp_ref:
        if name == 'pos_proj.bias':  # its true gradient is 0 (softmax ignores a per-head shift): noise in both
            assert gp_ours[name].abs().max() < 1e-2 * gp_ref['pos_proj.weight'].abs().max()
            continue
        assert _rel(gp_ours[name], gp_ref[name]) < tol, name

    def infer(layer):
        with torch.inference_mode(), ctx():
            return layer.eval()(x).double()

    assert _rel(infer(ours), infer(ref)) < tol
    assert torch.equal(infer(ours), infer(ours))  # served from the kept mixing terms
    with torch.no_grad():
        for layer in (ref, ours):  # in place, as an optimizer step: the kept terms must not be served
            layer.gating_param.add_(1.5)
            layer.pos_proj.weight.mul_(0.5)
    assert _rel(infer(ours), infer(ref)) < tol


def test_gpu_path_compiles_for_inference(monkeypatch):
    """GPSA's SDPA path (the GPU's, forced here on the CPU) under torch.compile in inference: the
    mix written through `out=` made AOT autograd's functionalisation fail ("Cannot view a tensor
    ..."), so the compiled path now mixes without it; same outputs as eager."""
    monkeypatch.setattr(_gpsa, 'takes_cpu_core', lambda x: False)
    torch.manual_seed(0)
    model = LocalityConViT(**NANO).eval()
    _perturb(model, 0.02)
    x = torch.randn(3, 1, 28, 28)
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')  # no codegen: seconds
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x))


def test_forward_on_the_meta_device():
    """Shape inference on the meta device (no data) runs through GPSA, whose positional attention
    turns autocast off only where autocast exists (not on meta)."""
    with torch.device('meta'):
        model = LocalityConViT(**NANO)
        assert model(torch.empty(2, 1, 28, 28)).shape == (2, 10)
        with torch.inference_mode():
            assert model.eval()(torch.empty(2, 1, 28, 28)).shape == (2, 10)
