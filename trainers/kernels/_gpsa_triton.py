"""GPSA's attention core for CUDA inference as one Triton kernel (`kernels.gated_attention`'s CUDA inference backend).

Per (batch, head, block of queries) it runs flash attention's loop over the keys and, in the same
loop, multiplies the block of s * P (the gated positional attention, input-independent) with the
same block of values:

    out = (1 - s) * softmax(Q K^T / sqrt(d)) V + (s * P) V        (B, N, H, d)

so the values are read once, neither term is written out on its own, and the mix lands in the
layout the output projection reads. Two things make it quicker than fused SDPA plus a GEMM for
P @ V at GPSA's shapes besides the saved passes: q, k and v are read straight from the qkv
projection's (B, N, 3, H, d) output (no head-major copies), and a head width that is a sum of
two powers of two (ConViT-Ti's 48 = 32 + 16) is multiplied as two exact pieces instead of being
padded to the next power of two. Other widths keep the SDPA path. `benchmarks/gpsa_cuda_core.py`
times it against that path. Its launch settings (`CONFIGS`) are timed at the
first call for a shape and batch size (rounded up to a power of two); `TUNE = False` launches the
first of them untimed.

A one-pass variant (each block's whole rows of scores at once, their exact softmax, the mixed map
in registers, one product with V: two products instead of three) measured slower and was dropped
(and Triton miscompiled two of its block settings, BLOCK_M 64 on 4 warps and 128 on 8).

Inference only (no backward); fp16/bf16 only (fp32 inputs would run tl.dot in TF32, which
changes the numbers; the module's fp32 path stays exact). `available()` says whether it can run.
"""

from __future__ import annotations

import functools

import torch

__all__ = ['CONFIGS', 'TUNE', 'available', 'gated_attention_inference', 'head_pieces']

_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # CPU-only torch builds ship without Triton
        return None
    return triton, tl


def available(x: torch.Tensor, head_dim: int) -> bool:
    """True where the fused kernel can run: `x` a CUDA half-precision tensor, a head width it
    multiplies exactly (`head_pieces`), Triton present."""
    return x.is_cuda and x.dtype in _DTYPES and head_pieces(head_dim) is not None and _triton() is not None


def head_pieces(head_dim: int) -> tuple[int, int] | None:
    """(D0, D1): the head width as one power of two >= 16 (D1 = 0) or as the sum of two (ConViT's
    48 = 32 + 16); None for any other width (those keep fused SDPA + P @ V)."""
    d0 = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - d0
    if d0 < 16:
        return None
    if rest == 0:
        return d0, 0
    if rest >= 16 and rest & (rest - 1) == 0:
        return d0, rest
    return None


# the launch settings timed at a shape's first call (BLOCK_M queries per program, BLOCK_N keys per
# step); the first is launched untuned (`TUNE` off) and by Triton's interpreter on the CPU
CONFIGS = tuple(dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                for m, n, w, s in ((32, 32, 4, 2), (32, 32, 2, 2), (32, 64, 2, 2), (32, 64, 4, 2), (64, 32, 4, 2),
                                   (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2),
                                   (64, 128, 4, 2)))
# False: launch CONFIGS[0] untimed (tests: one compile per shape, not one per candidate)
TUNE = True


@functools.lru_cache(maxsize=None)
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def gpsa_fwd(qkv_ptr, pos_ptr, content_weight_ptr, out_ptr, N, qk_scale,
                 stride_qkv_b, stride_qkv_n, stride_pos_h, stride_pos_n, stride_out_b, stride_out_n,
                 H: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # qkv (B, N, 3, H, D) and out (B, N, H, D), each token contiguous; pos = s * P (H, N, N),
        # unit stride along the keys; content_weight = 1 - s (H,)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        C = H * D
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d0 = tl.arange(0, D0)
        mask_m = offs_m < N
        base = qkv_ptr + b.to(tl.int64) * stride_qkv_b + h * D
        q_rows = base + offs_m[:, None] * stride_qkv_n
        q0 = tl.load(q_rows + offs_d0[None, :], mask=mask_m[:, None], other=0.)
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            q1 = tl.load(q_rows + offs_d1[None, :], mask=mask_m[:, None], other=0.)
            acc1 = tl.zeros((BLOCK_M, D1), dtype=tl.float32)
            pacc1 = tl.zeros((BLOCK_M, D1), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), float('-inf'), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc0 = tl.zeros((BLOCK_M, D0), dtype=tl.float32)  # content term, unnormalised
        pacc0 = tl.zeros((BLOCK_M, D0), dtype=tl.float32)  # positional term
        pos_rows = pos_ptr + h * stride_pos_h + offs_m[:, None] * stride_pos_n

        for start_n in range(0, N, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            k_cols = base + C + offs_n[None, :] * stride_qkv_n  # K^T block (D, BLOCK_N)
            v_rows = base + 2 * C + offs_n[:, None] * stride_qkv_n  # V block (BLOCK_N, D)
            k0 = tl.load(k_cols + offs_d0[:, None], mask=mask_n[None, :], other=0.)
            scores = tl.dot(q0, k0)
            if D1 > 0:
                k1 = tl.load(k_cols + offs_d1[:, None], mask=mask_n[None, :], other=0.)
                scores = tl.dot(q1, k1, scores)
            scores = tl.where(mask_n[None, :], scores * qk_scale, float('-inf'))  # log2 units
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            pos = tl.load(pos_rows + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.)
            v0 = tl.load(v_rows + offs_d0[None, :], mask=mask_n[:, None], other=0.)
            p = p.to(v0.dtype)
            acc0 = tl.dot(p, v0, acc0 * alpha[:, None])
            pacc0 = tl.dot(pos, v0, pacc0)
            if D1 > 0:
                v1 = tl.load(v_rows + offs_d1[None, :], mask=mask_n[:, None], other=0.)
                acc1 = tl.dot(p, v1, acc1 * alpha[:, None])
                pacc1 = tl.dot(pos, v1, pacc1)

        weight = tl.load(content_weight_ptr + h).to(tl.float32) / l_i  # (1 - s) / row sum
        out_rows = out_ptr + b.to(tl.int64) * stride_out_b + offs_m[:, None] * stride_out_n + h * D
        out0 = acc0 * weight[:, None] + pacc0
        tl.store(out_rows + offs_d0[None, :], out0.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])
        if D1 > 0:
            out1 = acc1 * weight[:, None] + pacc1
            tl.store(out_rows + offs_d1[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])

    return gpsa_fwd


# (batch rounded up to a power of two, N, H, d, dtype, device) -> the launch settings timed quickest
# at the first call for those sizes; later calls launch the plain kernel with them (a batch of a
# small model on a GPU can be host-bound, and Triton's autotuner costs as much host time per call
# as the launch itself). The batch is in the key as the grid
# grows with it: Triton's autotuner, keyed on (N, H, d), kept what it timed at a model's first,
# checking call at batch 2 for every batch after.
_TUNED: dict[tuple, dict] = {}


def _launch(config: dict, args: tuple, shape: dict, B: int, N: int) -> None:
    if not args[0].is_cuda:  # Triton's interpreter (TRITON_INTERPRET=1) takes no launch settings
        config = {k: v for k, v in config.items() if k.startswith('BLOCK_')}
    _kernel()[(-(-N // config['BLOCK_M']), B * shape['H'])](*args, **shape, **config)


def _config(args: tuple, shape: dict, B: int, N: int) -> dict:
    """The launch settings for these sizes: on a GPU (with `TUNE`) the quickest of `CONFIGS`,
    timed with CUDA events at the first call; else the first."""
    if not (args[0].is_cuda and TUNE):
        return CONFIGS[0]
    key = (1 << (B - 1).bit_length(), N, shape['H'], shape['D'], args[0].dtype, args[0].device)
    config = _TUNED.get(key)
    if config is None:
        from triton.runtime.errors import OutOfResources
        from triton.testing import do_bench
        timings = {}
        for i, candidate in enumerate(CONFIGS):
            try:
                _launch(candidate, args, shape, B, N)  # compiles it
            except OutOfResources:  # too many registers or too much shared memory on this GPU
                continue
            timings[i] = do_bench(lambda: _launch(candidate, args, shape, B, N), warmup=5, rep=20)
        config = _TUNED[key] = CONFIGS[min(timings, key=timings.get)]
    return config


def gated_attention_inference(qkv: torch.Tensor, pos: torch.Tensor, content_weight: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """(1 - s) softmax(Q K^T * scale) V + (s P) V for qkv (B, N, 3, H, d) (the projection's output,
    any layout with unit stride inside a token), pos = s * P (H, N, N) and content_weight = 1 - s
    (H elements, contiguous); returns (B, N, H, d) contiguous in qkv's dtype. No autograd."""
    B, N, three, H, d = qkv.shape
    strides = qkv.stride()
    if three != 3 or strides[4] != 1 or strides[3] != d or strides[2] != H * d:
        raise ValueError(f'qkv must be (B, N, 3, H, d) with each token contiguous; got {tuple(qkv.shape)} '
                         f'strides {strides}')
    pieces = head_pieces(d)
    if pieces is None:
        raise ValueError(f'head width {d} is neither a power of two >= 16 nor a sum of two; see available()')
    pos = pos.to(qkv.dtype)
    if pos.stride(2) != 1:
        pos = pos.contiguous()
    out = torch.empty((B, N, H, d), dtype=qkv.dtype, device=qkv.device)
    args = (qkv, pos, content_weight, out, N, scale * 1.4426950408889634,  # log2(e): exp2 in-kernel
            strides[0], strides[1], pos.stride(0), pos.stride(1), N * H * d, H * d)
    shape = dict(H=H, D=d, D0=pieces[0], D1=pieces[1])
    _launch(_config(args, shape, B, N), args, shape, B, N)
    return out
