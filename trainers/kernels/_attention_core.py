"""The explicit attention core for the CPU: softmax(Q K^T * scale) @ V from the B x H x N x N maps,
optionally mixed with a positional attention shared by the batch (GPSA: (1 - s) softmax + s P),
with a hand-written backward. On the fused kernels also with the scores multiplied by a mask
shared by the batch (GMM attention: softmax((Q K^T * scale) * M) @ V, `masked_attention`).

At the token counts of these models (N <= 197) the maps are small and the GEMMs batched, so on a
small CPU this beats torch's fused attention kernels where its GEMMs can run in bf16 (CPU autocast
on bf16 hardware) and in float32 on the float32 library; only in float32 on torch ops are the two
even, so plain attention keeps torch's fused kernel there (`plain_attention_on_explicit_core`;
benchmarks/attention_blocks.py times them side by side). GPSA runs this core on the CPU in every dtype: fused kernels have no
positional term.

Precision follows CPU autocast: for bfloat16/float16 qkv the softmax, the mixing with P and the
maps' gradients are float32; the batched GEMMs run in bfloat16 (accumulating in float32) on a CPU
that multiplies it natively (`cpu_has_native_bf16`), else in float32 (fp16, or emulated bf16, where
float32 GEMMs are the quicker ones). No map is rounded twice.

With bf16 GEMMs, and in float32, the whole core, forward and backward, runs as one fused kernel
per direction where it is built (`_library`: the maps formed per (batch, head) in cache,
recomputed in the backward rather than kept, except the float32 softmax maps where they are small,
q, k, v read in the projection's layout); elsewhere
(float64, fp16, emulated bf16), and where the kernel cannot be built, on the torch ops below.
"""
from typing import Optional, Tuple

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

import torch.nn.functional as F

from trainers._cpu import cpu_has_native_bf16
from trainers.kernels import _library
from trainers.kernels._switch import enabled, selected_backends

__all__ = [
    'CPU_CORE_DTYPES', 'FULL_PRECISION', 'attention_inference', 'compiled_away', 'explicit_core_attention',
    'gate_and_pos_grads', 'gated_attention', 'masked_attention', 'masked_attention_usable', 'plain_attention',
    'plain_attention_on_explicit_core',
]

FULL_PRECISION = (torch.float32, torch.float64)
CPU_CORE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _register_cpu_sdpa_flop_formulas() -> None:
    """Count torch's fused CPU attention as torch counts its CUDA kernels (it registers formulas
    for those only): a plain block's attention on it counted no FLOPs, while the same block on the
    explicit core counted its two products, so a trial's `flops` depended on the CPU (the path
    `plain_attention_on_explicit_core` picks) and on whether the CPU kernel was built."""
    forward = getattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu', None)
    backward = getattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu_backward', None)
    if forward is not None and forward not in flop_registry and forward.default not in flop_registry:
        @register_flop_formula(forward)
        def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)

    if backward is not None and backward not in flop_registry and backward.default not in flop_registry:
        @register_flop_formula(backward)
        def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_sdpa_flop_formulas()


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the core's batched GEMMs: float32/64 as given; bfloat16 as given on a CPU that
    multiplies it natively (as autocast's own matmuls do; there its batched GEMMs at GPSA's sizes
    are several times quicker than float32 ones); float32 otherwise (emulated bf16 or fp16, slower
    than float32)."""
    if dtype in FULL_PRECISION or (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return dtype
    return torch.float32


def plain_attention_on_explicit_core(qkv: torch.Tensor) -> bool:
    """Whether `plain_attention` on `qkv` ((3, B, H, N, d), the projection's output permuted) runs on
    this core, the quicker there, rather than on torch's fused kernel: on the CPU when its GEMMs run
    in bf16, or in float32 on the float32 library (see the module doc); never with the kernels or
    the `explicit_plain_attention` backend off, nor under torch.compile (see `compiled_away`)."""
    if (not (enabled() and selected_backends().explicit_plain_attention and qkv.device.type == 'cpu')
            or compiled_away()):
        return False
    if qkv.dtype == torch.bfloat16:
        return cpu_has_native_bf16()
    return qkv.dtype == torch.float32 and _library.usable(qkv)


def compiled_away() -> bool:
    """True while torch.compile traces: callers then take torch's own ops (fused SDPA), which
    inductor fuses around, instead of this core. The fused kernels are opaque to it, and the
    hand-written backward (its products written out= into one buffer) did not survive AOT
    autograd: a bf16 training step under CPU autocast with two GPSA layers failed to compile
    ("expected scalar type float32 but found bfloat16" in the traced backward)."""
    return torch.compiler.is_compiling()


def _map_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the mixing with P and the maps' gradients: float64 for float64,
    else float32 (as autocast keeps softmax in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_gemm(qkv: torch.Tensor) -> torch.Tensor:
    """qkv contiguous in its GEMM dtype: the layout copy and any cast in one pass."""
    dtype = gemm_dtype(qkv.dtype)
    if qkv.dtype == dtype:
        return qkv.contiguous()
    return torch.empty(qkv.shape, dtype=dtype, device=qkv.device).copy_(qkv)


def _as_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The core's (B, H, N, d) result in `dtype`: as computed when the dtypes agree, else cast in
    one pass into a (B, N, H, d)-contiguous buffer (returned as its (B, H, N, d) view), so the
    caller's transpose + reshape to (B, N, C) is free."""
    if out.dtype == dtype:
        return out
    B, H, N, d = out.shape
    return torch.empty(B, N, H, d, dtype=dtype, device=out.device).copy_(out.transpose(1, 2)).transpose(1, 2)


def _attention_forward(qkv: torch.Tensor, gate: Optional[torch.Tensor], pos: Optional[torch.Tensor],
                       scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, H, N, d), softmax(S) and A (B*H, N, N)) for `_Attention`'s inputs: qkv
    (3, B, H, N, d) contiguous in the GEMM dtype (out and A come in it too); gate and pos (or
    None: A = softmax(S)) in the map dtype, softmax(S) too."""
    _, B, H, N, d = qkv.shape
    q, k, v = qkv.view(3, B * H, N, d).unbind(0)  # (B*H, N, d) each
    scores = torch.baddbmm(qkv.new_empty(B * H, N, N), q, k.transpose(1, 2), beta=0., alpha=scale)  # S
    soft = torch.softmax(scores, dim=-1, dtype=_map_dtype(qkv.dtype))  # (B*H, N, N)
    del scores
    if pos is None:
        attn = soft.to(qkv.dtype)  # (soft itself in float32/64)
    else:
        g = gate.view(H, 1, 1)
        # A = s P + (1 - s) softmax(S), computed in the map dtype and written in the GEMM dtype
        attn = torch.addcmul(g * pos, soft.view(B, H, N, N), 1. - g, out=qkv.new_empty(B, H, N, N))
    out = torch.bmm(attn.view(B * H, N, N), v)  # (B*H, N, d)
    return out.view(B, H, N, d), soft, attn.view(B * H, N, N)


def _on_kernel(qkv: torch.Tensor) -> bool:
    """Whether the core runs on a fused kernel for this qkv: its GEMMs in qkv's dtype (bf16 on
    bf16 hardware, or float32), that dtype's kernel usable."""
    return gemm_dtype(qkv.dtype) == qkv.dtype and _library.usable(qkv)


def _kernel_forward(qkv: torch.Tensor, gate: Optional[torch.Tensor], pos: Optional[torch.Tensor],
                    mask: Optional[torch.Tensor], scale: float,
                    for_backward: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, H, N, d), and for the backward the rows' max and 1 / sum and the softmax maps where
    the kernel keeps them (`keeps_maps`), else empty tensors) on the fused kernel, for bf16 or
    float32 qkv in its own strides. out is the (B, H, N, d) view of a (B, N, H, d)-contiguous
    buffer, so the caller's transpose + reshape to (B, N, C) is free."""
    _, B, H, N, d = qkv.shape
    out = qkv.new_empty(B, N, H, d).transpose(1, 2)
    keep_maps = for_backward and _library.keeps_maps(qkv)
    row_max, row_inv, maps = _library.cpu_library(qkv.dtype).attention_forward(
        qkv, gate, pos, mask, scale, out, for_backward, keep_maps)
    return out, row_max, row_inv, maps


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 dropout_p: float = 0.) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, computed in float32 when a CPU backward in bf16/fp16 follows:
    torch's CPU kernel for bf16/fp16 is fast forward only, so with autograd the core is cast up to
    float32 (autocast off) and its output cast back; inference keeps the low-precision kernel, the
    quicker one there (benchmarks/attention_blocks.py times both). q, k, v: (B, H, N, d)."""
    if (q.device.type == 'cpu' and q.dtype in _LOW_PRECISION and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        with torch.autocast('cpu', enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def plain_attention(qkv: torch.Tensor, scale: float, *, dropout_p: float = 0.) -> torch.Tensor:
    """softmax(Q K^T * scale) @ V per head for qkv (3, B, H, N, d) (any strides), with attention
    dropout `dropout_p` (on the fused SDPA): on this core where it is the quicker
    (`plain_attention_on_explicit_core`, no dropout: `explicit_core_attention`), else on torch's fused
    attention. Returns (B, H, N, d)."""
    if dropout_p == 0. and plain_attention_on_explicit_core(qkv):
        return explicit_core_attention(qkv, scale)
    q, k, v = qkv.unbind(0)
    return _scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def gate_and_pos_grads(d_attn_sum: torch.Tensor, soft_dot: torch.Tensor, gate: torch.Tensor,
                       pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPSA's gate and P gradients from the kernels' sums: sum_b dA (H, N, N) and sum <dA, softmax(S)>
    per head (H), for A = (1 - s) softmax(S) + s P."""
    H = gate.shape[0]
    d_pos = d_attn_sum * gate.view(H, 1, 1)  # dA/dP = s
    d_gate = (d_attn_sum * pos).sum((1, 2)) - soft_dot  # dA/ds = P - softmax(S)
    return d_gate, d_pos


class _Attention(torch.autograd.Function):
    """The core with a hand-written backward (see `explicit_core_attention` and `gated_attention`).

    gate and pos (both None for plain attention) come in the map dtype (float32/64); mask (H, N, N),
    float32, only on a fused kernel (`masked_attention_usable`); qkv may be
    bfloat16/float16 (from an autocast linear). The batched GEMMs run in `gemm_dtype(qkv.dtype)`
    (qkv cast on the way in when that differs, the output cast back on the way out), the softmax,
    the mixing and the maps' gradients in the map dtype; the qkv gradient comes back in qkv's dtype
    and memory layout. Autocast is off inside, so every op runs in the dtype chosen here. On the
    fused kernel (`_on_kernel`) qkv and two numbers per map row are kept for the backward, and in
    float32 the softmax maps where they are small (`_library.keeps_maps`).
    """

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, gate: Optional[torch.Tensor], pos: Optional[torch.Tensor],
                mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.in_dtype = qkv.dtype
        # qkv's strides as empty_like keeps them (dense layouts only), for its gradient
        ctx.in_strides = torch.empty_like(qkv, device='meta').stride()
        ctx.on_kernel = _on_kernel(qkv)
        if ctx.on_kernel:
            out, row_max, row_inv, maps = _kernel_forward(qkv, gate, pos, mask, scale, for_backward=True)
            ctx.save_for_backward(qkv, gate, pos, mask, row_max, row_inv, maps)
            return out
        assert mask is None, 'a score mask runs on the fused kernels only (masked_attention_usable)'
        with torch.autocast('cpu', enabled=False):
            qkv_gemm = as_gemm(qkv)
            out, soft, attn = _attention_forward(qkv_gemm, gate, pos, scale)
        ctx.save_for_backward(qkv_gemm, gate, pos, soft, attn)
        return _as_output(out, qkv.dtype)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        if ctx.on_kernel:
            return _Attention._kernel_backward(ctx, d_out)
        with torch.autocast('cpu', enabled=False):
            return _Attention._backward(ctx, d_out)

    @staticmethod
    def _kernel_backward(ctx, d_out: torch.Tensor):
        qkv, gate, pos, mask, row_max, row_inv, maps = ctx.saved_tensors
        H = qkv.shape[2]
        d_qkv = torch.empty_strided(qkv.shape, ctx.in_strides, dtype=qkv.dtype, device=qkv.device)
        coef = ctx.scale * (torch.ones(H) if gate is None else 1. - gate)  # dS's factor per head
        map_grads = any(ctx.needs_input_grad[1:4])
        d_attn_sum, soft_dot = _library.cpu_library(qkv.dtype).attention_backward(
            _library.d_out_for_kernel(d_out, qkv.dtype), qkv, gate, pos, mask, row_max, row_inv, maps,
            coef, ctx.scale, d_qkv, map_grads)  # sum_b dA (H, N, N) and sum <dA, softmax(S)> per head, for the
        d_gate = d_pos = d_mask = None   # gate's grads; or the mask's gradient (H, N, N)
        if ctx.needs_input_grad[3]:
            d_mask = d_attn_sum
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            d_gate, d_pos = gate_and_pos_grads(d_attn_sum, soft_dot, gate, pos)
        return d_qkv, d_gate, d_pos, d_mask, None

    @staticmethod
    def _backward(ctx, d_out: torch.Tensor):
        qkv, gate, pos, soft, attn = ctx.saved_tensors
        _, B, H, N, d = qkv.shape
        q, k, v = qkv.view(3, B * H, N, d).unbind(0)
        if d_out.dtype == qkv.dtype:
            d_out = d_out.reshape(B * H, N, d)
        else:  # cast and lay out for the batched GEMMs in one pass
            d_out = torch.empty(B, H, N, d, dtype=qkv.dtype, device=qkv.device).copy_(d_out).view(B * H, N, d)
        d_qkv = torch.empty_like(qkv)  # filled in place: no stacking copy afterwards
        dq, dk, dv = d_qkv.view(3, B * H, N, d).unbind(0)
        d_attn = torch.bmm(d_out, v.transpose(1, 2)).to(soft.dtype)  # dA (B*H, N, N), in the map dtype
        torch.bmm(attn.transpose(1, 2), d_out, out=dv)
        d_gate = d_pos = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            d_attn_sum = d_attn.view(B, H, N, N).sum(0)  # (H, N, N)
            if ctx.needs_input_grad[2]:
                d_pos = d_attn_sum * gate.view(H, 1, 1)  # dA/dP = s
            if ctx.needs_input_grad[1]:  # dA/ds = P - softmax(S)
                soft_dot = torch.linalg.vecdot(d_attn.view(B, H, N * N), soft.view(B, H, N * N)).sum(0)  # (H,)
                d_gate = (d_attn_sum * pos).sum((1, 2)) - soft_dot
        # dS = softmax'(dA) * (1 - s) * scale, then in the GEMM dtype for dQ and dK
        d_scores = torch._softmax_backward_data(d_attn, soft, -1, soft.dtype)  # (B*H, N, N)
        del d_attn
        if gate is None:
            d_scores.mul_(ctx.scale)
        else:
            d_scores.view(B, H, N, N).mul_(((1. - gate) * ctx.scale).view(H, 1, 1))
        d_scores = d_scores.to(qkv.dtype)
        torch.bmm(d_scores, k, out=dq)
        torch.bmm(d_scores.transpose(1, 2), q, out=dk)
        if ctx.in_dtype != d_qkv.dtype or ctx.in_strides != d_qkv.stride():
            # back to qkv's dtype and layout (the linear's (B, N, 3, H, d)): one pass, and the
            # linear's backward then reads it without a copy
            d_in = torch.empty_strided(d_qkv.shape, ctx.in_strides, dtype=ctx.in_dtype, device=d_qkv.device)
            d_qkv = d_in.copy_(d_qkv)
        return d_qkv, d_gate, d_pos, None, None


def _core(qkv: torch.Tensor, gate: Optional[torch.Tensor], pos: Optional[torch.Tensor], scale: float,
          mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (qkv, gate, pos, mask)):
        if _on_kernel(qkv):
            return _kernel_forward(qkv, gate, pos, mask, scale, for_backward=False)[0]
        assert mask is None, 'a score mask runs on the fused kernels only (masked_attention_usable)'
        with torch.autocast('cpu', enabled=False):
            out = attention_inference(as_gemm(qkv.transpose(1, 2)), scale, gate, pos)  # (H, B, N, d)
            return _as_output(out.transpose(0, 1), qkv.dtype)
    return _Attention.apply(qkv, gate, pos, mask, scale)


def explicit_core_attention(qkv: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(Q K^T * scale) @ V per head on this core (always: `plain_attention` picks between it
    and torch's fused kernel), differentiable in qkv with the hand-written backward.

    qkv: (3, B, H, N, d), any strides (q, k, v stacked, as a (B, N, 3, H, d) projection output
    permuted). Returns (B, H, N, d) in qkv's dtype (see the module doc for the precision)."""
    return _core(qkv, None, None, scale)


def gated_attention(qkv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """((1 - s) softmax(Q K^T * scale) + s P) @ V per head, differentiable in all three inputs.

    qkv: (3, B, H, N, d), any strides (q, k, v stacked); gate: s (H,) in [0, 1]; pos: P (H, N, N),
    shared by the batch. Returns (B, H, N, d) in qkv's dtype. Forms the B x H x N x N maps (saved
    for the backward), so it is meant for the CPU (see the module doc).
    """
    dtype = _map_dtype(qkv.dtype)
    return _core(qkv, gate.to(dtype).contiguous(), pos.to(dtype).contiguous(), scale)


def masked_attention_usable(qkv: torch.Tensor) -> bool:
    """Whether `masked_attention` can run on `qkv` ((3, B, H, N, d), the projection's output
    permuted): on the CPU in float32, or in bf16 on bf16 hardware (under autocast), with that
    dtype's kernel usable (the torch ops path has no score mask; GMM attention keeps its own torch
    ops elsewhere)."""
    return qkv.dtype in _library.DTYPES and _on_kernel(qkv)


def masked_attention(qkv: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax((Q K^T * scale) * M) @ V per head (GMM attention's eq. 9), differentiable in qkv and
    the mask, on a fused kernel: only where `masked_attention_usable(qkv)`.

    qkv: (3, B, H, N, d) float32 or bf16, any strides (q, k, v stacked); mask: M (H, N, N), shared
    by the batch, applied in float32 (as the softmax and the mask's gradient). Returns (B, H, N, d)
    in qkv's dtype. The kernel keeps qkv, two numbers per map row and, in float32 where they are
    small, the softmax maps for the backward, where torch ops would keep two B x H x N x N maps.
    """
    return _core(qkv, None, None, scale, mask.to(torch.float32).contiguous())


def attention_inference(qkv: torch.Tensor, scale: float, gate: Optional[torch.Tensor] = None,
                        pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The core with nothing kept for a backward: the H*B x N x N maps updated in place where the
    dtypes allow (one buffer in float32/64).

    qkv: (3, H, B, N, d) contiguous in the GEMM dtype, heads first (see `GPSA._qkv_heads_first`);
    gate and pos in the map dtype, or None for plain attention. Returns (H, B, N, d) in the GEMM
    dtype.
    """
    _, H, B, N, d = qkv.shape
    q, k, v = qkv.view(3, H * B, N, d).unbind(0)
    attn = torch.baddbmm(qkv.new_empty(H * B, N, N), q, k.transpose(1, 2), beta=0., alpha=scale)  # S
    if pos is not None and attn.dtype != pos.dtype:  # as the training core: the mix in the map dtype,
        soft = torch.softmax(attn, -1, dtype=pos.dtype).view(H, B, N, N)  # written in the GEMM dtype
        g = gate.view(H, 1, 1, 1)
        torch.addcmul(g * pos.unsqueeze(1), soft, 1. - g, out=attn.view(H, B, N, N))
    else:  # softmax(S), row by row in place (bf16: computed in float32 inside torch's kernel)
        torch._softmax(attn, -1, False, out=attn)
        if pos is not None:
            attn.view(H, B, N, N).lerp_(pos.unsqueeze(1), gate.view(H, 1, 1, 1))  # (1 - s) softmax(S) + s P
    return torch.bmm(attn, v).view(H, B, N, d)
