"""`gated_attention`: GPSA's layer, proj(((1 - s) softmax(Q K^T * scale) + s P) @ V), on the quickest
backend here; the values are those of the paper's formula up to rounding. The backends:

  - CPU, float32, the float32 library built, no autocast, C <= 192: the whole layer, projections and
    core, one op per direction over a few images at a time (`_gpsa_layer`);
  - CPU inference on torch ops (float32/64, no autocast, no library): q, k and v out of one batched
    matmul already heads first, the core in place (`_attention_core.attention_inference`);
  - CPU otherwise (bf16/fp16 under autocast, training): the explicit core with its hand-written
    backward, on a library where one is built (`_attention_core.gated_attention`);
  - CUDA fp16/bf16 inference with a head width of one or two powers of two >= 16: one Triton kernel
    for both terms and the mix (`_gpsa_triton`; the `triton` backend);
  - elsewhere (CUDA, torch.compile): fused SDPA for the content term plus P @ V, one GEMM per head.
What is derived from parameters alone (the q/k/v weight concatenated, the per-head weights, s P
and 1 - s) is kept for inference in the layer's `KeptValues` (see `_kept`).
benchmarks/gpsa_layer.py and benchmarks/gpsa_cuda_core.py time the backends side by side.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from trainers.kernels import _gpsa_layer, _gpsa_triton, _library
from trainers.kernels._attention_core import (CPU_CORE_DTYPES, FULL_PRECISION, attention_inference, compiled_away,
                                              gated_attention as _gated_core)
from trainers.kernels._kept import KeptValues
from trainers.kernels._linear import linear
from trainers.kernels._switch import selected_backends

__all__ = ["gated_attention", "mixing_terms", "qkv_weight", "takes_cpu_core"]


def takes_cpu_core(x: torch.Tensor) -> bool:
    """The CPU backends (the explicit core and its fused forms): on the CPU in float32/64 and in
    bfloat16/float16, outside torch.compile (which traces the SDPA path, fused around by inductor)."""
    return x.device.type == 'cpu' and x.dtype in CPU_CORE_DTYPES and not compiled_away()


def qkv_weight(qk: nn.Linear, v: nn.Linear, kept: KeptValues) -> torch.Tensor:
    """q, k and v's weight (3C, C): rows [q | k | v] as timm's qk then v."""
    weights = (qk.weight, v.weight)
    return kept.keep('qkv_weight', weights, (), lambda: torch.cat(weights))


def _qkv(x: torch.Tensor, qk: nn.Linear, v: nn.Linear, kept: KeptValues) -> torch.Tensor:
    """q, k and v in one matmul: (B, N, 3 * C), columns [q | k | v]."""
    bias = None
    if qk.bias is not None:
        biases = (qk.bias, v.bias)
        bias = kept.keep('qkv_bias', biases, (), lambda: torch.cat(biases))
    return linear(x, qkv_weight(qk, v, kept), bias)


def _qkv_heads_first(x: torch.Tensor, qk: nn.Linear, v: nn.Linear, num_heads: int, kept: KeptValues) -> torch.Tensor:
    """`_qkv` for inference, laid out (3, H, B, N, d) contiguous: one batched matmul of the tokens with
    each head's q, k and v weights (3H x C x d, kept), which costs what the (B*N x C) @ (C x 3C)
    matmul does and saves the copy from (B, N, 3, H, d) to head-major."""
    B, N, C = x.shape
    H, d = num_heads, C // num_heads
    weights = (qk.weight, v.weight)
    per_head = kept.keep('qkv_heads', weights, (), lambda: torch.cat(weights).view(3 * H, d, C).transpose(1, 2).contiguous())
    tokens = x.reshape(1, B * N, C).expand(3 * H, B * N, C)  # the same tokens for every head
    if qk.bias is None:
        qkv = torch.bmm(tokens, per_head)
    else:
        biases = (qk.bias, v.bias)
        bias = kept.keep('qkv_heads_bias', biases, (), lambda: torch.cat(biases).view(3 * H, 1, d))
        qkv = torch.baddbmm(bias, tokens, per_head)
    return qkv.view(3, H, B, N, d)


def mixing_terms(gating_param: torch.Tensor, pos: torch.Tensor, pos_params: Sequence[torch.Tensor], grid: tuple,
                 dtype: torch.dtype, kept: KeptValues) -> Tuple[torch.Tensor, torch.Tensor]:
    """(s * P (H, N, N), 1 - s (H, 1)) in `dtype` (the values' dtype: bf16 under autocast, so the mix
    stays in it), s = sigmoid(gate); kept for inference, one pair per dtype (a model evaluated in
    bf16 and timed in fp32 in turn would otherwise recompute them at every switch)."""
    def compute() -> Tuple[torch.Tensor, torch.Tensor]:
        gate = torch.sigmoid(gating_param)  # (H,)
        pos_attn = gate.view(-1, 1, 1) * pos
        return pos_attn.to(dtype), (1. - gate).view(-1, 1).to(dtype)

    return kept.keep(f'mixing_{dtype}', (*pos_params, gating_param), grid, compute)


def gated_attention(x: torch.Tensor, *, qk: nn.Linear, v: nn.Linear, proj: nn.Linear, proj_drop: nn.Module,
                    gating_param: torch.Tensor, pos: torch.Tensor, pos_params: Sequence[torch.Tensor], grid: tuple,
                    num_heads: int, scale: float, kept: KeptValues) -> torch.Tensor:
    """GPSA's layer on x (B, N, C): proj_drop(proj(((1 - s) softmax(Q K^T * scale) + s P) @ V)), with
    q, k = qk(x) split and v = v(x), s = sigmoid(gating_param) (H,), P = `pos` (H, N, N), computed
    from `pos_params` (the key of what is kept from it) on a `grid`. No attention dropout: the
    caller runs the formula itself where that is active. Differentiable in every input."""
    B, N, C = x.shape
    H, d = num_heads, C // num_heads
    if takes_cpu_core(x):
        gate = torch.sigmoid(gating_param)  # (H,)
        if _gpsa_layer.usable(x, qk=qk, v=v, proj=proj, proj_drop=proj_drop):  # the projections and the core as one op
            return _gpsa_layer.gpsa_layer(x, qkv_weight(qk, v, kept), gate, pos, proj.weight, proj.bias, scale)
        if (not torch.is_grad_enabled() and x.dtype in FULL_PRECISION and not torch.is_autocast_enabled('cpu')
                and not _library.cpu_library_available(x.dtype, N)):
            # inference on torch ops: q, k, v come out of their matmul already laid out for them (the
            # library's core reads the projection's layout as it is)
            out = attention_inference(_qkv_heads_first(x, qk, v, H, kept), scale, gate, pos.to(x.dtype))
            out = out.permute(1, 2, 0, 3)  # (H, B, N, d) -> (B, N, H, d)
        else:
            qkv = _qkv(x, qk, v, kept).view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d) view
            out = _gated_core(qkv, gate, pos, scale).transpose(1, 2)  # (B, N, H, d)
        return proj_drop(proj(out.reshape(B, N, C)))

    qkv = _qkv(x, qk, v, kept).view(B, N, 3, H, d)
    if (selected_backends().triton and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and _gpsa_triton.available(qkv, d)):
        # inference: both terms and the mix in one Triton kernel, written (B, N, H, d)
        pos_attn, content_weight = mixing_terms(gating_param, pos, pos_params, grid, qkv.dtype, kept)
        out = _gpsa_triton.gated_attention_inference(qkv, pos_attn, content_weight, scale)
        return proj_drop(proj(out.view(B, N, C)))
    q, k, v_ = qkv.unbind(2)  # (B, N, H, d) each
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, N, d)
    # content term, fused: (B, H, N, d), scaled by (1 - s) afterwards
    content = F.scaled_dot_product_attention(q, k, v_.transpose(1, 2))
    pos_attn, content_weight = mixing_terms(gating_param, pos, pos_params, grid, v_.dtype, kept)  # s P, 1 - s
    # positional term: one GEMM per head for the whole batch, (H, N, N) @ (H, N, B*d)
    pos_out = torch.bmm(pos_attn, v_.permute(2, 1, 0, 3).reshape(H, N, B * d))  # (H, N, B*d)
    pos_out = pos_out.view(H, N, B, d).permute(2, 1, 0, 3)  # (B, N, H, d)
    if torch.is_grad_enabled() or torch.compiler.is_compiling():  # (an out= op has no backward; under
        # torch.compile, functionalised, out= would keep pos_out's head-major layout)
        out = torch.addcmul(pos_out, content.transpose(1, 2), content_weight)  # (B, N, H, d), v's dtype
    else:  # written (B, N, H, d)-contiguous, so the reshape below is a view, not a copy
        out = torch.addcmul(pos_out, content.transpose(1, 2), content_weight,
                            out=torch.empty((B, N, H, d), dtype=pos_out.dtype, device=x.device))
    return proj_drop(proj(out.reshape(B, N, C)))
