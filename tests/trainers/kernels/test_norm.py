"""The blocks' norms: `PreNorm` and `add_and_norm` (`trainers.models._common`), which in CPU
inference run on the kernel libraries' `layer_norm` (`csrc/layer_norm_op.h`): the bf16 kernel's
under autocast to bf16 (`csrc/layer_norm_bf16.h`), the float32 kernel's without autocast
(`csrc/layer_norm_fp32.h`, its own build and the 8-lane AVX2 one); timm's LayerNorm (then
autocast's cast to bf16) everywhere else."""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import LayerNorm

import trainers.models  # noqa: F401  (registers the ls_* families)
from trainers import kernels
from trainers.kernels import _library
from trainers.models import _common
from trainers.models._common import PreNorm, add_and_norm, add_residual
from tests._layers import OpCalls, float32_avx2_kernel_or_skip, float32_kernel_or_skip

NORM_KERNEL = "locality_search.layer_norm"
NORM_KERNEL_FP32 = "locality_search_fp32.layer_norm"
TORCH_NORMS = {"aten.layer_norm", "aten.native_layer_norm"}


@pytest.fixture(scope="module")
def ops():
    if not kernels.onednn_runs_bf16_here() or kernels.cpu_library(torch.bfloat16) is None:
        pytest.skip(f"the bf16 kernel is not built here: {kernels.cpu_library_error(torch.bfloat16)}")
    return kernels.cpu_library(torch.bfloat16)


@pytest.fixture(scope="module")
def ops32():
    return float32_kernel_or_skip()


@pytest.fixture(scope="module", params=["native", "avx2"])
def fp32_build(request):
    """The float32 kernel as this CPU builds it, and its 8-lane AVX2 build (on AVX-512 CPUs)."""
    return float32_kernel_or_skip() if request.param == "native" else float32_avx2_kernel_or_skip()


def _norm(C: int, seed: int = 0) -> PreNorm:
    torch.manual_seed(seed)
    norm = PreNorm(C)
    with torch.no_grad():  # off the init (ones, zeros), so the affine part is checked
        norm.weight.add_(0.5 * torch.randn(C))
        norm.bias.add_(0.5 * torch.randn(C))
    return norm


def _assert_rounded_once(got: torch.Tensor, want_float32: torch.Tensor) -> None:
    """`got` (bf16) is torch's float32 result rounded to bf16: bit for bit but for the last bit of a
    few elements (the float32 sums' order differs)."""
    assert got.dtype == torch.bfloat16 and got.shape == want_float32.shape
    rounded = want_float32.to(torch.bfloat16)
    assert (got == rounded).double().mean() >= 0.999
    torch.testing.assert_close(got.float(), rounded.float(), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("shape", [(8, 197, 192), (64, 50, 96), (3, 7, 40), (5, 1), (2, 0, 16), (200,)])
@pytest.mark.parametrize("residual", [None, torch.float32, torch.bfloat16])
def test_kernel_matches_torch_layer_norm_rounded_to_bf16(ops, shape, residual):
    """Every row length (whole vectors, a tail, one element), no rows, and the residual in either
    dtype: the sum is torch's x + r exactly; the norm is torch's layer_norm of it, rounded once."""
    C = shape[-1]
    norm = _norm(C)
    x = 3 * torch.randn(*shape) + 1
    r = None if residual is None else torch.randn(*shape).to(residual)
    outs = ops.layer_norm(x, r, norm.weight, norm.bias, norm.eps)
    total = x if r is None else x + r
    assert len(outs) == (1 if r is None else 2)
    if r is not None:
        assert torch.equal(outs[1], total) and outs[1].dtype == torch.float32
    if total.numel():
        _assert_rounded_once(outs[0], F.layer_norm(total, (C,), norm.weight, norm.bias, norm.eps))


@pytest.mark.parametrize("shape", [(8, 197, 192), (64, 50, 96), (3, 7, 40), (5, 1), (2, 0, 16), (200,), (4, 36)])
@pytest.mark.parametrize("residual", [False, True])
def test_float32_kernel_matches_torch_layer_norm(fp32_build, shape, residual):
    """Every row length (whole vectors of 8 or 16, a tail: 40 and 36 with either width, one element),
    no rows, with and without the residual: the sum is torch's x + r exactly; the norm is torch's
    layer_norm of it but for the float32 sums' order (a few ulp)."""
    C = shape[-1]
    norm = _norm(C)
    x = 3 * torch.randn(*shape) + 1
    r = torch.randn(*shape) if residual else None
    outs = fp32_build.layer_norm(x, r, norm.weight, norm.bias, norm.eps)
    total = x if r is None else x + r
    assert len(outs) == (2 if residual else 1) and all(out.dtype == torch.float32 for out in outs)
    if residual:
        assert torch.equal(outs[1], total)
    torch.testing.assert_close(outs[0], F.layer_norm(total, (C,), norm.weight, norm.bias, norm.eps),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("library, case, message", [
    *((library, case, message) for library in ("bf16", "float32") for case, message in (
        ("strided x", "not contiguous"),
        ("bf16 x", "x: a contiguous CPU Float"),
        ("short weight", "weight: a contiguous CPU Float tensor of size \\[16\\]"),
        ("residual shape", "residual: a contiguous CPU"))),
    ("bf16", "float64 residual", "residual: float32 or bfloat16, got Double"),
    ("float32", "float64 residual", "residual: float32, got Double"),
    ("float32", "bf16 residual", "residual: float32, got BFloat16"),
])
def test_kernel_rejects_what_it_cannot_read(request, library, case, message):
    """Each library's op names the operand it cannot read; the float32 one takes a float32 residual only."""
    ops = request.getfixturevalue("ops" if library == "bf16" else "ops32")
    x, weight, bias, r = torch.randn(4, 16), torch.ones(16), torch.zeros(16), None
    if case == "strided x":
        x = torch.randn(16, 4).t()
    if case == "bf16 x":
        x = x.bfloat16()
    if case == "short weight":
        weight = torch.ones(15)
    if case == "residual shape":
        r = torch.randn(4, 15)
    if case == "float64 residual":
        r = torch.randn(4, 16, dtype=torch.float64)
    if case == "bf16 residual":
        r = torch.randn(4, 16).bfloat16()
    with pytest.raises(RuntimeError, match=message):
        ops.layer_norm(x, r, weight, bias, 1e-6)


def test_pre_norm_is_timm_layer_norm_outside_inference():
    """Same parameters and state dict as timm's LayerNorm; with autograd recording (training), in
    float32 and under autocast, the same output and gradient bit for bit, on torch's op."""
    norm, ref = _norm(96), LayerNorm(96)
    ref.load_state_dict(norm.state_dict())
    assert list(norm.state_dict()) == ["weight", "bias"] and isinstance(norm, LayerNorm)
    x = torch.randn(4, 50, 96, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), OpCalls() as calls:
            got, want = norm(x), ref(x)
        assert not {NORM_KERNEL, NORM_KERNEL_FP32} & set(calls.calls) and got.dtype == torch.float32
        assert torch.equal(got, want)
        (grad,) = torch.autograd.grad(got.sum(), x)
        torch.testing.assert_close(grad, torch.autograd.grad(want.sum(), x)[0], atol=0, rtol=0)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_pre_norm_in_float32_inference_runs_on_the_float32_kernel(ops32, mode):
    norm = _norm(192)
    x = torch.randn(8, 197, 192)
    with mode(), OpCalls() as calls:
        got = norm(x)
    assert calls.calls.get(NORM_KERNEL_FP32) == 1 and not TORCH_NORMS & set(calls.calls)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.layer_norm(x, (192,), norm.weight, norm.bias, norm.eps), atol=2e-6, rtol=2e-6)


def test_add_and_norm_fuses_the_residual_add_in_float32_inference(ops32):
    norm = _norm(96)
    x, branch = torch.randn(16, 50, 96), torch.randn(16, 50, 96)
    with torch.inference_mode(), OpCalls() as calls:
        total, normed = add_and_norm(x, branch, norm)
    assert calls.calls.get(NORM_KERNEL_FP32) == 1 and "aten.add" not in calls.calls
    assert torch.equal(total, x + branch)
    torch.testing.assert_close(normed, F.layer_norm(x + branch, (96,), norm.weight, norm.bias, norm.eps),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_pre_norm_in_bf16_inference_returns_what_the_next_linear_casts_to(ops, mode):
    norm = _norm(192)
    x = torch.randn(8, 197, 192)
    with mode(), torch.autocast("cpu", dtype=torch.bfloat16), OpCalls() as calls:
        got = norm(x)
    assert calls.calls.get(NORM_KERNEL) == 1 and not {"aten.layer_norm", "aten.native_layer_norm"} & set(calls.calls)
    _assert_rounded_once(got, F.layer_norm(x, (192,), norm.weight, norm.bias, norm.eps))


@pytest.mark.parametrize("precision, case", [
    *((precision, case) for precision in ("bf16", "float32")
      for case in ("switched off", "hooked", "not contiguous", "timm LayerNorm", "no kernel built")),
    ("bf16", "float16 autocast"),
])
def test_where_the_norms_keep_torch_ops(request, monkeypatch, kernel_backends, precision, case):
    """The `norm_kernel` backend off, a hook on the norm (it must see the call), tokens the kernel
    cannot read in place, a norm that is not a PreNorm, no kernel library built, and autocast to another dtype:
    torch's ops, as before, in bf16 inference (autocast) and in float32 inference."""
    request.getfixturevalue("ops" if precision == "bf16" else "ops32")
    norm = LayerNorm(64) if case == "timm LayerNorm" else _norm(64)
    x, branch = torch.randn(2, 30, 64), torch.randn(2, 30, 64)
    if precision == "bf16":
        branch = branch.bfloat16()
    seen = []
    if case == "switched off":
        kernel_backends(norm_kernel=False)
    if case == "hooked":
        norm.register_forward_hook(lambda module, args, out: seen.append(out))
    if case == "not contiguous":
        x = torch.randn(2, 64, 30).transpose(1, 2)
    if case == "no kernel built":
        monkeypatch.setattr(_library, "cpu_library", lambda dtype=torch.bfloat16: None)
    dtype = torch.float16 if case == "float16 autocast" else torch.bfloat16
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"), OpCalls() as calls:
        normed = norm(x)
        total, normed_sum = add_and_norm(x, branch, norm)
    assert not {NORM_KERNEL, NORM_KERNEL_FP32} & set(calls.calls)
    assert torch.equal(normed, F.layer_norm(x, (64,), norm.weight, norm.bias, norm.eps))
    assert torch.equal(total, x + branch)
    assert torch.equal(normed_sum, F.layer_norm(x + branch, (64,), norm.weight, norm.bias, norm.eps))
    assert len(seen) == (2 if case == "hooked" else 0)


def test_add_and_norm_adds_a_bf16_branch_on_torch_in_float32_inference(ops32):
    """The float32 kernel takes float32 branches only: a bf16 one (no autocast) is added by torch's
    add, and the norm of the float32 sum still runs on the float32 kernel."""
    norm = _norm(64)
    x, branch = torch.randn(2, 30, 64), torch.randn(2, 30, 64).bfloat16()
    with torch.inference_mode(), OpCalls() as calls:
        total, normed = add_and_norm(x, branch, norm)
    assert calls.calls.get("aten.add") == 1 and calls.calls.get(NORM_KERNEL_FP32) == 1
    assert torch.equal(total, x + branch)
    with torch.no_grad():
        expected = F.layer_norm(x + branch, (64,), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(normed, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("branch_dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_fuses_the_residual_add_in_bf16_inference(ops, branch_dtype):
    norm = _norm(96)
    x, branch = torch.randn(16, 50, 96), torch.randn(16, 50, 96).to(branch_dtype)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), OpCalls() as calls:
        total, normed = add_and_norm(x, branch, norm)
    assert calls.calls.get(NORM_KERNEL) == 1 and "aten.add" not in calls.calls
    assert torch.equal(total, x + branch) and total.dtype == torch.float32
    _assert_rounded_once(normed, F.layer_norm(x + branch, (96,), norm.weight, norm.bias, norm.eps))


def test_add_and_norm_with_autograd_is_the_add_then_the_norm(ops):
    norm = _norm(32)
    x, branch = torch.randn(3, 10, 32, requires_grad=True), torch.randn(3, 10, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), OpCalls() as calls:
        total, normed = add_and_norm(x, branch, norm)
    assert NORM_KERNEL not in calls.calls and normed.dtype == torch.float32
    grads = torch.autograd.grad((total.sum() + normed.sum()), (x, branch, norm.weight))
    expected_total = x + branch
    expected = torch.autograd.grad(expected_total.sum() + F.layer_norm(expected_total, (32,), norm.weight, norm.bias,
                                                                       norm.eps).sum(), (x, branch, norm.weight))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("variant, blocks", [("ls_convit_micro", 8), ("ls_gmm_micro", 8), ("ls_refiner_micro", 8)])
def test_models_in_bf16_inference_norm_on_the_kernel_and_agree_with_torch_ops(ops, kernel_backends, variant, blocks):
    """Every block's two norms take the kernel (the residual add before norm2 inside it); only the
    model's last norm stays on torch's op. The logits agree with the same model on torch's norms
    within bf16 noise, and are no further from float32."""
    torch.manual_seed(0)
    model = timm.create_model(variant).eval()
    assert len(model.blocks) == blocks
    x = torch.randn(16, 1, 28, 28)
    with torch.inference_mode():
        full = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with OpCalls() as calls:
                fused = model(x).float()
            kernel_backends(norm_kernel=False)
            plain = model(x).float()
    torch_norms = calls.calls.get("aten.layer_norm", 0) + calls.calls.get("aten.native_layer_norm", 0)
    assert calls.calls.get(NORM_KERNEL) == 2 * blocks and torch_norms == 1
    scale = full.abs().max()
    torch.testing.assert_close(fused, plain, atol=0.03 * scale, rtol=0)
    assert (fused - full).abs().max() <= 1.5 * (plain - full).abs().max() + 1e-3 * scale


@pytest.mark.parametrize("variant", ["ls_convit_micro", "ls_gmm_micro", "ls_refiner_micro"])
def test_models_in_float32_inference_norm_on_the_float32_kernel_and_agree_with_torch_ops(ops32, kernel_backends,
                                                                                          variant):
    """Every block's two norms take the float32 kernel (the residual add before norm2 inside it); the
    model's last norm stays on torch's op; the logits are torch's norms' but for float32 rounding."""
    torch.manual_seed(0)
    model = timm.create_model(variant).eval()
    x = torch.randn(16, 1, 28, 28)
    with torch.inference_mode():
        with OpCalls() as calls:
            fused = model(x)
        kernel_backends(norm_kernel=False)
        plain = model(x)
    torch_norms = calls.calls.get("aten.layer_norm", 0) + calls.calls.get("aten.native_layer_norm", 0)
    assert calls.calls.get(NORM_KERNEL_FP32) == 2 * len(model.blocks) and torch_norms == 1
    torch.testing.assert_close(fused, plain, atol=1e-4 * plain.abs().max().item(), rtol=0)


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_norms_given_tokens_of_another_width_raise_torch_own_error(request, precision):
    """Tokens whose width is not the norm's: torch's layer_norm raises its own error, as timm's
    LayerNorm would, rather than the kernel's operand check."""
    request.getfixturevalue("ops" if precision == "bf16" else "ops32")
    norm, x = _norm(64), torch.randn(2, 30, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with pytest.raises(RuntimeError, match="normalized_shape"):
            norm(x)
        with pytest.raises(RuntimeError, match="normalized_shape"):
            add_and_norm(x, torch.randn(2, 30, 32), norm)


@pytest.mark.parametrize("branch_dtype", [torch.float32, torch.bfloat16])
def test_add_residual_adds_in_place_in_inference(branch_dtype):
    """The block's last add: in place on the block's own sum without autograd (the same values as
    x + branch, bit for bit), into a new tensor with autograd, hooks on the norm, or where the sum
    would change x's dtype."""
    norm = _norm(64)
    x, branch = torch.randn(2, 30, 64), torch.randn(2, 30, 64).to(branch_dtype)
    expected = x + branch
    with torch.no_grad():
        out = add_residual(x.clone(), branch, norm)
        mine = x.clone()
        assert add_residual(mine, branch, norm).data_ptr() == mine.data_ptr()
    assert torch.equal(out, expected) and out.dtype == torch.float32


@pytest.mark.parametrize("case", ["autograd", "hooked norm", "bf16 tokens, float32 branch", "broadcast branch"])
def test_add_residual_keeps_x_where_it_must(case):
    norm = _norm(64)
    x, branch = torch.randn(2, 30, 64), torch.randn(2, 30, 64)
    if case == "autograd":
        x.requires_grad_()
    if case == "hooked norm":
        norm.register_forward_hook(lambda module, args, out: None)
    if case == "bf16 tokens, float32 branch":
        x = x.bfloat16()
    if case == "broadcast branch":
        branch = torch.randn(64)
    before = x.detach().clone()
    with torch.set_grad_enabled(case == "autograd"):
        out = add_residual(x, branch, norm)
    assert torch.equal(x.detach(), before) and out.data_ptr() != x.data_ptr()
    assert torch.equal(out.detach(), (x + branch).detach()) and out.dtype == torch.promote_types(x.dtype, branch.dtype)
    if case == "autograd":
        out.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("variant", ["ls_convit_micro", "ls_gmm_micro", "ls_refiner_micro"])
def test_models_add_their_last_residual_in_place_in_inference_with_the_same_logits(monkeypatch, variant, precision):
    """Every block's last add runs in place in inference (one aten.add_ per block, no out-of-place
    add of a block's size), and the logits are bit for bit those of the out-of-place add."""
    if precision == "bf16" and not kernels.onednn_runs_bf16_here():
        pytest.skip("no bf16 oneDNN products here")
    torch.manual_seed(0)
    model = timm.create_model(variant).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with OpCalls() as calls:
            model(x)
        in_place = model(x)  # outside the dispatch mode, as the other
        monkeypatch.setattr(_common, "add_residual", lambda x, branch, norm: x + branch)  # PreNormBlock's
        out_of_place = model(x)
    assert calls.calls.get("aten.add_") == len(model.blocks)
    assert torch.equal(in_place, out_of_place)
