"""The fused CPU kernel for the attention core's map passes (`trainers/models/_attention_maps.py`,
`csrc/attention_maps.cpp`): it builds where it should, matches the papers' formulas in float64 for
every token count its vector tails can meet, both row layouts and both dtypes, and the core gives
the same outputs and gradients on it as on separate torch ops. Where it cannot be built the core
falls back with one warning saying why, and concurrent first uses build it once."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainers.models  # noqa: F401  (registers ls_convit_* with timm)

from trainers.models import _attention_core, _attention_maps

REPO = Path(__file__).resolve().parents[1]
CAN_BUILD = (sys.platform == "linux" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
             and os.environ.get("LOCALITY_SEARCH_CPU_KERNELS", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="the fused map kernel needs Linux and an AVX-512 CPU")


@pytest.fixture(scope="module")
def ops():
    if not CAN_BUILD:
        pytest.skip("the fused map kernel needs Linux and an AVX-512 CPU")
    kernels = _attention_maps.kernels()
    assert kernels is not None, f"the kernel did not build on an AVX-512 CPU: {_attention_maps.build_error()}"
    return kernels


def _maps(batch, heads, tokens, dtype, heads_first, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(batch * heads, tokens, tokens, generator=gen)).to(dtype)
    gate = torch.rand(heads, generator=gen)
    pos = torch.softmax(torch.randn(heads, tokens, tokens, generator=gen), -1)
    d_attn = torch.randn(batch * heads, tokens, tokens, generator=gen).to(dtype)
    return scores, gate, pos, d_attn


def _per_row_head(batch, heads, tokens, heads_first):
    """(rows, 1, 1) views: each map's gate index, as the kernel's layouts order them."""
    if heads_first:
        return torch.arange(heads).repeat_interleave(batch)
    return torch.arange(heads).repeat(batch)


TOKENS = [1, 15, 16, 17, 49, 50, 65, 197]  # tails of 1..16 lanes, ConViT's 49/50, 65 and 197


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("tokens", TOKENS)
def test_forward_matches_the_mix_of_softmax_and_p(ops, dtype, heads_first, tokens):
    batch, heads = 3, 4
    scores, gate, pos, _ = _maps(batch, heads, tokens, dtype, heads_first)
    head = _per_row_head(batch, heads, tokens, heads_first)
    soft = torch.softmax(scores.double(), -1)
    g = gate.double()[head].view(-1, 1, 1)
    mixed = (1 - g) * soft + g * pos.double()[head]
    attn, row_max, row_inv = ops.maps_forward(scores, gate, pos, heads, heads_first, True, False)
    plain, _, _ = ops.maps_forward(scores, None, None, heads, heads_first, False, False)
    assert attn.dtype == plain.dtype == dtype and attn.shape == scores.shape
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of values <= 1
    torch.testing.assert_close(attn.double(), mixed, atol=tol, rtol=0)
    torch.testing.assert_close(plain.double(), soft, atol=tol, rtol=0)
    # the row statistics the backward recomputes the softmax from
    torch.testing.assert_close(row_max.double(), scores.double().amax(-1).flatten(), atol=0, rtol=0)
    sums = torch.exp(scores.double() - scores.double().amax(-1, keepdim=True)).sum(-1).flatten()
    torch.testing.assert_close(row_inv.double(), 1 / sums, atol=0, rtol=1e-5)
    # in place (inference): the same maps written over the scores
    inplace = scores.clone()
    ops.maps_forward(inplace, gate, pos, heads, heads_first, False, True)
    assert torch.equal(inplace, attn)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("tokens", TOKENS)
def test_backward_matches_the_softmax_gradient_and_the_gate_sums(ops, dtype, heads_first, tokens):
    batch, heads, scale = 3, 4, 0.2
    scores, gate, pos, d_attn = _maps(batch, heads, tokens, dtype, heads_first, seed=1)
    head = _per_row_head(batch, heads, tokens, heads_first)
    _, row_max, row_inv = ops.maps_forward(scores, gate, pos, heads, heads_first, True, False)
    coef = (1 - gate) * scale
    d_scores, d_attn_sum, dots = ops.maps_backward(d_attn, scores, row_max, row_inv, coef, heads, heads_first, True)
    soft, da = torch.softmax(scores.double(), -1), d_attn.double()
    row_dot = (da * soft).sum(-1, keepdim=True)
    expected = coef.double()[head].view(-1, 1, 1) * soft * (da - row_dot)
    tol = 1e-6 if dtype == torch.float32 else 8e-3 * expected.abs().max().item()
    assert d_scores.dtype == dtype
    torch.testing.assert_close(d_scores.double(), expected, atol=tol, rtol=0)
    per_map = da.view(-1, tokens, tokens)
    expected_sum = torch.zeros(heads, tokens, tokens, dtype=torch.float64).index_add_(0, head, per_map)
    torch.testing.assert_close(d_attn_sum.double(), expected_sum, atol=1e-4, rtol=1e-5)
    expected_dots = torch.zeros(heads, dtype=torch.float64).index_add_(0, head, (da * soft).sum((1, 2)))
    torch.testing.assert_close(dots.double(), expected_dots, atol=1e-4, rtol=1e-5)
    # without the sums: the same dS, nothing else computed
    alone, empty_sum, empty_dots = ops.maps_backward(d_attn, scores, row_max, row_inv, coef, heads, heads_first, False)
    assert torch.equal(alone, d_scores) and empty_sum.numel() == empty_dots.numel() == 0


@needs_kernel
def test_nan_scores_stay_nan(ops):
    scores, gate, pos, _ = _maps(2, 4, 49, torch.float32, False)
    scores[3, 7, 11] = float("nan")
    attn, _, _ = ops.maps_forward(scores, gate, pos, 4, False, True, False)
    assert attn[3, 7].isnan().any()
    attn[3, 7] = 0
    assert attn.isfinite().all()


@needs_kernel
def test_bad_shapes_are_refused_with_a_message(ops):
    scores, gate, pos, _ = _maps(2, 4, 9, torch.float32, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.maps_forward(scores.transpose(1, 2), gate, pos, 4, False, True, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.maps_forward(scores.double(), gate, pos, 4, False, True, False)
    with pytest.raises(RuntimeError, match="pos"):
        ops.maps_forward(scores, gate, pos[:, :8], 4, False, True, False)
    with pytest.raises(RuntimeError, match="divisible"):
        ops.maps_forward(scores, gate[:3], pos[:3], 3, False, True, False)


@pytest.fixture(params=[True, False], ids=["fused_kernel", "separate_ops"])
def map_kernel(request, monkeypatch):
    if request.param and not CAN_BUILD:
        pytest.skip("the fused map kernel needs Linux and an AVX-512 CPU")
    monkeypatch.setattr(_attention_maps, "USE_FUSED_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_core_outputs_and_gradients_match_float64_on_either_path(map_kernel, gemm_dtype, gated, monkeypatch):
    """gated_attention / attention against the formulas in float64, with the kernel and without."""
    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: True)  # bf16 GEMMs, any CPU
    B, H, N, d = 3, 4, 49, 8
    gen = torch.Generator().manual_seed(0)
    qkv64 = torch.randn(3, B, H, N, d, generator=gen, dtype=torch.float64)
    gate64 = torch.rand(H, generator=gen, dtype=torch.float64)
    pos64 = torch.softmax(torch.randn(H, N, N, generator=gen, dtype=torch.float64), -1)
    w = torch.randn(B, H, N, d, generator=gen, dtype=torch.float64)
    scale = d ** -0.5

    def reference(qkv, gate, pos):
        q, k, v = qkv.unbind(0)
        soft = torch.softmax(q @ k.transpose(-1, -2) * scale, -1)
        attn = (1 - gate.view(H, 1, 1)) * soft + gate.view(H, 1, 1) * pos if gated else soft
        return attn @ v

    inputs64 = [qkv64.requires_grad_(), gate64.requires_grad_(), pos64.requires_grad_()]
    (reference(*inputs64) * w).sum().backward()
    expected = [reference(*inputs64).detach()] + [t.grad for t in inputs64]

    qkv = qkv64.detach().to(gemm_dtype).requires_grad_()
    gate = gate64.detach().float().requires_grad_()
    pos = pos64.detach().float().requires_grad_()
    out = _attention_core.gated_attention(qkv, gate, pos, scale) if gated else _attention_core.attention(qkv, scale)
    (out.double() * w).sum().backward()
    got = [out.detach().double(), qkv.grad.double()] + ([gate.grad.double(), pos.grad.double()] if gated else [])
    tol = 2e-5 if gemm_dtype == torch.float32 else 3e-2
    for name, a, b in zip(["out", "d_qkv", "d_gate", "d_pos"], got, expected):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < tol, f"{name}: relative error {err:.1e} (kernel {map_kernel}, {gemm_dtype})"


@needs_kernel
@pytest.mark.parametrize("gated", [True, False])
def test_inference_core_on_the_kernel_matches_separate_ops(ops, gated, monkeypatch):
    H, B, N, d = 4, 5, 50, 8
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, H, B, N, d, generator=gen).bfloat16()  # heads first, in the GEMM dtype
    gate = torch.rand(H, generator=gen) if gated else None
    pos = torch.softmax(torch.randn(H, N, N, generator=gen), -1) if gated else None
    fused = _attention_core.attention_inference(qkv, 0.3, gate, pos)
    monkeypatch.setattr(_attention_maps, "USE_FUSED_KERNEL", False)
    separate = _attention_core.attention_inference(qkv, 0.3, gate, pos)
    # the same maps up to where one bf16 rounding lands (the separate path rounds the scores' softmax
    # in torch's kernel), then the same GEMM
    torch.testing.assert_close(fused.float(), separate.float(), atol=2e-2, rtol=0)


class _CustomOps(TorchDispatchMode):
    """Records the locality_search ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "locality_search":
            self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@needs_kernel
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("train", [True, False])
def test_convit_runs_the_kernel_exactly_where_its_maps_are_bf16(ops, precision, train, monkeypatch):
    """GPSA and plain attention blocks under bf16 autocast with bf16 GEMMs: the kernel, forward and
    backward; in float32: separate ops (the kernel measured even there)."""
    monkeypatch.setattr(_attention_core, "cpu_has_native_bf16", lambda: True)
    torch.manual_seed(0)
    model = timm.create_model("ls_convit_nano").train(train)
    x = torch.randn(4, 1, 28, 28)
    with _CustomOps() as recorder, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with torch.set_grad_enabled(train):
            loss = model(x).float().sum()
        if train:
            loss.backward()
    if precision == "fp32":
        assert recorder.seen == set()
    else:
        assert recorder.seen == ({"maps_forward", "maps_backward"} if train else {"maps_forward"})


def _python(code: str, env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          cwd=cwd, capture_output=True, text=True, timeout=600)


PROBE = """
    import warnings
    warnings.simplefilter("error")  # the fallback's warning would fail the probe
    from trainers.models import _attention_maps
    print("kernel" if _attention_maps.kernels() is not None else "fallback", _attention_maps.build_error())
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
        from trainers.models import _attention_core, _attention_maps
        _attention_core.cpu_has_native_bf16 = lambda: True  # bf16 GEMMs: where the kernel would run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qkv = torch.randn(3, 2, 4, 9, 8).bfloat16().requires_grad_()
            out = _attention_core.gated_attention(qkv, torch.rand(4), torch.rand(4, 9, 9), 0.3)
            out.sum().backward()
            _attention_core.attention(qkv, 0.3).sum().backward()
        messages = [str(w.message) for w in caught if "fused attention-map kernel" in str(w.message)]
        print(len(messages), messages[0] if messages else "")
    """
    done = _python(code, {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    count, message = done.stdout.split(" ", 1)
    if CAN_BUILD:
        assert count == "1" and "no C++ compiler (install g++" in message, done.stdout
    else:
        assert count == "1", done.stdout


@needs_kernel
def test_concurrent_first_uses_build_once_and_both_load(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(PROBE)], env={**os.environ, **env}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.split()[0] == "kernel", err
    built = list((tmp_path / "locality-search" / "kernels").glob("*.so"))
    assert len(built) == 1
    leftovers = [p.name for p in built[0].parent.iterdir() if p.suffix not in (".so", ".lock")]
    assert leftovers == []  # no half-written library or scratch folder left behind
