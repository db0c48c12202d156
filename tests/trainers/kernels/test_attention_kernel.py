"""The fused CPU attention kernels (`trainers/kernels/_library.py`, `csrc/attention_core.cpp`
in bf16, `csrc/attention_core_fp32.cpp` in float32), each where its CPU can run it: it builds; its
outputs, gradients and the gate's sums (GPSA), or the score mask's gradient (GMM attention), match the papers' formulas in float64 for every token count its vector tails can meet,
several head dims, the projection's strided layout and a contiguous one; the float32 backward gives
the same bits from the softmax maps its forward kept as from recomputing them; the core gives the
same outputs and gradients on it as on torch ops. Where it cannot be built the core falls back with one warning saying why, and
concurrent first uses build it once."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import trainers.models  # noqa: F401  (registers ls_convit_* with timm)

from trainers import kernels
from trainers.kernels import _attention_core, _library
from trainers.throughput import count_flops

from tests._layers import float32_avx2_kernel_or_skip, run_layer

REPO = Path(__file__).resolve().parents[3]
_SWITCHED_ON = os.environ.get("LOCALITY_SEARCH_CPU_KERNELS", "1") != "0"
_CAPABILITY = torch.backends.cpu.get_cpu_capability()
CAN_BUILD = {
    torch.bfloat16: (sys.platform == "linux" and _CAPABILITY.startswith("AVX512") and _SWITCHED_ON
                     and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
    torch.float32: sys.platform == "linux" and (_CAPABILITY.startswith("AVX512") or _CAPABILITY == "AVX2") and _SWITCHED_ON,
}
WHY_NOT = {torch.bfloat16: "the bf16 attention kernel needs Linux and an AVX512-BF16 CPU",
           torch.float32: "the float32 attention kernel needs Linux and an AVX2 or AVX-512 CPU"}
# tolerances relative to the largest value: bf16 rounds A, dS and the products; float32 only sums
OUT_TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-5}
GRAD_TOL = {torch.bfloat16: 1.5e-2, torch.float32: 5e-5}


def _skip_unless_built(dtype):
    if not CAN_BUILD[dtype]:
        pytest.skip(WHY_NOT[dtype])


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32, "fp32-avx2"], ids=["bf16", "fp32", "fp32-avx2"])
def kernel(request):
    """(dtype, its ops), for each kernel this CPU can run; and on an AVX-512 CPU, whose float32 build
    has 16 lanes, also the 8-lane AVX2 build the AVX2-only machines run."""
    if request.param == "fp32-avx2":
        _skip_unless_built(torch.float32)
        return torch.float32, float32_avx2_kernel_or_skip()
    _skip_unless_built(request.param)
    ops = kernels.cpu_library(request.param)
    assert ops is not None, f"the {request.param} kernel did not build here: {kernels.cpu_library_error(request.param)}"
    return request.param, ops


def _inputs(batch, heads, tokens, dim, gated, layout, seed=0, dtype=torch.bfloat16):
    """qkv (3, B, H, N, d) in `dtype` as the projection's (B, N, 3, H, d) output permuted, or
    contiguous; gate and pos (float32, or None); an upstream gradient for out."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "projection":
        qkv = torch.randn(batch, tokens, 3, heads, dim, generator=gen).to(dtype).permute(2, 0, 3, 1, 4)
    else:
        qkv = torch.randn(3, batch, heads, tokens, dim, generator=gen).to(dtype)
    gate = torch.rand(heads, generator=gen) if gated else None
    pos = torch.softmax(torch.randn(heads, tokens, tokens, generator=gen), -1) if gated else None
    d_out = torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype)
    return qkv, gate, pos, d_out


def _score_mask(heads, tokens, seed=1):
    """A GMM-like mask (H, N, N), float32: either sign, some entries exactly 0 (underflowed kernels)."""
    mask = 2 * torch.randn(heads, tokens, tokens, generator=torch.Generator().manual_seed(seed))
    return mask.masked_fill(mask.abs() < 0.2, 0.)


def _reference(qkv, gate, pos, scale, mask=None):
    """out and the maps in float64 from the same (bf16) inputs, differentiable."""
    q, k, v = qkv.unbind(0)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores * mask
    soft = torch.softmax(scores, -1)
    attn = soft if pos is None else (1 - gate.view(-1, 1, 1)) * soft + gate.view(-1, 1, 1) * pos
    return attn @ v, scores, soft


def _relative(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


TOKENS = [1, 7, 8, 9, 15, 16, 17, 49, 50, 65, 197]  # tails of 1..16 lanes, ConViT's 49/50, 65 and 197
# head dims of 1..5 vectors (9 in float32): the GEMMs' column blocks and tails; 12 and 20 fill no
# whole vector on any ISA, so the products go through the padded buffer, not straight into out
DIMS = [8, 12, 20, 24, 64, 72]


@pytest.mark.parametrize("mix", ["gated", "plain", "masked"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_forward_and_backward_match_float64(kernel, tokens, dim, mix):
    dtype, ops = kernel
    gated = mix == "gated"
    batch, heads, scale = 3, 4, dim ** -0.5
    qkv, gate, pos, d_out = _inputs(batch, heads, tokens, dim, gated, "projection", dtype=dtype)
    mask = _score_mask(heads, tokens) if mix == "masked" else None
    out = torch.empty(batch, tokens, heads, dim, dtype=dtype).transpose(1, 2)
    row_max, row_inv, no_maps = ops.attention_forward(qkv, gate, pos, mask, scale, out, True, False)
    assert no_maps.numel() == 0

    qkv64 = qkv.double().requires_grad_()
    gate64 = gate.double().requires_grad_() if gated else None
    pos64 = pos.double().requires_grad_() if gated else None
    mask64 = mask.double().requires_grad_() if mask is not None else None
    out64, scores64, soft64 = _reference(qkv64, gate64, pos64, scale, mask64)
    # bf16 rounds A, then out: within 1% of the largest output
    assert _relative(out, out64.detach()) < OUT_TOL[dtype]
    # the rows' statistics the backward recomputes the maps from
    torch.testing.assert_close(row_max.double(), scores64.detach().amax(-1).flatten(), atol=1e-5, rtol=1e-5)
    sums = torch.exp(scores64.detach() - scores64.detach().amax(-1, keepdim=True)).sum(-1).flatten()
    torch.testing.assert_close(row_inv.double(), 1 / sums, atol=0, rtol=1e-5)
    # inference: the same output, nothing kept
    again = torch.empty_like(out)
    empty_max, empty_inv, _ = ops.attention_forward(qkv, gate, pos, mask, scale, again, False, False)
    assert torch.equal(again, out) and empty_max.numel() == empty_inv.numel() == 0

    out64.backward(d_out.double())
    d_qkv = torch.empty_like(qkv)  # the projection's layout, as qkv
    coef = scale * (torch.ones(heads) if gate is None else 1 - gate)
    sums = mix != "plain"
    d_attn_sum, dots = ops.attention_backward(d_out, qkv, gate, pos, mask, row_max, row_inv, no_maps, coef, scale,
                                              d_qkv, sums)
    assert d_qkv.stride() == qkv.stride()
    assert _relative(d_qkv, qkv64.grad) < GRAD_TOL[dtype]  # bf16: dS and the products rounded
    if gated:  # sum_b dA and sum <dA, soft> per head: float32 from the inputs, no rounding
        d_attn = d_out.double() @ qkv.double()[2].transpose(-1, -2)
        torch.testing.assert_close(d_attn_sum.double(), d_attn.sum(0), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(dots.double(), (d_attn * soft64.detach()).sum((0, 2, 3)), atol=1e-4, rtol=1e-5)
        # and so the gate's and P's gradients, as the core forms them
        torch.testing.assert_close((d_attn_sum * gate.view(-1, 1, 1)).double(), pos64.grad, atol=1e-4, rtol=1e-5)
        d_gate = (d_attn_sum * pos).sum((1, 2)) - dots
        torch.testing.assert_close(d_gate.double(), gate64.grad, atol=1e-3, rtol=1e-4)
    if mask is not None:  # the mask's gradient, sum_b over its (H, N, N)
        assert _relative(d_attn_sum, mask64.grad) < GRAD_TOL[dtype]
    # without the sums: the same d_qkv, nothing else
    alone = torch.empty_like(qkv)
    empty_sum, empty_dots = ops.attention_backward(d_out, qkv, gate, pos, mask, row_max, row_inv, no_maps, coef, scale,
                                                   alone, False)
    assert torch.equal(alone, d_qkv) and empty_sum.numel() == empty_dots.numel() == 0
    if dtype != torch.float32:
        return
    # float32 with the softmax maps kept: the same forward; the maps softmax(S), key-major (a key per
    # row, its queries along it, padded with zeros); from them the same backward, bit for bit, with
    # and without the sums
    kept_out = torch.empty_like(out)
    *kept_stats, maps = ops.attention_forward(qkv, gate, pos, mask, scale, kept_out, True, True)
    assert torch.equal(kept_out, out) and all(torch.equal(a, b) for a, b in zip(kept_stats, (row_max, row_inv)))
    maps = maps.view(batch, heads, tokens, -1)
    assert maps.shape[-1] >= tokens and maps.shape[-1] % 8 == 0
    torch.testing.assert_close(maps[..., :tokens].double(), soft64.detach().transpose(-1, -2), atol=1e-6, rtol=1e-5)
    assert not maps[..., tokens:].any()
    for with_sums, expected in ((sums, (d_attn_sum, dots)), (False, (empty_sum, empty_dots))):
        d_kept = torch.empty_like(qkv)
        got = ops.attention_backward(d_out, qkv, gate, pos, mask, row_max, row_inv, maps.flatten(), coef, scale,
                                     d_kept, with_sums)
        assert torch.equal(d_kept, d_qkv)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_any_layout_gives_the_same_bits(kernel):
    """The projection's strided layout and a contiguous copy: the same output and gradients."""
    dtype, ops = kernel
    qkv, gate, pos, d_out = _inputs(2, 4, 49, 24, True, "projection", dtype=dtype)
    results = []
    for q in (qkv, qkv.contiguous()):
        out = torch.empty(2, 4, 49, 24, dtype=dtype)
        keep_maps = dtype == torch.float32
        saved = ops.attention_forward(q, gate, pos, None, 0.2, out, True, keep_maps)
        d_qkv = torch.empty_like(q)
        ops.attention_backward(d_out, q, gate, pos, None, *saved, 0.2 * (1 - gate), 0.2, d_qkv, False)
        results.append((out, d_qkv))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_nan_stays_in_its_row(kernel):
    dtype, ops = kernel
    qkv, gate, pos, _ = _inputs(2, 4, 49, 24, True, "contiguous", dtype=dtype)
    qkv[0, 1, 2, 7, 3] = float("nan")  # q of batch 1, head 2, token 7
    out = torch.empty(2, 4, 49, 24, dtype=dtype)
    ops.attention_forward(qkv, gate, pos, None, 0.2, out, False, False)
    assert out[1, 2, 7].isnan().all()
    out[1, 2, 7] = 0
    assert out.isfinite().all()


def test_bad_inputs_are_refused_with_a_message(kernel):
    dtype, ops = kernel
    qkv, gate, pos, _ = _inputs(2, 4, 9, 8, True, "contiguous", dtype=dtype)
    out = torch.empty(2, 4, 9, 8, dtype=dtype)
    other, name = (torch.float32, "bfloat16") if dtype == torch.bfloat16 else (torch.bfloat16, "float32")
    with pytest.raises(RuntimeError, match=name):
        ops.attention_forward(qkv.to(other), gate, pos, None, 0.2, out, True, False)
    with pytest.raises(RuntimeError, match="unit stride along d"):
        ops.attention_forward(qkv.transpose(3, 4), gate, pos, None, 0.2, out, True, False)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="even head dim"):
            ops.attention_forward(qkv[..., :7], gate, pos, None, 0.2, out[..., :7], True, False)  # even strides, odd d
    with pytest.raises(RuntimeError, match="pos"):
        ops.attention_forward(qkv, gate, pos[:, :8], None, 0.2, out, True, False)
    with pytest.raises(RuntimeError, match="come together"):
        ops.attention_forward(qkv, gate, None, None, 0.2, out, True, False)
    with pytest.raises(RuntimeError, match="out"):
        ops.attention_forward(qkv, gate, pos, None, 0.2, out[:1], True, False)
    mask = _score_mask(4, 9)
    with pytest.raises(RuntimeError, match="not both"):
        ops.attention_forward(qkv, gate, pos, mask, 0.2, out, True, False)
    with pytest.raises(RuntimeError, match="mask"):
        ops.attention_forward(qkv, None, None, mask[:, :8], 0.2, out, True, False)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="recomputes its maps"):
            ops.attention_forward(qkv, gate, pos, None, 0.2, out, True, True)
        stats = ops.attention_forward(qkv, gate, pos, None, 0.2, out, True, False)[:2]
        with pytest.raises(RuntimeError, match="recomputes its maps"):
            ops.attention_backward(out, qkv, gate, pos, None, *stats, torch.zeros(2 * 4 * 9 * 16), 1 - gate, 0.2,
                                   torch.empty_like(qkv), False)
    else:
        *stats, maps = ops.attention_forward(qkv, gate, pos, None, 0.2, out, True, True)
        with pytest.raises(RuntimeError, match="maps"):  # kept for another shape
            ops.attention_backward(out, qkv, gate, pos, None, *stats, maps[1:], 1 - gate, 0.2, torch.empty_like(qkv),
                                   False)


@pytest.fixture(params=[True, False], ids=["fused_kernel", "torch_ops"])
def fused_kernel(request, kernel_backends):
    kernel_backends(libraries=request.param)
    return request.param


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_core_outputs_and_gradients_match_float64_on_either_path(fused_kernel, gemm_dtype, gated, monkeypatch):
    """gated_attention / attention against the formulas in float64, with the kernel and without,
    from the projection's layout; the gradient comes back in that layout."""
    if fused_kernel:
        _skip_unless_built(gemm_dtype)
    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: True)  # bf16 GEMMs, any CPU
    B, H, N, d = 3, 4, 49, 8
    gen = torch.Generator().manual_seed(0)
    projection = torch.randn(B, N, 3, H, d, generator=gen, dtype=torch.float64)
    qkv64 = projection.permute(2, 0, 3, 1, 4)
    gate64 = torch.rand(H, generator=gen, dtype=torch.float64)
    pos64 = torch.softmax(torch.randn(H, N, N, generator=gen, dtype=torch.float64), -1)
    w = torch.randn(B, H, N, d, generator=gen, dtype=torch.float64)
    scale = d ** -0.5

    inputs64 = [qkv64.detach().requires_grad_(), gate64.requires_grad_(), pos64.requires_grad_()]
    out64 = _reference(*inputs64, scale)[0] if gated else _reference(inputs64[0], None, None, scale)[0]
    (out64 * w).sum().backward()
    expected = [out64.detach(), inputs64[0].grad] + ([t.grad for t in inputs64[1:]] if gated else [])

    qkv = projection.to(gemm_dtype).permute(2, 0, 3, 1, 4).requires_grad_()
    gate = gate64.detach().float().requires_grad_()
    pos = pos64.detach().float().requires_grad_()
    out = (_attention_core.gated_attention(qkv, gate, pos, scale) if gated
           else _attention_core.explicit_core_attention(qkv, scale))
    (out.double() * w).sum().backward()
    assert qkv.grad.stride() == qkv.stride()  # the linear's backward reads it as it is
    got = [out.detach(), qkv.grad] + ([gate.grad, pos.grad] if gated else [])
    tol = 2e-5 if gemm_dtype == torch.float32 else 3e-2
    for name, a, b in zip(["out", "d_qkv", "d_gate", "d_pos"], got, expected):
        err = _relative(a, b)
        assert err < tol, f"{name}: relative error {err:.1e} (kernel {fused_kernel}, {gemm_dtype})"


@pytest.mark.parametrize("gated", [True, False])
def test_inference_on_the_kernel_matches_torch_ops(kernel, gated, monkeypatch, kernel_backends):
    dtype, ops = kernel
    if ops is not kernels.cpu_library(dtype):
        pytest.skip("the core runs this CPU's own build")
    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: True)
    qkv, gate, pos, _ = _inputs(5, 4, 50, 8, gated, "projection", seed=2, dtype=dtype)
    with torch.no_grad():
        run = (lambda: _attention_core.gated_attention(qkv, gate, pos, 0.3)) if gated else (
            lambda: _attention_core.explicit_core_attention(qkv, 0.3))
        with _CustomOps() as recorder:
            fused = run()
        kernel_backends(libraries=False)
        separate = run()
    assert recorder.seen == {_library._KERNELS[dtype].namespace + ".attention_forward"}
    # the same up to where bf16 roundings land (torch's GEMM rounds S to bf16, the kernel keeps it
    # in float32); in float32 up to the order of the sums
    torch.testing.assert_close(fused.float(), separate.float(), atol=3e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)


class _CustomOps(TorchDispatchMode):
    """Records the kernels' ops dispatched inside it, as "namespace.op", and how often each ran."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    @property
    def seen(self) -> set[str]:
        return set(self.calls)

    @property
    def core_calls(self) -> dict[str, int]:
        """The attention core's ops only (bf16 inference may also run its linears on the kernel)."""
        return {name: n for name, n in self.calls.items() if ".attention_" in name}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace.startswith("locality_search"):
            self.calls[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


class _KeptMaps(TorchDispatchMode):
    """Records the size of the maps each float32 kernel backward got (0: recomputed)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "attention_backward" and func.namespace.startswith("locality_search"):
            self.sizes.append(args[7].numel())  # (d_out, qkv, gate, pos, mask, row_max, row_inv, maps, ...)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mix", ["gated", "masked"])
def test_the_float32_core_keeps_small_maps_and_recomputes_large_ones_to_the_same_bits(mix, monkeypatch):
    """Training in float32: the forward keeps the softmax maps when they fit KEPT_MAPS_BYTES and the
    backward uses them; over it they are recomputed; either way the same output and gradients."""
    _skip_unless_built(torch.float32)
    B, H, N, d = 3, 4, 49, 8
    qkv0, gate0, pos0, d_out = _inputs(B, H, N, d, True, "projection", dtype=torch.float32)
    mask0 = _score_mask(H, N)
    padded_bytes = B * H * N * 64 * 4  # N rows padded to 64 floats (upper bound: 16 lanes)

    def run(budget):
        monkeypatch.setattr(_library, "KEPT_MAPS_BYTES", budget)
        qkv, gate, pos, mask = (t.clone().requires_grad_() for t in (qkv0, gate0, pos0, mask0))
        with _KeptMaps() as recorder:
            if mix == "gated":
                out = _attention_core.gated_attention(qkv, gate, pos, 0.3)
                inputs = (qkv, gate, pos)
            else:
                out = _attention_core.masked_attention(qkv, mask, 0.3)
                inputs = (qkv, mask)
            (out * d_out).sum().backward()
        return recorder.sizes, [out.detach()] + [t.grad for t in inputs]

    kept_sizes, kept = run(padded_bytes)
    recomputed_sizes, recomputed = run(padded_bytes - 1)
    assert len(kept_sizes) == 1 and B * H * N * N <= kept_sizes[0] <= B * H * N * 64
    assert recomputed_sizes == [0]
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("train", [True, False])
def test_convit_runs_the_kernel_of_its_gemms_dtype(precision, train, monkeypatch):
    """GPSA and plain attention blocks under bf16 autocast with bf16 GEMMs: the bf16 kernel, forward
    and backward; in float32 the float32 one, where GPSA runs as the fused layer (its projections
    with the core: `_gpsa_layer`). Each block once per direction (the nano model: one GPSA block,
    one plain)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    _skip_unless_built(dtype)
    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: True)
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_nano").train(train)
    x = torch.randn(4, 1, 28, 28)
    with _CustomOps() as recorder, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with torch.set_grad_enabled(train):
            loss = model(x).float().sum()
        if train:
            loss.backward()
    namespace = _library._KERNELS[dtype].namespace
    blocks = len(model.blocks)
    gpsa = model.local_up_to_layer if precision == "fp32" else 0  # blocks on the fused layer
    attention_calls = {op: n for op, n in recorder.calls.items()
                       if ".attention_" in op or ".gpsa_layer_" in op}  # (not the norms: test_norm)
    expected = {f"{namespace}.attention_forward": blocks - gpsa, f"{namespace}.gpsa_layer_forward": gpsa}
    if train:
        expected.update({f"{namespace}.attention_backward": blocks - gpsa, f"{namespace}.gpsa_layer_backward": gpsa})
    assert attention_calls == {op: n for op, n in expected.items() if n}


def test_torch_fused_cpu_attention_counts_its_products_forward_and_backward():
    """FlopCounterMode counts torch's fused CPU attention as torch counts its CUDA kernels (our
    formulas, `_attention_core`; torch has none for the CPU one, where a plain block's attention
    counted 0): the two products forward (2 per multiply-add), five backward."""
    B, H, L, S, E = 2, 4, 50, 40, 8
    q = torch.randn(B, H, L, E, requires_grad=True)
    k, v = torch.randn(B, H, S, E, requires_grad=True), torch.randn(B, H, S, E, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = F.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == 2 * 2 * B * H * L * S * E
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 5 * 2 * B * H * L * S * E


@pytest.mark.parametrize("name", ["ls_convit_nano", "ls_gmm_nano"])
def test_flops_are_the_same_on_the_kernel_as_on_torch_ops(name, kernel_backends):
    """The trials' `flops` column (`count_flops`) counts the core's two products on the kernel too (a
    custom op FlopCounterMode knew nothing of: ConViT's attention went uncounted), also for a model
    whose first forward is the counted one (the kernel loads, registering its formula, during it)."""
    _skip_unless_built(torch.float32)
    counts = {}
    for fused in (False, True):
        kernel_backends(libraries=fused)
        counts[fused] = count_flops(timm.create_model(name), (1, 28, 28))
    assert counts[True] == counts[False]
    # and in a fresh process, where the kernel is loaded by the counted model's forward
    script = textwrap.dedent(f"""
        import timm, trainers.models
        from trainers.throughput import count_flops
        print(count_flops(timm.create_model({name!r}), (1, 28, 28)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == counts[False]


@pytest.mark.parametrize("train", [True, False])
def test_gmm_attention_on_the_float32_kernel_matches_its_torch_ops(train, kernel_backends):
    """GMMAttention in float32: on the kernel (forward, and backward when training) with the same
    output and gradients (x, the projections, alpha and sigma through the mask) as on its torch ops;
    with attention dropout while training, the torch ops."""
    from trainers.models.ls_gmm import GMMAttention

    _skip_unless_built(torch.float32)
    torch.manual_seed(0)
    layer = GMMAttention(48, num_heads=4, num_kernels=3).train(train)
    x = torch.randn(3, 49, 48)  # a 7 x 7 grid

    def run():
        layer.zero_grad()
        inputs = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = layer(inputs)
            if train:
                (out * torch.linspace(-1, 1, 48)).sum().backward()
        grads = [inputs.grad] + [p.grad for p in layer.parameters()] if train else []
        return out.detach(), grads

    with _CustomOps() as recorder:
        fused, fused_grads = run()
    namespace = _library._KERNELS[torch.float32].namespace
    assert recorder.calls == ({f"{namespace}.attention_forward": 1, f"{namespace}.attention_backward": 1}
                              if train else {f"{namespace}.attention_forward": 1})
    kernel_backends(libraries=False)
    separate, separate_grads = run()
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-5)
    names = ["x"] + [name for name, _ in layer.named_parameters()] if train else []
    for name, a, b in zip(names, fused_grads, separate_grads):
        assert _relative(a, b.double()) < 2e-5, name
    if train:
        kernel_backends(libraries=True)
        layer.attn_drop.p = 0.1
        with _CustomOps() as recorder:
            run()
        assert recorder.calls == {}


@pytest.mark.parametrize("train", [True, False])
def test_gmm_attention_under_bf16_autocast_runs_the_bf16_kernel_as_close_to_float64_as_torch_ops(train,
                                                                                                  kernel_backends):
    """GMMAttention under bf16 autocast on bf16 hardware: on the bf16 kernel (forward, and backward
    when training), its output and gradients (x, the projections, alpha and sigma through the mask)
    as close to the float64 layer's as its torch ops under the same autocast are."""
    import copy

    from trainers.models.ls_gmm import GMMAttention

    _skip_unless_built(torch.bfloat16)
    torch.manual_seed(0)
    layer = GMMAttention(48, num_heads=4, num_kernels=3).train(train)
    x = torch.randn(3, 49, 48)  # a 7 x 7 grid
    weights = torch.linspace(-1, 1, 48)

    def run(module, dtype, bf16):
        return run_layer(module, x, dtype=dtype, bf16=bf16, train=train, upstream=weights)

    reference = run(copy.deepcopy(layer).double(), torch.float64, False)
    with _CustomOps() as recorder:
        fused = run(layer, torch.float32, True)
    namespace = _library._KERNELS[torch.bfloat16].namespace
    assert recorder.core_calls == ({f"{namespace}.attention_forward": 1, f"{namespace}.attention_backward": 1}
                                   if train else {f"{namespace}.attention_forward": 1})
    kernel_backends(libraries=False)
    separate = run(layer, torch.float32, True)
    names = ["out", "x"] + [name for name, _ in layer.named_parameters()] if train else ["out"]
    for name, a, b, ref in zip(names, fused, separate, reference):
        fused_error, ops_error = _relative(a, ref), _relative(b, ref)
        # bf16 rounds the projections' inputs and outputs on either path: a few 1e-3 of the largest value
        assert fused_error < max(2 * ops_error, 1e-3) and fused_error < 3e-2, (name, fused_error, ops_error)


def _python(code: str, env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          cwd=cwd, capture_output=True, text=True, timeout=600)


PROBE = """
    import warnings
    warnings.simplefilter("error")  # the fallback's warning would fail the probe
    import torch
    from trainers import kernels
    ops = kernels.cpu_library(torch.float32)
    print("kernel" if ops is not None else "fallback", kernels.cpu_library_error(torch.float32))
"""


def test_switched_off_by_the_environment_without_a_warning(tmp_path):
    done = _python(PROBE, {"LOCALITY_SEARCH_CPU_KERNELS": "0", "XDG_CACHE_HOME": str(tmp_path),
                           "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "fallback" and not list(tmp_path.iterdir())


def test_without_a_compiler_the_core_warns_once_and_falls_back(tmp_path):
    code = """
        import shutil, warnings
        shutil.which = lambda name, *a, **k: None  # no g++ / c++ on PATH
        import torch
        from trainers.kernels import _attention_core
        _attention_core.cpu_has_native_bf16 = lambda: True  # bf16 GEMMs: where the kernel would run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qkv = torch.randn(3, 2, 4, 9, 8).bfloat16().requires_grad_()
            out = _attention_core.gated_attention(qkv, torch.rand(4), torch.rand(4, 9, 9), 0.3)
            out.sum().backward()
            _attention_core.explicit_core_attention(qkv, 0.3).sum().backward()
            q32 = torch.randn(3, 2, 4, 9, 8).requires_grad_()  # float32: the other kernel
            _attention_core.gated_attention(q32, torch.rand(4), torch.rand(4, 9, 9), 0.3).sum().backward()
            _attention_core.explicit_core_attention(q32, 0.3).sum().backward()
        messages = [str(w.message) for w in caught if "fused CPU attention kernel" in str(w.message)]
        print(len(messages), " | ".join(messages))
    """
    done = _python(code, {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    count, messages = done.stdout.split(" ", 1)
    assert count == "2", done.stdout  # one warning per kernel, not one per call
    bf16_message, fp32_message = messages.split(" | ")
    for dtype, message in ((torch.bfloat16, bf16_message), (torch.float32, fp32_message)):
        assert str(dtype).removeprefix("torch.") in message
        if CAN_BUILD[dtype]:
            assert "no C++ compiler (install g++" in message, done.stdout


def test_concurrent_first_uses_build_once_and_both_load(tmp_path):
    _skip_unless_built(torch.float32)  # the float32 kernel: it builds on every CPU these VMs have
    env = {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(PROBE)], env={**os.environ, **env}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.split()[0] == "kernel", err
    kernels_dir = tmp_path / "locality-search" / "kernels"
    built = list(kernels_dir.rglob("*.so"))
    assert len(built) == 1
    # one build folder (cpp_extension's, its lock an OS-level lock on a file left in place), no other
    assert [p.name for p in kernels_dir.iterdir()] == [built[0].parent.name]
