"""GPSA's whole layer in float32 on the CPU, one kernel op per direction (`csrc/gpsa_layer_fp32.h`, in
the float32 kernel's library): the q, k, v projection, the attention core and the output projection
over a few images at a time, so that each chunk's intermediates are still in cache when the next
product reads them. Apart, each product streams the whole batch's q, k, v (14.5 MB at B 256, N 49,
C 96) or its gradient through memory before the next one starts.

Same values as the layer's ops apart (the projections, `_attention_core.gated_attention`), up to
the order of float32 sums: the kernel's broadcast-FMA tiles run the projections instead of MKL or
oneDNN, and the weight gradients are summed over parts of the batch, one per thread, so the
result does not depend on scheduling (it does on the thread count). benchmarks/gpsa_layer.py times
it against the layer apart (`ratio_fused_layer_gain`). Wider layers lose: each chunk passes over
the whole weights (see `_MAX_QKV_WEIGHT_BYTES`), so they run apart.

`kernels.gated_attention` takes it where `usable` says so.
"""
from __future__ import annotations

import torch
from torch import nn

from trainers.kernels import _library
from trainers.kernels._attention_core import gate_and_pos_grads
from trainers.kernels._hooks import has_hooks
from trainers.kernels._switch import selected_backends

__all__ = ["gpsa_layer", "usable"]

_WIDTH_MULTIPLE = 16  # the kernel's products run whole vectors along C (16 lanes with AVX-512, 8 with AVX2)
# Every chunk's products pass over the whole q/k/v and output weights, and the backward adds into
# their gradients: they must stay in cache. Side by side (benchmarks/gpsa_layer.py, fp32) the fused
# layer gains up to C 192 and loses from C 288 on: so up to C 192, a q/k/v weight of 432 KiB.
_MAX_QKV_WEIGHT_BYTES = 3 * 192 * 192 * 4


def usable(x: torch.Tensor, *, qk: nn.Linear, v: nn.Linear, proj: nn.Linear, proj_drop: nn.Module) -> bool:
    """Whether GPSA's forward on x (B, N, C) with these projections can run as the fused layer: the
    `fused_gpsa_layer` backend on, float32 (x and the weights) on the CPU outside autocast and
    torch.compile (`_library.cpu_library_available`: the float32 kernel built), C a multiple of 16
    and at most 192 (the weights in cache), no q/k/v bias (timm's default), an output bias, no
    active output dropout, and no forward hooks on the projections (the fused op would bypass them)."""
    return (selected_backends().fused_gpsa_layer
            and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3
            and all(p.dtype == torch.float32 for p in (qk.weight, v.weight, proj.weight))
            and x.shape[-1] % _WIDTH_MULTIPLE == 0 and 3 * x.shape[-1] ** 2 * 4 <= _MAX_QKV_WEIGHT_BYTES
            and not torch.is_autocast_enabled("cpu")
            and qk.bias is None and v.bias is None and proj.bias is not None
            and not (proj_drop.training and proj_drop.p > 0)
            and not any(has_hooks(m) for m in (qk, v, proj, proj_drop))
            and _library.cpu_library_available(torch.float32, x.shape[1]))


class _Layer(torch.autograd.Function):
    """The fused layer with its backward: gradients for x, the q/k/v weight (3C, C), the gate s (H,),
    P (H, N, N) and the output projection's weight and bias."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_qkv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor,
                w_proj: torch.Tensor, b_proj: torch.Tensor, scale: float) -> torch.Tensor:
        B, N, _ = x.shape
        keep_maps = _library.kept_maps_fit(B, gate.numel(), N)
        y, qkv, out, row_max, row_inv, maps = _library.cpu_library(torch.float32).gpsa_layer_forward(
            x, w_qkv, gate, pos, scale, w_proj, b_proj, True, keep_maps)
        ctx.save_for_backward(x, w_qkv, gate, pos, w_proj, qkv, out, row_max, row_inv, maps)
        ctx.scale = scale
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # the ops have no derivatives of their own
    def backward(ctx, dy: torch.Tensor):
        x, w_qkv, gate, pos, w_proj, qkv, out, row_max, row_inv, maps = ctx.saved_tensors
        coef = ctx.scale * (1. - gate)  # dS's factor per head
        dx, d_w_qkv, d_w_proj, d_b_proj, d_attn_sum, soft_dot = _library.cpu_library(
            torch.float32).gpsa_layer_backward(dy.contiguous(), x, qkv, out, w_qkv, w_proj, gate, pos, row_max,
                                               row_inv, maps, coef, ctx.scale)
        d_gate, d_pos = gate_and_pos_grads(d_attn_sum, soft_dot, gate, pos)
        return dx, d_w_qkv, d_gate, d_pos, d_w_proj, d_b_proj, None


def gpsa_layer(x: torch.Tensor, w_qkv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, w_proj: torch.Tensor,
               b_proj: torch.Tensor, scale: float) -> torch.Tensor:
    """proj(((1 - s) softmax(Q K^T * scale) + s P) @ V) with q, k, v = x W_qkv^T split in thirds and
    heads: GPSA's forward where `usable` says so, differentiable in every input.

    x: (B, N, C) float32; w_qkv: (3C, C), rows [q | k | v]; gate: s (H,); pos: P (H, N, N); w_proj
    (C, C) and b_proj (C,). Returns (B, N, C)."""
    x, w_qkv, gate, pos = x.contiguous(), w_qkv.contiguous(), gate.contiguous(), pos.contiguous()
    w_proj, b_proj = w_proj.contiguous(), b_proj.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_qkv, gate, pos, w_proj, b_proj)):
        return _Layer.apply(x, w_qkv, gate, pos, w_proj, b_proj, scale)
    return _library.cpu_library(torch.float32).gpsa_layer_forward(x, w_qkv, gate, pos, scale, w_proj, b_proj,
                                                                  False, False)[0]
