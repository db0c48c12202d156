"""GPSA's fused CUDA inference kernel (`trainers.models._gpsa_triton`) against the explicit formula.

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the
CPU) in a subprocess, so its indexing, masking and the split of a head width into two pieces are
checked in CI; on CUDA the compiled kernel is checked, and a model with it against one without."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainers.kernels import _gpsa_triton

_triton_missing = _gpsa_triton._triton() is None

# (B, N, H, d): ConViT-Ti's 48 = 32 + 16 and 80 = 64 + 16 (two pieces), 64 and 16 (one); N not a
# multiple of any block, and N below one block
SHAPES = [(2, 49, 4, 48), (1, 70, 3, 80), (2, 20, 2, 64), (2, 5, 1, 16)]


def reference(qkv: torch.Tensor, pos: torch.Tensor, content_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """(1 - s) softmax(Q K^T scale) V + (s P) V in float64, (B, N, H, d); the inputs as the kernel gets them."""
    q, k, v = (t.transpose(1, 2).double() for t in qkv.unbind(2))  # (B, H, N, d)
    content = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    out = content_weight.double().view(1, -1, 1, 1) * content + pos.double() @ v
    return out.transpose(1, 2)


def _inputs(B, N, H, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3 * H * d, generator=gen).to(device=device, dtype=dtype).view(B, N, 3, H, d)
    gate = torch.rand(H, generator=gen)
    P = torch.softmax(3 * torch.randn(H, N, N, generator=gen), dim=-1)
    pos = (gate.view(-1, 1, 1) * P).to(device=device, dtype=dtype)
    return qkv, pos, (1 - gate).to(device=device, dtype=dtype)


def _run_in_interpreter(script: str) -> None:
    """Run `script` (which prints 'ok' when its checks pass) in a fresh Python under Triton's
    interpreter: TRITON_INTERPRET must be set before Triton compiles anything in the process."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    run = subprocess.run([sys.executable, '-c', script], env=dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=root),
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == 'ok', run.stderr[-3000:]


def test_head_pieces():
    assert _gpsa_triton.head_pieces(48) == (32, 16)
    assert _gpsa_triton.head_pieces(96) == (64, 32)
    assert _gpsa_triton.head_pieces(80) == (64, 16)
    assert _gpsa_triton.head_pieces(64) == (64, 0)
    assert _gpsa_triton.head_pieces(16) == (16, 0)
    for width in (8, 24, 40, 56, 65, 112):  # 24 = 16 + 8: 8 is too narrow for tl.dot
        assert _gpsa_triton.head_pieces(width) is None


def test_available_only_for_cuda_half_precision_and_exact_widths():
    assert not _gpsa_triton.available(torch.zeros(1, dtype=torch.bfloat16), 48)  # CPU
    if torch.cuda.is_available() and not _triton_missing:
        assert _gpsa_triton.available(torch.zeros(1, dtype=torch.bfloat16, device='cuda'), 48)
        assert not _gpsa_triton.available(torch.zeros(1, dtype=torch.bfloat16, device='cuda'), 40)
        assert not _gpsa_triton.available(torch.zeros(1, device='cuda'), 48)  # fp32 keeps the exact path


def test_rejects_a_qkv_whose_tokens_are_not_contiguous():
    qkv = torch.zeros(2, 5, 4, 3, 16).transpose(2, 3)  # (B, N, 3, H, d) view with H and 3 swapped
    with pytest.raises(ValueError, match='each token contiguous'):
        _gpsa_triton.gated_attention_inference(qkv, torch.zeros(4, 5, 5), torch.zeros(4), 0.25)
    with pytest.raises(ValueError, match='head width 40'):
        _gpsa_triton.gated_attention_inference(torch.zeros(2, 5, 3, 4, 40), torch.zeros(4, 5, 5), torch.zeros(4), 0.25)


@pytest.mark.skipif(_triton_missing, reason="Triton is not installed (a CPU-only torch build)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernel's tests instead")
def test_kernel_matches_reference_in_triton_interpreter():
    script = textwrap.dedent(f"""
        import torch
        from trainers.kernels import _gpsa_triton
        from tests.trainers.kernels.test_gpsa_triton import _inputs, reference
        for B, N, H, d in {SHAPES!r}:
            for dtype, tol in ((torch.float16, 2e-3),):  # the interpreter's numpy has no bfloat16
                qkv, pos, cw = _inputs(B, N, H, d, dtype, 'cpu')
                out = _gpsa_triton.gated_attention_inference(qkv, pos, cw, d ** -0.5)
                assert out.shape == (B, N, H, d) and out.dtype == dtype and out.is_contiguous()
                err = (out.double() - reference(qkv, pos, cw, d ** -0.5)).abs().max().item()
                assert err < tol, (B, N, H, d, dtype, err)
        print('ok')
    """)
    _run_in_interpreter(script)


@pytest.mark.skipif(_triton_missing, reason="Triton is not installed (a CPU-only torch build)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernel's tests instead")
def test_benchmark_ways_agree_in_triton_interpreter():
    """benchmarks/gpsa_cuda_core's two contenders (the kernel, and GPSA's SDPA + P @ V path it
    replaces) compute the same thing: what the benchmark times is a like-for-like pair."""
    script = textwrap.dedent("""
        import torch
        from benchmarks.gpsa_cuda_core import _inputs, _ways
        qkv, pos, cw = _inputs(2, 49, 4, 48, torch.float16, device='cpu')
        ways = _ways(qkv, pos, cw, 48 ** -0.5)
        kernel, sdpa = ways['fused kernel']().double(), ways['SDPA + P @ V']().double()
        assert kernel.shape == sdpa.shape == (2, 49, 4, 48)
        assert (kernel - sdpa).abs().max().item() < 2e-3, (kernel - sdpa).abs().max().item()
        print('ok')
    """)
    _run_in_interpreter(script)


def test_benchmark_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    from benchmarks import gpsa_cuda_core
    with pytest.raises(SystemExit) as exit_info:
        gpsa_cuda_core.main([])
    assert exit_info.value.code == 2 and 'needs a CUDA GPU' in capsys.readouterr().err


@pytest.mark.triton
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('shape', SHAPES + [(64, 196, 4, 48)])
def test_cuda_kernel_matches_reference(shape, dtype):
    B, N, H, d = shape
    qkv, pos, cw = _inputs(B, N, H, d, dtype, 'cuda')
    out = _gpsa_triton.gated_attention_inference(qkv, pos, cw, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    assert (out.double() - reference(qkv, pos, cw, d ** -0.5)).abs().max().item() < tol


@pytest.mark.triton
def test_cuda_model_with_and_without_the_kernel(monkeypatch, kernel_backends):
    """ls_convit_tiny in bf16 inference with the kernel against the same model on fused SDPA + P @ V,
    and the kernel's layer in use (the switch changes the path taken)."""
    import timm
    import trainers.models  # noqa: F401
    from trainers.models import ls_convit
    torch.manual_seed(0)
    model = timm.create_model('ls_convit_tiny', img_size=64, patch_size=8).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    x = torch.randn(4, 3, 64, 64, device='cuda')
    calls = []
    kernel = _gpsa_triton.gated_attention_inference
    monkeypatch.setattr(_gpsa_triton, 'gated_attention_inference', lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode(), torch.autocast('cuda', torch.bfloat16):
        fused = model(x).float()
        assert len(calls) == model.local_up_to_layer
        kernel_backends(triton=False)
        unfused = model(x).float()
        assert len(calls) == model.local_up_to_layer
    with torch.inference_mode():
        exact = model(x)
    assert (fused - exact).abs().max() < 0.05 and (unfused - exact).abs().max() < 0.05
    model.train()  # training keeps the autograd path
    with torch.autocast('cuda', torch.bfloat16):
        model(x).float().sum().backward()
    assert len(calls) == model.local_up_to_layer


@pytest.mark.triton
def test_cuda_launch_settings_tuned_per_batch_size():
    """Timed at the first call per batch size rounded up to a power of two (a model's first call,
    at batch 2, no longer decides batch 256's blocks), kept for later calls, which give the same
    numbers."""
    N, H, d = 196, 4, 48
    for B in (2, 256, 200):
        qkv, pos, cw = _inputs(B, N, H, d, torch.bfloat16, 'cuda')
        out = _gpsa_triton.gated_attention_inference(qkv, pos, cw, d ** -0.5)
        assert (out.double() - reference(qkv, pos, cw, d ** -0.5)).abs().max().item() < 2e-2
        assert torch.equal(_gpsa_triton.gated_attention_inference(qkv, pos, cw, d ** -0.5), out)
    keys = {key[:2] for key in _gpsa_triton._TUNED if key[1:4] == (N, H, d)}
    assert {(2, N), (256, N)} <= keys and all(config in _gpsa_triton.CONFIGS for config in _gpsa_triton._TUNED.values())


def test_untuned_launch_takes_the_first_settings(monkeypatch):
    """The interpreter (CPU) and `TUNE` off launch CONFIGS[0], untimed."""
    qkv = torch.zeros(1, 196, 3, 2, 16)
    assert _gpsa_triton._config((qkv,), dict(H=2, D=16), 1, 196) is _gpsa_triton.CONFIGS[0]
    monkeypatch.setattr(_gpsa_triton, 'TUNE', False)
    if torch.cuda.is_available():
        assert _gpsa_triton._config((qkv.cuda(),), dict(H=2, D=16), 1, 196) is _gpsa_triton.CONFIGS[0]
    assert not any(key[1] == 196 and key[2:4] == (2, 16) for key in _gpsa_triton._TUNED)
