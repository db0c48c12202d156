"""GPSA's attention core for CUDA inference as one Triton kernel (see `ls_convit`'s module doc).

    out = (1 - s) * softmax(Q K^T / sqrt(d)) V + (s * P) V        (B, N, H, d)

with s * P the gated positional attention (input-independent, kept by the layer). Two kernels
compute it, per (batch, head, block of queries), neither writing a term out on its own:

* one pass (`N` up to `ONE_PASS_MAX_TOKENS`): the block's whole rows of scores at once, their
  exact softmax, the mixed map A = (1 - s) softmax + s P in registers, then one product A @ V.
  Two products per block instead of three (no separate P @ V), no running rescale;
* online softmax (any `N`): flash attention's loop over blocks of keys, multiplying the block of
  s * P with the same block of values in the same loop (three products per block of keys).

The first call for a shape (and a batch size, rounded up to a power of two) times each kernel
that applies at each of its launch settings (`CONFIGS`) and keeps the quickest; with
`ONE_PASS_KERNEL` off only the online kernel is timed. Both read q, k and v straight from the
qkv projection's (B, N, 3, H, d) output (no head-major copies), and multiply a head width that is
a sum of two powers of two (ConViT-Ti's 48 = 32 + 16) as two exact pieces instead of padding it to
the next power of two. Other widths keep the SDPA path. The online kernel alone, measured on an
H100 in bf16, GPU time per call (the timing `benchmarks/gpsa_cuda_core.py` repeats): 111-118 vs
164-166 us for fused SDPA + P @ V at 224 px (batch 256, 196 tokens), 79 vs 174 us at 32 px
(batch 1024, 64 tokens).

Inference only (no backward); fp16/bf16 only (fp32 inputs would run tl.dot in TF32, which
changes the numbers; the module's fp32 path stays exact). `available()` says whether it can run.
"""

from __future__ import annotations

import functools

import torch

__all__ = ['available', 'chosen_kernel', 'gated_attention_inference', 'head_pieces', 'KERNELS', 'ONE_PASS_MAX_TOKENS']

_DTYPES = (torch.float16, torch.bfloat16)

KERNELS = ('one_pass', 'online')
# whole rows of scores in registers: up to 256 keys (BLOCK_N = 256; the 224 px grid's 196 fits)
ONE_PASS_MAX_TOKENS = 256
# False: always the online-softmax kernel (the benchmark's twin, to time the one-pass kernel's gain)
ONE_PASS_KERNEL = True
# False: each kernel launches with its default blocks, untimed (tests: one compile per variant,
# not one per candidate block size)
TUNE = True
# the launch settings each kernel is timed with at a shape's first call (BLOCK_M: queries per
# program; the online kernel's BLOCK_N: keys per step; the one-pass kernel's is N rounded up to a
# power of two), and the first of each, launched untuned (and by Triton's interpreter, on the CPU)
CONFIGS = {
    'one_pass': tuple(dict(BLOCK_M=m, num_warps=w, num_stages=1)
                      for m, w in ((16, 4), (16, 2), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8))),
    'online': tuple(dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                    for m, n, w, s in ((32, 32, 4, 2), (32, 32, 2, 2), (32, 64, 2, 2), (32, 64, 4, 2), (64, 32, 4, 2),
                                       (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2),
                                       (128, 64, 8, 2), (64, 128, 4, 2))),
}


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


@functools.lru_cache(maxsize=None)
def _online_kernel():
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


@functools.lru_cache(maxsize=None)
def _one_pass_kernel():
    triton, tl = _triton()

    @triton.jit
    def gpsa_fwd_one_pass(qkv_ptr, pos_ptr, content_weight_ptr, out_ptr, N, qk_scale,
                          stride_qkv_b, stride_qkv_n, stride_pos_h, stride_pos_n, stride_out_b, stride_out_n,
                          H: tl.constexpr, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # as gpsa_fwd, with every key in one block (N <= BLOCK_N)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        C = H * D
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d0 = tl.arange(0, D0)
        mask_m = offs_m < N
        mask_n = offs_n < N
        base = qkv_ptr + b.to(tl.int64) * stride_qkv_b + h * D
        q_rows = base + offs_m[:, None] * stride_qkv_n
        k_cols = base + C + offs_n[None, :] * stride_qkv_n  # K^T (D, BLOCK_N)
        v_rows = base + 2 * C + offs_n[:, None] * stride_qkv_n  # V (BLOCK_N, D)
        q0 = tl.load(q_rows + offs_d0[None, :], mask=mask_m[:, None], other=0.)
        k0 = tl.load(k_cols + offs_d0[:, None], mask=mask_n[None, :], other=0.)
        scores = tl.dot(q0, k0)  # (BLOCK_M, BLOCK_N) float32
        if D1 > 0:
            offs_d1 = D0 + tl.arange(0, D1)
            q1 = tl.load(q_rows + offs_d1[None, :], mask=mask_m[:, None], other=0.)
            k1 = tl.load(k_cols + offs_d1[:, None], mask=mask_n[None, :], other=0.)
            scores = tl.dot(q1, k1, scores)
        scores = tl.where(mask_n[None, :], scores * qk_scale, float('-inf'))  # log2 units
        p = tl.exp2(scores - tl.max(scores, 1)[:, None])
        weight = tl.load(content_weight_ptr + h).to(tl.float32) / tl.sum(p, 1)  # (1 - s) / row sum
        pos = tl.load(pos_ptr + h * stride_pos_h + offs_m[:, None] * stride_pos_n + offs_n[None, :],
                      mask=mask_m[:, None] & mask_n[None, :], other=0.)
        v0 = tl.load(v_rows + offs_d0[None, :], mask=mask_n[:, None], other=0.)
        # the mixed map A = (1 - s) softmax(S) + s P, rounded once to V's dtype for the product
        attn = (p * weight[:, None] + pos.to(tl.float32)).to(v0.dtype)
        out_rows = out_ptr + b.to(tl.int64) * stride_out_b + offs_m[:, None] * stride_out_n + h * D
        out0 = tl.dot(attn, v0)
        tl.store(out_rows + offs_d0[None, :], out0.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])
        if D1 > 0:
            v1 = tl.load(v_rows + offs_d1[None, :], mask=mask_n[:, None], other=0.)
            out1 = tl.dot(attn, v1)
            tl.store(out_rows + offs_d1[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])

    return gpsa_fwd_one_pass


# (batch rounded up to a power of two, N, H, d, dtype, device, kernels allowed) -> (kernel, launch
# settings), timed at the first call for those sizes; later calls launch the plain kernel (a
# batch of a small model on a GPU can be host-bound: Triton's autotuner costs as much host time
# per call as the launch itself, 41 vs 26 us measured on an H100). The batch is in the key as
# blocks tuned at batch 2 (a model's first, checking call) can be the slow ones at batch 256.
_PICKED: dict[tuple, tuple[str, dict]] = {}


def _block_n(N: int) -> int:
    """The one-pass kernel's key block: N rounded up to a power of two, at least 16 (tl.dot's least)."""
    return max(16, 1 << (N - 1).bit_length())


def _launch(kernel: str, config: dict, args: tuple, shape: dict, B: int, N: int) -> None:
    plain = _one_pass_kernel() if kernel == 'one_pass' else _online_kernel()
    if kernel == 'one_pass':
        shape = dict(shape, BLOCK_N=_block_n(N))
    if not args[0].is_cuda:  # Triton's interpreter (TRITON_INTERPRET=1) takes no launch settings
        config = {k: v for k, v in config.items() if k.startswith('BLOCK_')}
    plain[(-(-N // config['BLOCK_M']), B * shape['H'])](*args, **shape, **config)


def _allowed(N: int, kernel: str | None) -> tuple[str, ...]:
    if kernel is not None:
        return (kernel,)
    return KERNELS if ONE_PASS_KERNEL and N <= ONE_PASS_MAX_TOKENS else ('online',)


def _pick(args: tuple, shape: dict, B: int, N: int, kernels: tuple[str, ...]) -> tuple[str, dict]:
    """The kernel and launch settings for these sizes: on a GPU (with `TUNE`) the quickest of every
    allowed kernel's `CONFIGS`, timed with CUDA events at the first call; else the first kernel's
    first settings."""
    if not (args[0].is_cuda and TUNE):
        return kernels[0], CONFIGS[kernels[0]][0]
    key = (1 << (B - 1).bit_length(), N, shape['H'], shape['D'], args[0].dtype, args[0].device, kernels)
    picked = _PICKED.get(key)
    if picked is None:
        from triton.runtime.errors import OutOfResources
        from triton.testing import do_bench
        timings = {}
        for kernel in kernels:
            for i, config in enumerate(CONFIGS[kernel]):
                try:
                    _launch(kernel, config, args, shape, B, N)  # compiles it
                except OutOfResources:  # too many registers or too much shared memory
                    continue
                timings[kernel, i] = do_bench(lambda: _launch(kernel, config, args, shape, B, N), warmup=5, rep=20)
        kernel, i = min(timings, key=timings.get)
        picked = _PICKED[key] = kernel, CONFIGS[kernel][i]
    return picked


def chosen_kernel(batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> str | None:
    """The kernel picked for these sizes on `device` at their first call, where both could run;
    None before it, or where only the online kernel applies."""
    key = (1 << (batch - 1).bit_length(), tokens, heads, head_dim, dtype, torch.device(device), KERNELS)
    return _PICKED.get(key, (None,))[0]


def gated_attention_inference(qkv: torch.Tensor, pos: torch.Tensor, content_weight: torch.Tensor,
                              scale: float, *, kernel: str | None = None) -> torch.Tensor:
    """(1 - s) softmax(Q K^T * scale) V + (s P) V for qkv (B, N, 3, H, d) (the projection's output,
    any layout with unit stride inside a token), pos = s * P (H, N, N) and content_weight = 1 - s
    (H elements, contiguous); returns (B, N, H, d) contiguous in qkv's dtype. No autograd.
    `kernel`: one of `KERNELS` to force it (the one-pass one only up to `ONE_PASS_MAX_TOKENS`
    tokens); None picks (see the module doc)."""
    B, N, three, H, d = qkv.shape
    strides = qkv.stride()
    if three != 3 or strides[4] != 1 or strides[3] != d or strides[2] != H * d:
        raise ValueError(f'qkv must be (B, N, 3, H, d) with each token contiguous; got {tuple(qkv.shape)} '
                         f'strides {strides}')
    pieces = head_pieces(d)
    if pieces is None:
        raise ValueError(f'head width {d} is neither a power of two >= 16 nor a sum of two; see available()')
    if kernel not in (None, *KERNELS):
        raise ValueError(f'kernel must be one of {KERNELS} or None; got {kernel!r}')
    if kernel == 'one_pass' and N > ONE_PASS_MAX_TOKENS:
        raise ValueError(f'the one-pass kernel takes at most {ONE_PASS_MAX_TOKENS} tokens; got {N}')
    pos = pos.to(qkv.dtype)
    if pos.stride(2) != 1:
        pos = pos.contiguous()
    out = torch.empty((B, N, H, d), dtype=qkv.dtype, device=qkv.device)
    args = (qkv, pos, content_weight, out, N, scale * 1.4426950408889634,  # log2(e): exp2 in-kernel
            strides[0], strides[1], pos.stride(0), pos.stride(1), N * H * d, H * d)
    shape = dict(H=H, D=d, D0=pieces[0], D1=pieces[1])
    _launch(*_pick(args, shape, B, N, _allowed(N, kernel)), args, shape, B, N)
    return out
