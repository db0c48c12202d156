"""GPSA's fused float32 layer (`trainers/kernels/_gpsa_layer.py`, `csrc/gpsa_layer_fp32.h`): its output
and every gradient against timm's GPSA in float64 with the same weights, on this CPU's build and on
the 8-lane AVX2 one, at shapes whose chunks and per-thread parts end unevenly, in training and in
inference; the same bits run after run and whether the backward kept the softmax maps or
recomputed them; and where it must not run (autocast, a q/k/v bias, hooks on the projections,
output dropout while training, a width the kernel's vectors do not divide or whose weights would
not stay in cache), the layer apart."""
from __future__ import annotations

import pytest
import torch
from timm.models.convit import GPSA as TimmGPSA
from torch.utils._python_dispatch import TorchDispatchMode

from trainers import kernels
from trainers.kernels import _library
from trainers.models.ls_convit import GPSA

from tests._layers import float32_avx2_kernel_or_skip, float32_kernel_or_skip


class _LayerOps(TorchDispatchMode):
    """Records the float32 kernels' ops dispatched inside it ("namespace.op" -> calls), and the size
    of the maps each fused backward got (0: recomputed)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.backward_maps: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace.startswith("locality_search"):
            name = f"{func.namespace}.{func.overloadpacket.__name__}"
            self.calls[name] = self.calls.get(name, 0) + 1
            if func.overloadpacket.__name__ == "gpsa_layer_backward":
                # (dy, x, qkv, out, w_qkv, w_proj, gate, pos, row_max, row_inv, maps, ...)
                self.backward_maps.append(args[10].numel())
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["native", "fp32-avx2"])
def float32_ops(request, monkeypatch):
    """The float32 kernel's ops GPSA runs on: this CPU's build, or on an AVX-512 CPU also its 8-lane
    AVX2 build (what the AVX2-only machines run) in its place."""
    if request.param == "native":
        return float32_kernel_or_skip()
    float32_kernel_or_skip()
    ops = float32_avx2_kernel_or_skip()
    real = _library.cpu_library
    monkeypatch.setattr(_library, "cpu_library",
                        lambda dtype=torch.bfloat16: ops if dtype == torch.float32 else real(dtype))
    return ops


def _pair(dim: int, heads: int, qkv_bias: bool = False, seed: int = 0) -> tuple[TimmGPSA, GPSA]:
    """timm's GPSA in float64 (locality init, then perturbed so that content and position both count)
    and ours in float32 with the same weights."""
    torch.manual_seed(seed)
    ref = TimmGPSA(dim, num_heads=heads, qkv_bias=qkv_bias, locality_strength=1.0)
    ref.local_init()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = GPSA(dim, num_heads=heads, qkv_bias=qkv_bias)
    ours.load_state_dict(ref.state_dict())
    return ref.double(), ours


def _run(layer: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor, train: bool) -> list[torch.Tensor]:
    """[layer(x)] and, when training, the gradients of <layer(x), upstream> for x and each parameter
    (float64 copies)."""
    layer.zero_grad(set_to_none=True)
    inputs = x.to(next(layer.parameters()).dtype, copy=True).requires_grad_(train)
    with torch.set_grad_enabled(train):
        out = layer(inputs)
        if train:
            (out * upstream.to(out.dtype)).sum().backward()
    results = [out.detach()]
    if train:
        results += [inputs.grad] + [p.grad for p in layer.parameters()]
    return [t.double() for t in results]


@pytest.mark.parametrize("train", [True, False], ids=["train", "inference"])
@pytest.mark.parametrize("batch, tokens, dim, heads", [
    (7, 49, 96, 4),   # chunks of 4 images and two parts, each ending short
    (3, 196, 192, 4),  # ConViT-Ti's GPSA layers: a chunk per image
    (5, 64, 48, 3),   # 64 tokens: no padding lanes
    (1, 9, 16, 1),    # one image, one head, one vector wide
])
def test_the_fused_layer_matches_timm_in_float64(float32_ops, batch, tokens, dim, heads, train):
    ref, ours = _pair(dim, heads)
    ours.train(train)
    ref.train(train)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, dim, generator=gen, dtype=torch.float64)
    upstream = torch.randn(batch, tokens, dim, generator=gen, dtype=torch.float64)
    expected = _run(ref, x, upstream, train)
    with _LayerOps() as recorder:
        got = _run(ours, x, upstream, train)
    namespace = float32_ops.name
    assert recorder.calls == ({f"{namespace}.gpsa_layer_forward": 1, f"{namespace}.gpsa_layer_backward": 1}
                              if train else {f"{namespace}.gpsa_layer_forward": 1})
    names = ["out"] + (["x"] + [name for name, _ in ours.named_parameters()] if train else [])
    largest = max(b.abs().max().item() for b in expected[1:]) if train else 0.
    for name, a, b in zip(names, got, expected, strict=True):
        # relative to the largest value; pos_proj's bias, whose exact gradient is 0 (a softmax over
        # keys ignores a bias per head), against the largest gradient
        scale = largest if name == "pos_proj.bias" else b.abs().max().item()
        assert (a - b).abs().max().item() < (2e-6 if name == "out" else 2e-5) * scale, name
    if train:
        assert expected[names.index("gating_param")].abs().max() > 1e-4  # the gates are really exercised


def test_kept_and_recomputed_maps_and_reruns_give_the_same_bits(monkeypatch):
    """The backward from the softmax maps its forward kept, and from maps recomputed (over
    KEPT_MAPS_BYTES): the same output and gradients bit for bit; and run after run (the parts' sums
    do not depend on scheduling)."""
    float32_kernel_or_skip()
    _, ours = _pair(96, 4)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 49, 96, generator=gen)
    upstream = torch.randn(6, 49, 96, generator=gen)

    def run():
        with _LayerOps() as recorder:
            results = _run(ours, x, upstream, train=True)
        return recorder.backward_maps, results

    kept_sizes, kept = run()
    _, again = run()
    with kernels.backends(kept_maps=False):
        recomputed_sizes, recomputed = run()
    assert len(kept_sizes) == 1 and kept_sizes[0] >= 6 * 4 * 49 * 49 and recomputed_sizes == [0]
    for a, b, c in zip(kept, again, recomputed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def _hooked(layer: GPSA) -> list[str]:
    seen: list[str] = []
    layer.proj.register_forward_hook(lambda *_: seen.append("proj"))
    return seen


@pytest.mark.parametrize("case", ["fused", "switched off", "autocast", "qkv bias", "hook on proj",
                                  "output dropout", "width 40", "width 256", "eval with output dropout"])
def test_the_layer_runs_apart_where_the_fused_op_cannot(case, kernel_backends):
    float32_kernel_or_skip()
    width = {"width 40": 40, "width 256": 256}.get(case, 96)  # not a multiple of 16; weights over the limit
    _, ours = _pair(width, 4, qkv_bias=case == "qkv bias")
    seen = _hooked(ours) if case == "hook on proj" else None
    if case == "switched off":
        kernel_backends(fused_gpsa_layer=False)
    if case in ("output dropout", "eval with output dropout"):
        ours.proj_drop.p = 0.1
    ours.train(case != "eval with output dropout")
    x = torch.randn(2, 49, ours.proj.in_features, requires_grad=True)
    with _LayerOps() as recorder, torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        ours(x).float().sum().backward()
    fused = any(".gpsa_layer_" in op for op in recorder.calls)
    assert fused == (case in ("fused", "eval with output dropout")), recorder.calls
    if seen is not None:
        assert seen == ["proj"]  # the hook saw the call the fused op would have bypassed


def test_the_ops_name_what_they_need():
    ops = float32_kernel_or_skip()
    # C 36: a multiple of the 4 heads, not of the 8 or 16 lanes of either build
    x, w_qkv, w_proj = torch.randn(2, 9, 36), torch.randn(108, 36), torch.randn(36, 36)
    gate, pos, bias = torch.rand(4), torch.softmax(torch.randn(4, 9, 9), -1), torch.zeros(36)
    with pytest.raises(RuntimeError, match="a multiple of the heads and of"):
        ops.gpsa_layer_forward(x, w_qkv, gate, pos, 0.3, w_proj, bias, False, False)
    x, w_qkv, w_proj, bias = torch.randn(2, 9, 32), torch.randn(96, 32), torch.randn(32, 32), torch.zeros(32)
    with pytest.raises(RuntimeError, match="x contiguous float32"):
        ops.gpsa_layer_forward(x.transpose(0, 1), w_qkv, gate, pos, 0.3, w_proj, bias, False, False)
    with pytest.raises(RuntimeError, match="w_qkv: float32, contiguous, of size"):
        ops.gpsa_layer_forward(x, w_qkv[:64], gate, pos, 0.3, w_proj, bias, False, False)
