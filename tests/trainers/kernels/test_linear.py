"""`kernels.linear` / `kernels.Linear`: float32 linear layers on oneDNN where MKL runs AVX2 code, and bf16
inference on oneDNN or on the bf16 kernel's linear.

The oneDNN float32 path is forced on here (`onednn_beats_mkl_here` patched True), so it is checked
on every CPU, not only the AMD AVX-512 ones where models take it by default: oneDNN runs on any x86
CPU. bf16 inference is tested on oneDNN everywhere (the `bf16_kernel_linear` backend off but in the bf16
kernel's own section, which forces that path on wherever the kernel is built)."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import trainers.models  # noqa: F401  (registers the ls_* families)
from trainers import kernels
from trainers.kernels import _linear
from trainers.models.ls_refiner import Refiner
from trainers.throughput import count_flops
from tests._layers import OpCalls, float32_avx2_kernel_or_skip, float32_kernel_or_skip, run_layer

ONEDNN = "mkldnn._linear_pointwise"
WEIGHT_GRAD_KERNEL = "locality_search_fp32.linear_weight_grad"

pytestmark = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                     and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                reason="this torch has no oneDNN linear")


@pytest.fixture
def onednn_here(monkeypatch):
    monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: True)


@pytest.fixture(autouse=True)
def bf16_inference_on_onednn(kernel_backends):
    """bf16 inference on oneDNN, whatever the CPU (the bf16 kernel's section turns its path back on)."""
    kernel_backends(bf16_kernel_linear=False)


def _float64_reference(x, weight, bias, upstream):
    x, weight, bias = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    out = F.linear(x, weight, bias)
    return [out.detach(), *torch.autograd.grad(out, (x, weight, bias), upstream.double())]


@pytest.mark.parametrize("shape, in_features, out_features, weight_grad_on", [
    ((6, 70, 96), 96, 288, "kernel"),      # K < N: the kernel's lanes along N, the (K, N) result transposed
    ((900, 384), 384, 96, "kernel"),       # K > N: lanes along K
    ((4, 5, 60, 128), 128, 128, "kernel"),
    ((6, 70, 96), 96, 288, "onednn"),      # kernel off: K < N, grad_weight computed as (K, N), transposed
    ((900, 384), 384, 96, "onednn"),       # K > N: computed as (N, K)
    ((4, 5, 60, 128), 128, 128, "mkl"),    # both under GRAD_WEIGHT_MIN_WIDTH
    ((500, 100), 100, 200, "onednn"),      # kernel on, but neither dim a multiple of its 16 lanes
])
def test_output_and_all_gradients_match_float64(onednn_here, kernel_backends, shape, in_features, out_features,
                                                weight_grad_on):
    kernel_on = weight_grad_on == "kernel" or in_features % 16 != 0 and out_features % 16 != 0
    if weight_grad_on == "kernel":
        float32_kernel_or_skip()
    kernel_backends(weight_grad_kernel=kernel_on)
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(out_features, in_features, requires_grad=True)
    bias = torch.randn(out_features, requires_grad=True)
    upstream = torch.randn(*shape[:-1], out_features)
    with OpCalls() as ops:
        out = kernels.linear(x, weight, bias)
        grads = torch.autograd.grad(out, (x, weight, bias), upstream)
    # forward, grad_input, and grad_weight on its path
    assert ops.calls.get(ONEDNN) == (3 if weight_grad_on == "onednn" else 2)
    assert ops.calls.get(WEIGHT_GRAD_KERNEL, 0) == (1 if weight_grad_on == "kernel" else 0)
    assert ops.calls.get("aten.mm", 0) == (1 if weight_grad_on == "mkl" else 0) and "aten.addmm" not in ops.calls
    expected = _float64_reference(x, weight, bias, upstream)
    for got, want in zip([out, *grads], expected):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=2e-6 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("rows, in_features, out_features", [
    (5000, 96, 288),  # 8 parts of the rows; lanes along N (the wider), the result a transposed view
    (5000, 288, 96),  # lanes along K
    (777, 64, 192),   # 2 parts, the rows not divisible by them
    (1000, 48, 40),   # only K fills whole vectors
    (1000, 40, 48),   # only N does
    (100, 32, 32),    # one part
])
@pytest.mark.parametrize("build", ["own", "avx2"])
def test_weight_grad_kernel_matches_float64_whatever_the_thread_count(rows, in_features, out_features, build):
    """grad^T input against float64, with a float32 error no worse than a few times MKL's, and bit
    for bit the same result on 1 and on 2 threads (the rows' split is fixed by their count); on this
    CPU's build, and on an AVX-512 CPU on the 8-lane AVX2 build too."""
    kernel = float32_kernel_or_skip() if build == "own" else float32_avx2_kernel_or_skip()
    torch.manual_seed(0)
    grad, x = torch.randn(rows, out_features), torch.randn(rows, in_features)
    want = grad.double().t() @ x.double()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.linear_weight_grad(grad, x)
        torch.set_num_threads(2)
        two = kernel.linear_weight_grad(grad, x)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (out_features, in_features) and one.dtype == torch.float32
    assert torch.equal(one, two)
    mkl_error = (grad.t().mm(x).double() - want).abs().max().item()
    assert (one.double() - want).abs().max().item() <= 4 * mkl_error + 1e-6 * want.abs().max().item()


def test_weight_grad_kernel_refuses_what_it_cannot_take():
    kernel = float32_kernel_or_skip()
    with pytest.raises(RuntimeError, match="N or K a multiple of"):
        kernel.linear_weight_grad(torch.randn(50, 36), torch.randn(50, 20))  # whole vectors of neither 16 nor 8 lanes
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.linear_weight_grad(torch.randn(48, 50).t(), torch.randn(50, 48))
    with pytest.raises(RuntimeError, match=r"grad \(M, N\) and input \(M, K\)"):
        kernel.linear_weight_grad(torch.randn(50, 48), torch.randn(49, 48))


def test_only_the_gradients_asked_for_are_computed(onednn_here):
    """A frozen weight (fine-tuning a head) and an input that needs no gradient (the first layer)."""
    torch.manual_seed(0)
    x = torch.randn(500, 96)
    weight, bias = torch.randn(192, 96), torch.randn(192, requires_grad=True)
    with OpCalls() as ops:
        out = kernels.linear(x, weight, bias)
        (grad_bias,) = torch.autograd.grad(out, (bias,), torch.ones_like(out))
    assert ops.calls.get(ONEDNN) == 1  # the forward only
    torch.testing.assert_close(grad_bias, torch.full((192,), 500.))

    x.requires_grad_()
    with OpCalls() as ops:
        out = kernels.linear(x, weight, None)
        (grad_x,) = torch.autograd.grad(out, (x,), torch.ones_like(out))
    assert ops.calls.get(ONEDNN) == 2
    torch.testing.assert_close(grad_x, weight.sum(0).expand(500, 96), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", ["small", "float64", "autocast", "switched off", "1-d"])
def test_where_torch_linear_is_kept(onednn_here, kernel_backends, case):
    """Products under MIN_MULTIPLY_ADDS (oneDNN's per-call cost loses there), other dtypes, CPU
    autocast with autograd recording (F.linear runs bf16 on oneDNN already) and the `onednn_fp32` backend off
    take F.linear."""
    rows = {"small": 100, "1-d": None}.get(case, 4096)
    x = torch.randn(96) if rows is None else torch.randn(rows, 96)
    weight, bias = torch.randn(96, 96), torch.randn(96, requires_grad=case == "autocast")
    if case == "float64":
        x, weight, bias = x.double(), weight.double(), bias.double()
    if case == "switched off":
        kernel_backends(onednn_fp32=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        with OpCalls() as ops:
            out = kernels.linear(x, weight, bias)
        expected = F.linear(x, weight, bias)
    assert ONEDNN not in ops.calls
    assert out.dtype == (torch.bfloat16 if case == "autocast" else x.dtype)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    with OpCalls() as ops:  # the control: a large float32 product does go to oneDNN
        kernels.linear(torch.randn(4096, 96), weight.float(), bias.detach().float())
    assert ops.calls.get(ONEDNN, 0) == (0 if case == "switched off" else 1)


@pytest.mark.parametrize("mode", ["inference", "autograd", "switched off"])
def test_float32_inference_fuses_the_gelu_into_the_onednn_product_bit_for_bit(onednn_here, kernel_backends, mode):
    """`linear(..., gelu=True)` in float32 inference on oneDNN is one op: oneDNN's GELU, which is the
    float32 GELU torch runs on a contiguous tensor, so bit for bit the product then F.gelu. With
    autograd recording, or the `fused_gelu` backend off, the GELU runs after the product (F.gelu, or in place)."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 700, 96), 0.3 * torch.randn(384, 96), torch.randn(384)
    if mode == "autograd":
        x.requires_grad_()
    if mode == "switched off":
        kernel_backends(fused_gelu=False)
    with OpCalls() as ops:
        out = kernels.linear(x, weight, bias, gelu=True)
    with torch.no_grad():
        expected = F.gelu(kernels.linear(x, weight, bias))
    gelu_ops = ops.calls.get("aten.gelu", 0) + ops.calls.get("aten.gelu_", 0)
    assert ops.calls.get(ONEDNN) == 1 and gelu_ops == (0 if mode == "inference" else 1)
    assert torch.equal(out.detach(), expected) and out.min() < 0  # the exact GELU's dip below zero
    if mode == "autograd":
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert grad.shape == x.shape


@pytest.mark.parametrize("vendor, family, capability, isa_cap, expected", [
    ("GenuineIntel", 6, "AVX512", "", True),     # Sapphire Rapids: packed weights and fused GELU gain a little
    ("GenuineIntel", 6, "AVX512", "avx2", False),
    ("GenuineIntel", 6, "AVX2", "", False),
    ("AuthenticAMD", 26, "AVX512", "", True),    # where training takes oneDNN too
    ("AuthenticAMD", 25, "AVX512", "", True),    # Zen 4: training takes oneDNN too
    ("", None, "AVX512", "", False),
])
def test_the_inference_rule_adds_intels_avx512_cpus(monkeypatch, vendor, family, capability, isa_cap, expected):
    monkeypatch.setattr(_linear, "_cpu_vendor_and_family", lambda: (vendor, family))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)
    for rule in (_linear.onednn_beats_mkl_here, _linear.onednn_inference_beats_mkl_here):
        rule.cache_clear()
    try:
        assert _linear.onednn_inference_beats_mkl_here() is expected
    finally:
        for rule in (_linear.onednn_beats_mkl_here, _linear.onednn_inference_beats_mkl_here):
            rule.cache_clear()


def test_where_only_inference_beats_mkl_training_keeps_f_linear(monkeypatch):
    """Intel's rule: float32 inference on oneDNN (the packed weight, fc1's GELU inside), a product
    autograd records on torch's F.linear (MKL), the same numbers to float32 rounding."""
    monkeypatch.setattr(_linear, "onednn_beats_mkl_here", lambda: False)
    monkeypatch.setattr(_linear, "onednn_inference_beats_mkl_here", lambda: True)
    torch.manual_seed(0)
    x = torch.randn(300, 96)
    weight, bias = torch.randn(384, 96, requires_grad=True), torch.randn(384, requires_grad=True)
    with torch.inference_mode(), OpCalls() as ops:
        inferred = kernels.linear(x, weight, bias, gelu=True)
    assert ops.calls.get(ONEDNN) == 1 and not {"aten.gelu", "aten.gelu_", "aten.addmm"} & set(ops.calls)
    with OpCalls() as ops:
        trained = kernels.linear(x, weight, bias, gelu=True)
    assert ONEDNN not in ops.calls and "aten.addmm" in ops.calls and trained.requires_grad
    torch.testing.assert_close(inferred, trained.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vendor, family, capability, isa_cap, expected", [
    ("AuthenticAMD", 26, "AVX512", "", True),    # Zen 5
    ("AuthenticAMD", 26, "AVX512", "avx512_core_bf16", True),
    ("AuthenticAMD", 26, "AVX512", "avx2", False),   # oneDNN capped at AVX2: not measured to gain
    ("AuthenticAMD", 25, "AVX512", "", True),    # Zen 4: 512-bit FMAs as two halves, and still 1.03-1.25x
    ("AuthenticAMD", 25, "AVX2", "", False),     # Zen 3: both libraries run AVX2 code
    ("GenuineIntel", 6, "AVX512", "", False),    # MKL runs its AVX-512 code on Intel
    ("", None, "AVX512", "", False),             # vendor unknown
])
def test_the_rule_is_full_width_avx512_on_a_cpu_mkl_gives_avx2_code(monkeypatch, vendor, family, capability,
                                                                    isa_cap, expected):
    monkeypatch.setattr(_linear, "_cpu_vendor_and_family", lambda: (vendor, family))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)
    _linear.onednn_beats_mkl_here.cache_clear()
    try:
        assert _linear.onednn_beats_mkl_here() is expected
    finally:
        _linear.onednn_beats_mkl_here.cache_clear()


def test_flop_counter_counts_the_onednn_linear_as_f_linear(onednn_here):
    x, weight, bias = torch.randn(2, 2048, 96), torch.randn(288, 96), torch.randn(288)
    counts = {}
    for on in (True, False):
        with FlopCounterMode(display=False) as counter, OpCalls() as ops:
            kernels.linear(x, weight, bias) if on else F.linear(x, weight, bias)
        assert (ONEDNN in ops.calls) is on
        counts[on] = counter.get_total_flops()
    assert counts[True] == counts[False] == 2 * 2 * 2048 * 96 * 288


def test_flop_counter_counts_a_training_step_with_the_weight_grad_kernel_as_torch_linear(onednn_here):
    float32_kernel_or_skip()
    x = torch.randn(2, 2048, 96, requires_grad=True)
    weight, bias = torch.randn(288, 96, requires_grad=True), torch.randn(288, requires_grad=True)
    counts = {}
    for on in (True, False):
        with FlopCounterMode(display=False) as counter, OpCalls() as ops:
            out = kernels.linear(x, weight, bias) if on else F.linear(x, weight, bias)
            out.backward(torch.ones_like(out))
        assert (WEIGHT_GRAD_KERNEL in ops.calls) is on
        counts[on] = counter.get_total_flops()
    assert counts[True] == counts[False] == 3 * 2 * 2 * 2048 * 96 * 288  # forward, grad_input, grad_weight


@pytest.mark.parametrize("variant", ["ls_convit_micro", "ls_gmm_micro", "ls_refiner_micro"])
def test_models_on_onednn_linears_are_as_close_to_float64_as_on_torch_linears(onednn_here, kernel_backends, variant):
    """A model's linears (q/k/v, projections, MLP, head) take oneDNN; its logits and every gradient
    are within 2x (+ a hair) of F.linear's float32 error against the same model in float64, and its
    `flops` are the same (the trials' column must not depend on the library)."""
    torch.manual_seed(0)
    model = timm.create_model(variant)
    x, upstream = torch.randn(64, 1, 28, 28), torch.randn(64, 10)
    reference = run_layer(copy.deepcopy(model).double(), x, dtype=torch.float64, bf16=False, train=True,
                          upstream=upstream)
    errors, flops = {}, {}
    for on in (True, False):
        kernel_backends(onednn_fp32=on)
        with OpCalls() as ops:
            results = run_layer(model, x, dtype=torch.float32, bf16=False, train=True, upstream=upstream)
        assert (ONEDNN in ops.calls) is on
        errors[on] = [(got.double() - want).abs().max().item() for got, want in zip(results, reference)]
        flops[on] = count_flops(model, (1, 28, 28))
    assert flops[True] == flops[False]
    for onednn_error, torch_error, want in zip(errors[True], errors[False], reference):
        assert onednn_error <= 2 * torch_error + 1e-6 * want.abs().max().item()


def test_linear_keeps_nn_linear_parameters_and_state_dict():
    layer = kernels.Linear(8, 4)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert isinstance(timm.create_model("ls_convit_micro").blocks[0].mlp.fc1, kernels.Linear)


def test_refiner_dense_path_on_onednn_matches_float64(onednn_here):
    """The Refiner's 'dense' path (the composed operator as one GEMM) goes through `linear`: on
    oneDNN in float32, its refined maps and the gradients of the maps, expand, kernel and reduce
    match the same path in float64 (whose upstream gradient arrives permuted, not contiguous)."""
    torch.manual_seed(0)
    refiner = Refiner(4, 2, 3, (7, 7))
    refiner.force_path = "dense"
    with torch.no_grad():
        refiner.kernel.add_(0.3 * torch.randn_like(refiner.kernel))
    maps = torch.softmax(torch.randn(4, 256, 50), dim=-1)
    upstream = torch.randn(4, 256, 50)
    reference = copy.deepcopy(refiner).double()
    results = []
    for module, dtype in ((refiner, torch.float32), (reference, torch.float64)):
        x = maps.to(dtype).requires_grad_()
        with OpCalls() as ops:
            out = module.refine_rows(x)
            grads = torch.autograd.grad(out, [x, *module.parameters()], upstream.to(dtype))
        results.append([out.detach(), *grads])
        if dtype == torch.float32:
            assert ops.calls.get(ONEDNN) == 3
    for got, want in zip(*results):
        torch.testing.assert_close(got.double(), want, atol=2e-6 * want.abs().max().item(), rtol=0)


def test_mlp_has_timm_mlp_initial_weights_from_the_same_seed():
    """`Mlp` recasts timm's fc1 and fc2 as `Linear` rather than building them again, so a seeded
    model starts from the same weights as before (a rebuild draws from the random stream)."""
    from timm.layers import Mlp as TimmMlp
    from trainers.models._common import Mlp
    torch.manual_seed(0)
    ours = Mlp(in_features=16, hidden_features=64)
    after_ours = torch.rand(1)
    torch.manual_seed(0)
    timms = TimmMlp(in_features=16, hidden_features=64)
    assert torch.equal(torch.rand(1), after_ours)
    assert type(ours.fc1) is kernels.Linear and type(ours.fc2) is kernels.Linear
    for key, value in timms.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)


# --- bf16 inference: the bias (and fc1's GELU) inside oneDNN's product --------------------------

@pytest.fixture
def onednn_bf16():
    if not kernels.onednn_runs_bf16_here():
        pytest.skip("torch runs no bf16 products on oneDNN on this CPU")


def _bf16_operands(case: str, x, weight, bias):
    """The operands as the case multiplies them: float32 under autocast, or bf16 tensors."""
    if case == "bf16 tensors":
        return x.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16()
    return x, weight, bias


@pytest.mark.parametrize("case", ["autocast", "bf16 tensors"])
@pytest.mark.parametrize("shape, with_bias", [((8, 197, 192), True), ((300, 96), False), ((2, 3, 40, 64), True)])
def test_bf16_inference_adds_the_bias_inside_onednn_bit_for_bit(onednn_bf16, case, shape, with_bias):
    """Without autograd recording, a bf16 product is one oneDNN op (no addmm, no bias copy) whose
    output is F.linear's under the same casts, bit for bit."""
    torch.manual_seed(0)
    x, weight = torch.randn(*shape), 0.1 * torch.randn(160, shape[-1])
    x, weight, bias = _bf16_operands(case, x, weight, torch.randn(160) if with_bias else None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"), torch.inference_mode():
        with OpCalls() as ops:
            out = kernels.linear(x, weight, bias)
        expected = F.linear(x, weight, bias)
    assert ops.calls.get(ONEDNN) == 1 and "aten.addmm" not in ops.calls and "aten.mm" not in ops.calls
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 160)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["autocast", "bf16 tensors"])
def test_bf16_inference_gelu_is_fused_and_rounds_once(onednn_bf16, case):
    """`linear(..., gelu=True)` in bf16 inference is one oneDNN op whose output is the exact GELU of
    the float32 sums rounded to bf16 once (but for the last bit where the sums' order differs), where
    F.linear then F.gelu rounds the sums first: a third of its outputs differ."""
    torch.manual_seed(0)
    x, weight, bias = _bf16_operands(case, torch.randn(1576, 192), 0.1 * torch.randn(768, 192), torch.randn(768))
    rounded_once = F.gelu(F.linear(*(t.bfloat16().float() for t in (x, weight, bias)))).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"), torch.no_grad():
        with OpCalls() as ops:
            fused = kernels.linear(x, weight, bias, gelu=True)
        unfused = F.gelu(F.linear(x, weight, bias))
    assert ops.calls.get(ONEDNN) == 1 and not {"aten.gelu", "aten.gelu_", "aten.addmm", "aten.mm"} & set(ops.calls)
    assert fused.dtype == torch.bfloat16
    assert (fused == rounded_once).double().mean() > 0.99
    # one bf16 step at most (2^-7 relative); oneDNN's GELU flushes outputs under ~1e-7 to zero
    torch.testing.assert_close(fused.float(), rounded_once.float(), atol=1e-6, rtol=2 ** -7)
    assert (unfused == rounded_once).double().mean() < 0.9  # the control: rounded twice


@pytest.mark.parametrize("case", ["autograd", "switched off", "small", "no bf16 here", "float32"])
def test_where_bf16_products_keep_f_linear(onednn_bf16, monkeypatch, kernel_backends, case):
    """With autograd recording (training), the `onednn_bf16` backend off, products under torch's own oneDNN
    size rule, CPUs where torch runs no bf16 oneDNN products, and float32 outside autocast (the
    float32 rule's business): F.linear (then F.gelu), as before."""
    rows = 10 if case == "small" else 512
    x = torch.randn(rows, 32 if case == "small" else 96, requires_grad=case == "autograd")
    weight, bias = torch.randn(8 if case == "small" else 128, x.shape[1]), None
    if case == "switched off":
        kernel_backends(onednn_bf16=False)
    if case == "no bf16 here":
        monkeypatch.setattr(_linear, "onednn_runs_bf16_here", lambda: False)
    kernel_backends(onednn_fp32=False)  # only the bf16 path may call oneDNN here
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "float32"):
        with OpCalls() as ops:
            out = kernels.linear(x, weight, bias, gelu=True)
        expected = F.gelu(F.linear(x, weight, bias))
    assert ONEDNN not in ops.calls
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    if case == "autograd":
        out.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


def test_mlp_fuses_fc1_and_gelu_in_bf16_inference_unless_fc1_has_hooks(onednn_bf16):
    """The blocks' MLP runs fc1 and its GELU as one oneDNN op in bf16 inference; with a hook on fc1
    it keeps them apart, so the hook sees fc1's own output (before the GELU)."""
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_micro").eval()
    x = torch.randn(4, 1, 28, 28)
    mlp = model.blocks[0].mlp
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        with OpCalls() as ops:
            fused = model(x)
        assert ops.calls.get("aten.gelu_", 0) + ops.calls.get("aten.gelu", 0) == 0
        handle = mlp.fc1.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            with OpCalls() as ops:
                hooked = model(x)
        finally:
            handle.remove()
        assert ops.calls.get("aten.gelu_") == 1  # only the hooked block's MLP unfused
        with kernels.backends(onednn_bf16=False):
            unfused = model(x)
    assert len(seen) == 1 and seen[0].min() < 0  # fc1's output, not the GELU's (>= -0.17)
    with torch.inference_mode():
        full = model(x)
    for out in (fused, hooked):
        torch.testing.assert_close(out.float(), unfused.float(), atol=0.05, rtol=0.05)
    # no further from float32 than the unfused path, give or take bf16 noise
    assert (fused.float() - full).abs().max() <= 1.5 * (unfused.float() - full).abs().max()


# --- inference keeps each weight in oneDNN's blocked layout ------------------------------------

REORDER = "mkldnn._reorder_linear_weight"


def _packing_precision_or_skip(precision: str) -> bool:
    """Whether the case runs under bf16 autocast (skipped where torch runs no bf16 oneDNN products)."""
    if precision == "bf16" and not kernels.onednn_runs_bf16_here():
        pytest.skip("torch runs no bf16 products on oneDNN on this CPU")
    return precision == "bf16"


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_inference_packs_each_weight_once_and_follows_its_changes(onednn_here, kernel_backends, precision):
    """Inference lays each weight out for oneDNN once and reuses it (no reorder on later calls), bit
    for bit the product with the plain weight; an in-place change (an optimizer step,
    load_state_dict) is seen through the weight's version counter and packed again."""
    bf16 = _packing_precision_or_skip(precision)
    torch.manual_seed(0)
    layer, x = kernels.Linear(96, 384), torch.randn(2, 700, 96)

    def infer(pack: bool = True) -> tuple[torch.Tensor, int]:
        kernel_backends(packed_weights=pack)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.inference_mode():
            with OpCalls() as ops:
                out = layer(x)
        assert ops.calls.get(ONEDNN) == 1
        return out, ops.calls.get(REORDER, 0)

    first, reorders = infer()
    assert reorders == 1 and layer.weight in _linear._derived_weights
    again, reorders = infer()
    assert reorders == 0 and torch.equal(again, first)
    plain, reorders = infer(pack=False)
    assert reorders == 0 and torch.equal(plain, first)

    # the trials' optimizer: torch's fused AdamW updates the weight in place without bumping its
    # version counter; the step is seen all the same (_kept counts optimizer steps)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)
    layer(x).square().sum().backward()
    infer()  # inference between the backward and the step
    optimizer.step()  # (torch 2.15 leaves the version counter as it was)
    stepped, reorders = infer()
    assert reorders == 1 and torch.equal(stepped, infer(pack=False)[0]) and not torch.equal(stepped, first)

    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: same storage, a new version
    doubled, reorders = infer()
    assert reorders == 1 and torch.equal(doubled, infer(pack=False)[0])

    layer.load_state_dict({"weight": torch.randn(384, 96), "bias": torch.zeros(384)})
    loaded, reorders = infer()
    assert reorders == 1 and torch.equal(loaded, infer(pack=False)[0])


def test_float32_and_bf16_inference_in_turn_keep_one_packed_weight_each(onednn_here):
    """A model run in float32 and under bf16 autocast in turn (as the models benchmark times them)
    keeps a packed weight for each dtype: no reorder once both are made."""
    _packing_precision_or_skip("bf16")
    torch.manual_seed(0)
    layer, x = kernels.Linear(96, 384), torch.randn(2, 700, 96)

    def reorders(bf16: bool) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.inference_mode():
            with OpCalls() as ops:
                layer(x)
        return ops.calls.get(REORDER, 0)

    assert [reorders(bf16) for bf16 in (False, True, False, True, False)] == [1, 1, 0, 0, 0]


@pytest.mark.parametrize("case", ["inference tensor", "view", "switched off"])
def test_weights_not_tracked_are_not_kept_packed(onednn_here, kernel_backends, case):
    """A weight made in inference mode has no version counter (an in-place change would go unseen)
    and a view is a new object on every call (`w.t()`): neither is kept; they run with the plain
    weight, as everything does with the `packed_weights` backend off."""
    torch.manual_seed(0)
    x = torch.randn(1400, 96)
    weight = torch.randn(96, 384).t() if case == "view" else torch.randn(384, 96)  # normal tensors
    if case == "switched off":
        kernel_backends(packed_weights=False)
    with torch.inference_mode():
        if case == "inference tensor":
            weight = torch.randn(384, 96)
        with OpCalls() as ops:
            out = kernels.linear(x, weight)
            kernels.linear(x, weight)
            if case == "inference tensor":
                weight.mul_(2.0)  # unseen by any cache: must not serve the old product
                doubled = kernels.linear(x, weight)
    assert ops.calls.get(ONEDNN) == (3 if case == "inference tensor" else 2) and REORDER not in ops.calls
    assert weight not in _linear._derived_weights
    torch.testing.assert_close(out, x @ weight.t() / (2.0 if case == "inference tensor" else 1.0))
    if case == "inference tensor":
        torch.testing.assert_close(doubled, x @ weight.t())


def test_a_packed_weight_is_dropped_with_its_weight(onednn_here):
    """The packed copy lives as long as its weight (weak keys): a model freed frees its copies."""
    x = torch.randn(1400, 96)
    layer = kernels.Linear(96, 384)
    with torch.inference_mode():
        layer(x)
    assert layer.weight in _linear._derived_weights
    before = len(_linear._derived_weights)
    del layer
    assert len(_linear._derived_weights) == before - 1


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_models_keep_every_large_weight_packed_for_inference(onednn_here, kernel_backends, precision):
    """In ls_convit_micro inference every linear's weight is packed on the first call, GPSA's fused
    qkv weight too (kept by `_frozen` as a normal tensor, so tracked), none on the second; the
    logits equal the plain weights' bit for bit, and after an optimizer step they follow it. (GPSA
    apart: in float32 it runs its projections inside its fused layer, `_gpsa_layer`, where it can.)"""
    bf16 = _packing_precision_or_skip(precision)
    kernel_backends(fused_gpsa_layer=False)
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_micro", num_classes=10)
    x = torch.randn(8, 1, 28, 28)

    def infer(pack: bool = True) -> tuple[torch.Tensor, int]:
        kernel_backends(packed_weights=pack)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.inference_mode():
            with OpCalls() as ops:
                out = model.eval()(x)
        return out, ops.calls.get(REORDER, 0)

    # every block's qkv (GPSA's fused from qk and v), proj, fc1 and fc2; the head (8 x 96 -> 10) only
    # in bf16 (under the float32 rule's MIN_MULTIPLY_ADDS it stays on F.linear)
    products = 4 * len(model.blocks) + bf16
    first, reorders = infer()
    assert reorders == products
    gpsa = model.blocks[0].attn
    assert gpsa._frozen_cache["qkv_weight"][1] in _linear._derived_weights
    again, reorders = infer()
    assert reorders == 0 and torch.equal(again, first) and torch.equal(infer(pack=False)[0], first)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # as the trials step
    model(x).logsumexp(-1).sum().backward()
    infer()
    optimizer.step()
    stepped, reorders = infer()
    assert reorders == products
    assert torch.equal(stepped, infer(pack=False)[0]) and not torch.equal(stepped, first)


# --- bf16 inference on the bf16 kernel's linear (csrc/linear_bf16.h) -----------------------------

KERNEL_LINEAR = "locality_search.linear_bf16"


@pytest.fixture
def kernel_linear(monkeypatch, kernel_backends, onednn_bf16):
    """The bf16 kernel's linear forced on (where the bf16 kernel is built: AVX512-BF16)."""
    if kernels.cpu_library(torch.bfloat16) is None:
        pytest.skip(f"the bf16 CPU kernel is not built here: {kernels.cpu_library_error(torch.bfloat16)}")
    kernel_backends(bf16_kernel_linear=True)
    monkeypatch.setattr(_linear, "kernel_bf16_linear_beats_onednn_here", lambda: True)


def _rounded_once(x, weight, bias, gelu: bool) -> torch.Tensor:
    """The float64 product of the bf16-rounded operands (the bias rounded too, as autocast casts it),
    the exact GELU after it if asked, rounded to bf16 once."""
    out = F.linear(*(None if t is None else t.bfloat16().double() for t in (x, weight, bias)))
    return (F.gelu(out) if gelu else out).bfloat16()


@pytest.mark.parametrize("case", ["autocast", "bf16 tensors"])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("shape, out_features, with_bias", [
    ((8, 197, 192), 576, True),   # ConViT-Ti's qkv: 9 groups of 64 columns; 1,576 rows, a 4-row tail tile
    ((300, 96), 160, False),      # 2 groups of 64 + one of 32 columns; 300 rows = 3 blocks of 96 + 12
    ((2, 3, 40, 64), 48, True),   # 3 vectors of columns (8-row tiles)
    ((5, 66), 16, True),          # one vector (12-row tiles), a single 5-row tile
])
def test_kernel_linear_is_the_float64_product_rounded_once(kernel_linear, case, gelu, shape, out_features, with_bias):
    """One kernel op (no oneDNN, addmm, mm or GELU op) whose output is the float64 product of the bf16
    operands (plus the bias, then the exact GELU) rounded to bf16 once: the float32 sums differ in
    the last bits, so a rare output is one bf16 step off."""
    torch.manual_seed(0)
    x, weight = torch.randn(*shape), torch.randn(out_features, shape[-1]) / shape[-1] ** 0.5
    x, weight, bias = _bf16_operands(case, x, weight, torch.randn(out_features) if with_bias else None)
    expected = _rounded_once(x, weight, bias, gelu)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"), torch.inference_mode():
        with OpCalls() as ops:
            out = kernels.linear(x, weight, bias, gelu=gelu)
    assert ops.calls.get(KERNEL_LINEAR) == 1 and ONEDNN not in ops.calls
    assert not {"aten.gelu", "aten.gelu_", "aten.addmm", "aten.mm"} & set(ops.calls)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], out_features)
    assert (out == expected).double().mean() > 0.99
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2 ** -7)


def test_kernel_linear_reads_rows_at_any_offset(kernel_linear):
    """bf16 rows starting at an odd element (not 32-bit aligned, as the kernel reads pairs) are
    copied first, not misread."""
    torch.manual_seed(0)
    flat = torch.randn(300 * 96 + 1).bfloat16()
    x, weight = flat[1:].view(300, 96), torch.randn(64, 96).bfloat16()
    assert x.data_ptr() % 4 == 2
    with torch.inference_mode():
        with OpCalls() as ops:
            out = kernels.linear(x, weight)
    assert ops.calls.get(KERNEL_LINEAR) == 1
    torch.testing.assert_close(out.float(), _rounded_once(x, weight, None, False).float(), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("case", ["columns not in vectors", "odd in_features", "inference tensor", "view",
                                  "switched off", "not measured here"])
def test_where_bf16_inference_keeps_onednn(kernel_linear, monkeypatch, kernel_backends, case):
    """The kernel takes whole vectors of output columns (a multiple of 16: not a 1000-class head),
    bf16 pairs along in_features (even), and weights it can keep in its layout (tracked: not
    inference tensors, not views); else, switched off, or on CPUs where it was not measured to win,
    oneDNN runs the product, with the same result up to the last bits."""
    torch.manual_seed(0)
    out_features, in_features = {"columns not in vectors": (1000, 96), "odd in_features": (64, 95)}.get(case, (64, 96))
    x = torch.randn(300, in_features)
    weight = torch.randn(in_features, out_features).t() if case == "view" else torch.randn(out_features, in_features)
    if case == "switched off":
        kernel_backends(bf16_kernel_linear=False)
    if case == "not measured here":
        monkeypatch.setattr(_linear, "kernel_bf16_linear_beats_onednn_here", lambda: False)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        if case == "inference tensor":
            weight = torch.randn(out_features, in_features)
        with OpCalls() as ops:
            out = kernels.linear(x, weight)
    assert ops.calls.get(ONEDNN) == 1 and KERNEL_LINEAR not in ops.calls
    torch.testing.assert_close(out.float(), _rounded_once(x, weight, None, False).float(), atol=1e-6, rtol=2 ** -7)


def test_kernel_linear_keeps_its_weight_and_follows_its_changes(kernel_linear):
    """The weight is laid out for the kernel once and reused; an in-place change (an optimizer step,
    load_state_dict) makes a new layout, and the output follows it. Float32 and oneDNN's bf16
    layouts, kept beside it, are not mixed up with it."""
    torch.manual_seed(0)
    layer, x = kernels.Linear(96, 384), torch.randn(2, 700, 96)

    def infer() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            out = layer(x)
        return out, _linear._derived_weights[layer.weight][_linear._KERNEL_BF16][1]

    first, kept = infer()
    again, kept_again = infer()
    assert kept_again is kept and torch.equal(again, first)
    assert kept.shape == (48, 384) and kept.dtype == torch.int32
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5, fused=True)  # as the trials step
    layer(x).square().sum().backward()
    optimizer.step()
    stepped, kept_stepped = infer()
    assert kept_stepped is not kept and not torch.equal(stepped, first)
    torch.testing.assert_close(stepped.float(), _rounded_once(x, layer.weight, layer.bias, False).float(),
                               atol=1e-6, rtol=2 ** -7)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    doubled, kept_doubled = infer()
    assert kept_doubled is not kept_stepped
    torch.testing.assert_close(doubled.float(), _rounded_once(x, layer.weight, layer.bias, False).float(),
                               atol=1e-6, rtol=2 ** -7)


def test_kernel_linear_op_refuses_what_it_cannot_take(kernel_linear):
    op = kernels.cpu_library(torch.bfloat16).linear_bf16
    x, packed = torch.randn(10, 96).bfloat16(), torch.zeros(48, 64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="packed contiguous int32"):
        op(x, torch.zeros(47, 64, dtype=torch.int32), None, False)  # K / 2 rows
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(x, torch.zeros(48, 40, dtype=torch.int32), None, False)
    with pytest.raises(RuntimeError, match="x contiguous bf16"):
        op(x.float(), packed, None, False)
    with pytest.raises(RuntimeError, match="bias contiguous bf16"):
        op(x, packed, torch.zeros(64), False)


def test_flop_counter_counts_the_kernel_linear_as_f_linear(kernel_linear):
    x, weight, bias = torch.randn(300, 96), torch.randn(160, 96), torch.randn(160)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        with OpCalls() as ops:
            kernels.linear(x, weight, bias)
        assert ops.calls.get(KERNEL_LINEAR) == 1
        with FlopCounterMode(display=False) as counted:
            kernels.linear(x, weight, bias)
    assert counted.get_total_flops() == 2 * 300 * 96 * 160


def test_models_on_the_kernel_linear_are_as_close_to_float32_as_on_onednn(kernel_linear, kernel_backends):
    """ls_convit_micro's bf16 inference with its linears on the kernel: near oneDNN's logits, and no
    further from float32's than they are (give or take bf16 noise)."""
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_micro", num_classes=10).eval()
    x = torch.randn(16, 1, 28, 28)
    with torch.inference_mode():
        full = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with OpCalls() as ops:
                kernel = model(x)
            assert ops.calls.get(KERNEL_LINEAR, 0) >= 4 * len(model.blocks) - 1  # GPSA's fused qkv too
            kernel_backends(bf16_kernel_linear=False)
            onednn = model(x)
    torch.testing.assert_close(kernel.float(), onednn.float(), atol=0.05, rtol=0.05)
    assert (kernel.float() - full).abs().max() <= 1.5 * (onednn.float() - full).abs().max()
