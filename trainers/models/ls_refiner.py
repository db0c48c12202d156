""" Refiner (attention expansion + distributed local attention) for locality-search

Paper: `Refiner: Refining Self-attention for Vision Transformers`
  - https://arxiv.org/abs/2106.03714 (Zhou, Shi, Kang, Yu, Jiang, Li, Jin, Hou, Feng, 2021)

A DeiT (class token, learned position embedding, pre-norm blocks) whose first `refiner_blocks`
blocks refine their maps A = softmax(Q K^T / sqrt(d)) (B, H, N, N) before A @ V: expand the H heads
to rH (E: (rH, H)), a head-wise k x k convolution (C: (rH, k, k)), reduce back to H (R: (H, rH)).
What differs from the official code (details in `Refiner`):
* The convolution runs over the 2D key grid separately for every query (the official code
  convolves the N x N map as an image in token order); the class-token key is mixed, not convolved.
* Init: E copies each head r times, R averages the copies, C a centred delta, plus small noise: the
  refiner starts close to the identity (a DeiT). Its weights get no weight decay.
* `Refiner.refine_rows` is linear in A and computes it whichever of five equal ways is cheapest
  (`choose_path`), one of them `kernels.refine_maps` where the kernels are on.
Knobs: `refiner_ratio` (r), `refiner_kernel` (k, odd), `refiner_blocks` (default: all).
"""
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import LayerNorm, PatchEmbed, calculate_drop_path_rates, trunc_normal_
from timm.models import generate_default_cfgs, register_model

from trainers import hooks, kernels
from trainers.models._common import (
    MHSA, GridSize, PreNormBlock, _build_without_weights, _cfg, _check_int, _check_vit_args, _fashion_mnist_cfg,
    _init_vit_weights,
)
from trainers.kernels import Linear, linear

__all__ = ['Refiner', 'RefinedAttention', 'MHSA', 'Block', 'LocalityRefinerViT']


class Refiner(nn.Module):
    """Refine attention maps (B, H, N, N) -> (B, H, N, N): expand H -> rH, head-wise k x k conv over
    the patch-KEY grid (per query), reduce rH -> H.

    What the convolution runs over (the decision this file makes)
    -------------------------------------------------------------
    The official code convolves the N x N map as an image in flattened token order, class token
    included. Here the convolution runs over the 2D KEY GRID, separately for every query: for query i
    (class token included), the row A[i, 1:] over the h * w patch keys is reshaped to an h x w image
    (patches row-major) and cross-correlated with the k x k kernel, zero padding at the grid border
    ("same" size output). With c = k // 2 and 2D offsets o = (dy, dx) in [-c, c]^2:

        A*[i, j] = sum_o w[o] * A[i, j + o]          (A[i, j + o] = 0 when j + o leaves the grid)

    so, for one head (the "distributed local attention" reading, paper eq. after (2)):

        out_i = sum_j A*[i, j] v_j = sum_o w[o] * sum_j A[i, j + o] v_j = sum_j A[i, j] * (sum_o w[o] v_{j - o})

    i.e. attention applied to locally aggregated values: each key is replaced by a k x k neighbourhood
    of keys around it, weighted by the learnt kernel. The query index is NOT convolved (the paper's
    2D formula also shifts i; on the key grid that would mix different queries' distributions).

    Class token. The class-token KEY column A[:, 0] has no grid position: it goes through the expand and
    reduce mixings but not the spatial convolution (as if its kernel were the identity). The
    class-token QUERY row A[0, :] is just another query: its patch-key part is convolved like every
    other row, its class-token entry A[0, 0] is mixed only.

    r changes the parametrisation, not the function class. Expand -> depthwise conv -> reduce is one
    dense H -> H k x k convolution over the patch-key block with weight
        W_dense[o, i] = sum_e R[o, e] * C[e] * E[e, i]      (o, i heads; C[e] a k x k kernel)
    and the class-token column is mixed by the H x H matrix R @ E. So for every r the refined block is
    a member of the same class (dense H -> H convs on the maps); r >= H reaches all of it (one expanded
    head per (o, i) pair), smaller r a subset. What r buys is the optimisation path (paper Table 1:
    faster convergence at equal parameters), at the cost of r x the map memory and work.

    Init (reachable identity). E copies each head r times (E[e, i] = 1 if e // r == i), R averages the
    copies (R[o, e] = 1 / r if e // r == o), the kernel is a centred delta; then the refiner is exactly
    the identity and the model is a DeiT at init. Exact copies would get identical gradients forever
    (r would be wasted), so trunc_normal(std=0.02) noise is added to E, R and C: close to, not exactly,
    the identity. `Refiner.identity_()` sets the exact identity (tests, warm starts from a DeiT).

    Weight decay. The refiner weights (E, C, R) get no weight decay in `param_groups()`: they start at
    the identity, and decay would pull them to 0, i.e. shrink every attention map towards nothing.

    Parameters: `expand` (rH, H), `kernel` (rH, k, k), `reduce` (H, rH).
    `num_prefix_tokens` leading tokens (class token) are keys without grid position: mixed, not convolved.
    """

    def __init__(self, num_heads: int, ratio: int, kernel_size: int, grid_size: GridSize,
                 num_prefix_tokens: int = 1, init_std: float = 0.02):
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f'Refiner: kernel_size={kernel_size} must be an odd int >= 1')
        if ratio < 1:
            raise ValueError(f'Refiner: ratio={ratio} must be an int >= 1')
        self.num_heads = num_heads
        self.ratio = ratio
        self.expanded_heads = eh = num_heads * ratio
        self.kernel_size = kernel_size
        self.grid_size: GridSize = (int(grid_size[0]), int(grid_size[1]))
        self.num_prefix_tokens = num_prefix_tokens
        self.init_std = init_std
        self.force_path: Optional[str] = None  # None: `choose_path`; or one of its paths (tests, benchmarks)
        self.expand = nn.Parameter(torch.empty(eh, num_heads))
        self.kernel = nn.Parameter(torch.empty(eh, kernel_size, kernel_size))
        self.reduce = nn.Parameter(torch.empty(num_heads, eh))
        self.reset_parameters()

    @torch.no_grad()
    def identity_(self) -> 'Refiner':
        """Exact identity: copy each head r times, centred delta kernels, average the copies."""
        r, k = self.ratio, self.kernel_size
        copies = torch.arange(self.expanded_heads, device=self.expand.device) // r  # (rH,) source head
        self.expand.zero_()
        self.expand[torch.arange(self.expanded_heads), copies] = 1.
        self.reduce.zero_()
        self.reduce[copies, torch.arange(self.expanded_heads)] = 1. / r
        self.kernel.zero_()
        self.kernel[:, k // 2, k // 2] = 1.
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity plus trunc_normal(std=init_std) noise (breaks the symmetry between the r copies)."""
        self.identity_()
        if self.init_std > 0:
            for p in (self.expand, self.kernel, self.reduce):
                p.add_(trunc_normal_(torch.empty_like(p), std=self.init_std))

    def dense_kernel(self) -> torch.Tensor:
        """The equivalent dense H -> H conv weight (H, H, k, k): W[o, i] = sum_e R[o, e] C[e] E[e, i]."""
        return torch.einsum('oe,eab,ei->oiab', self.reduce, self.kernel, self.expand)

    def forward(self, attn: torch.Tensor) -> torch.Tensor:
        """(B, H, N, N) -> (B, H, N, N); see `refine_rows` (the layout the model uses)."""
        B, H, N, _ = attn.shape
        rows = attn.transpose(0, 1).reshape(H, B * N, N)  # (H, B*N, N)
        return self.refine_rows(rows).view(H, B, N, N).transpose(0, 1)

    def refine_rows(self, maps: torch.Tensor) -> torch.Tensor:
        """Refine heads-first maps (H, M, N) -> (H, M, N): row m of head h is one query's attention
        over the N keys (M = batch * queries). One of four equal computations (`choose_path`)."""
        H, M, N = maps.shape
        P = self.num_prefix_tokens
        gh, gw = self.grid_size
        if N != P + gh * gw:
            raise ValueError(f'Refiner expects {P} prefix + {gh}x{gw} patch tokens = {P + gh * gw}, got {N}; '
                             'build the model with the img_size/patch_size of the input')
        backward = torch.is_grad_enabled() and (maps.requires_grad or self.kernel.requires_grad)
        path = self.choose_path(gh * gw, backward=backward, on_kernel=self._kernel_usable(maps),
                                low_precision_gemms=_under_cpu_autocast(maps))
        if path == 'kernel':  # (H, M, N) in and out, fused per row
            return kernels.refine_maps(maps, self.expand, self.kernel, self.reduce, gh, gw)
        if path == 'dense':  # one GEMM over (head, key) pairs: (M, H*N) @ (H*N, H*N)
            rows = maps.permute(1, 0, 2).reshape(M, H * N)  # (M, H*N): [m, (i, key)]
            out = linear(rows, self.dense_operator().t())  # (M, H*N): [m, (o, key)], rows @ W
            return out.view(M, H, N).permute(1, 0, 2).contiguous()
        if path == 'mix':  # k = 1: the kernel is one scale per expanded head, so all of it is an H x H mixing
            patch_mix = self.reduce @ (self.kernel.view(-1, 1) * self.expand)  # (H, H): R diag(C) E
            out = (patch_mix @ maps.reshape(H, M * N)).view(H, M, N)
            prefix = (self.reduce @ self.expand) @ maps[..., :P].reshape(H, M * P)  # prefix keys: mixed only
            out[..., :P] = prefix.view(H, M, P)
            return out
        eh, k = self.expanded_heads, self.kernel_size
        x = (self.expand @ maps.reshape(H, M * N)).view(eh, M, N)  # (rH, M, N)
        if path == 'matmul':  # the k x k conv over the key grid as one banded (N, N) matrix per expanded head
            x = torch.bmm(x, self.key_operator(with_prefix=True).transpose(1, 2))  # (rH, M, N)
        else:  # 'conv': every (expanded head, row) is one h x w image; depthwise conv over rH * M channels
            weight = self.kernel.repeat_interleave(M, dim=0).unsqueeze(1)  # (rH * M, 1, k, k)
            patches = F.conv2d(x[..., P:].reshape(1, eh * M, gh, gw), weight, padding=k // 2, groups=eh * M)
            x = torch.cat((x[..., :P], patches.view(eh, M, gh * gw)), dim=-1)  # (rH, M, N)
        return (self.reduce @ x.view(eh, M * N)).view(H, M, N)

    def _kernel_usable(self, maps: torch.Tensor) -> bool:
        """Whether `maps` and the weights can go to the float32 kernel: CPU float32, the kernel built
        here (`kernels.cpu_library_available`: also off under torch.compile and with the `libraries`
        backend off)."""
        return maps.dtype == torch.float32 and self._kernel_usable_on(maps.device, maps.shape[-1])

    def _kernel_usable_on(self, device: torch.device, tokens: int) -> bool:
        return kernels.enabled() and kernels.refine_maps_usable(device, tokens, self.expand, self.kernel, self.reduce)

    def takes_float32_maps(self, device: torch.device, *, backward: bool) -> bool:
        """Under CPU autocast, whether the attention should hand this refiner its maps in float32
        (softmax with a float32 output) rather than in the GEMMs' bf16: where it then refines them on
        the float32 kernel (`choose_path` with `low_precision_gemms`). Otherwise the bf16 torch paths
        are as quick or quicker (measured, see `choose_path`)."""
        tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        return (self._kernel_usable_on(device, tokens) and
                self.choose_path(tokens - self.num_prefix_tokens, backward=backward, on_kernel=True,
                                 low_precision_gemms=True) == 'kernel')

    def choose_path(self, num_patches: int, *, backward: bool = True, on_kernel: bool = False,
                    low_precision_gemms: bool = False) -> str:
        """How `refine_rows` computes (all give the same maps, tested; `force_path` overrides):

        'mix'     k = 1: one H x H mixing (the 1 x 1 kernels are scales); cost independent of r.
        'kernel'  k > 1 with `on_kernel` (CPU float32, the kernel built), where its multiply-adds per
                  row, rH N (2H + k^2), are at most 1 / _KERNEL_COST_FACTOR of the composed operator's,
                  (H N)^2: its loops run at about a quarter of the GEMMs' rate. With
                  `low_precision_gemms` (float32 maps under CPU autocast, where the torch paths' GEMMs
                  run in bf16) the same rule for the forward alone, 1 / 8 for forward + backward.
                  Where the torch path would be 'conv' (large grids) the kernel is taken whatever r.
        'matmul'  expand, the k x k conv as a banded (N, N) matrix per expanded head (one batched GEMM;
                  on the CPU several times faster than a grouped conv2d for small grids), reduce.
        'conv'    expand, depthwise conv2d over the key grid, reduce (large grids, where the banded
                  matrices are mostly zeros).
        'dense'   the composed H -> H operator (H*N x H*N, see `dense_operator`) in one GEMM; its cost
                  does not grow with r, so it wins once r is large enough on small grids.
        The thresholds are measured on the CPU, one layer at a time (benchmarks/attention_blocks.py
        times the paths side by side): 'dense' wins on small grids once r is large enough, 'matmul'
        below; on large grids 'conv' ('dense' costs (H*N)^2 per row there).
        """
        if self.force_path is not None:
            return self.force_path
        if self.kernel_size == 1:
            return 'mix'
        small_grid = num_patches <= 16 * self.kernel_size ** 2  # else the torch path is 'conv'
        if on_kernel:
            H, tokens = self.num_heads, self.num_prefix_tokens + num_patches
            kernel_cost = self.expanded_heads * (2 * H + self.kernel_size ** 2)  # per key, as the dense's
            factor = _KERNEL_COST_FACTOR_VS_BF16_TRAINING if low_precision_gemms and backward else _KERNEL_COST_FACTOR
            if not small_grid or factor * kernel_cost <= H * H * tokens:
                return 'kernel'
        if small_grid:
            dense = 2 * self.ratio >= self.num_heads if backward else 2 * self.ratio > self.num_heads
            return 'dense' if dense else 'matmul'
        return 'conv'

    def key_operator(self, with_prefix: bool = False) -> torch.Tensor:
        """The zero-padded k x k cross-correlation over the h x w key grid as matrices (rH, h*w, h*w):
        M[e, j, j'] = C[e][dy + c, dx + c] with (dy, dx) = pos(j') - pos(j) when |dy|, |dx| <= c, else 0.
        with_prefix: (rH, N, N), the prefix keys passed through unchanged (identity block)."""
        gh, gw = self.grid_size
        k, c = self.kernel_size, self.kernel_size // 2
        dev = self.kernel.device
        ys = torch.arange(gh, device=dev).repeat_interleave(gw)  # (h*w,) row of key j
        xs = torch.arange(gw, device=dev).repeat(gh)  # (h*w,) column of key j
        dy, dx = ys[None, :] - ys[:, None], xs[None, :] - xs[:, None]  # (h*w, h*w): [j, j']
        inside = (dy.abs() <= c) & (dx.abs() <= c)
        tap = (dy + c).clamp(0, k - 1) * k + (dx + c).clamp(0, k - 1)  # (h*w, h*w) flat tap index
        op = self.kernel.reshape(self.expanded_heads, k * k)[:, tap] * inside  # (rH, h*w, h*w)
        if not with_prefix:
            return op
        P = self.num_prefix_tokens
        prefix = torch.eye(P, dtype=op.dtype, device=dev).expand(self.expanded_heads, P, P)
        return torch.cat((F.pad(prefix, (0, gh * gw)), F.pad(op, (P, 0))), dim=1)  # (rH, N, N): [[I, 0], [0, op]]

    def dense_operator(self) -> torch.Tensor:
        """The whole refiner as one (H*N, H*N) matrix W: refined[m, (o, j)] = sum_(i, j') maps[m, (i, j')] W[(i, j'), (o, j)],
        W[(i, j'), (o, j)] = sum_e R[o, e] E[e, i] K[e, j, j'] with K = `key_operator(with_prefix=True)`."""
        H, N = self.num_heads, self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        mixed = torch.einsum('oe,ejm,ei->imoj', self.reduce, self.key_operator(with_prefix=True), self.expand)
        return mixed.reshape(H * N, H * N)


_KERNEL_COST_FACTOR = 4  # the kernel's loops vs MKL's GEMMs, per multiply-add (`Refiner.choose_path`)
_KERNEL_COST_FACTOR_VS_BF16_TRAINING = 8  # vs the bf16 GEMMs of the torch paths under CPU autocast, fwd + bwd


def _under_cpu_autocast(maps: torch.Tensor) -> bool:
    """Whether the torch paths' GEMMs on these CPU maps run in a low precision (CPU autocast on)."""
    return maps.device.type == 'cpu' and torch.is_autocast_enabled('cpu')


class RefinedAttention(nn.Module):
    """Multi-head self-attention with a `Refiner` between softmax and @V (parameter names as timm's ViT
    Attention: qkv, proj; plus refiner.expand / refiner.kernel / refiner.reduce)."""

    def __init__(self, dim: int, num_heads: int, grid_size: GridSize, qkv_bias: bool = False,
                 proj_drop: float = 0., ratio: int = 3, kernel_size: int = 3, num_prefix_tokens: int = 1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        self.refiner = Refiner(num_heads, ratio, kernel_size, grid_size, num_prefix_tokens)
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d)) before refinement, (B, H, N, N)."""
        B, N, C = x.shape
        q, k = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)[:2].unbind(0)
        return ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim
        # heads first, (3, H*B, N, d): the maps then come out as (H, B*N, N), the refiner's layout
        q, k, v = self.qkv(x).view(B, N, 3, H, d).permute(2, 3, 0, 1, 4).reshape(3, H * B, N, d).unbind(0)
        scores = torch.baddbmm(q.new_empty(H * B, N, N), q, k.transpose(1, 2), beta=0., alpha=self.scale)
        backward = torch.is_grad_enabled() and (scores.requires_grad or self.refiner.kernel.requires_grad)
        if scores.dtype in (torch.bfloat16, torch.float16) and self.refiner.takes_float32_maps(scores.device,
                                                                                             backward=backward):
            # CPU autocast: float32 maps for the float32 kernel (and torch's softmax writes float32 rows
            # quicker than bf16 ones); @V casts the refined maps back
            soft = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            soft = scores.softmax(dim=-1)
        attn = self.refiner.refine_rows(soft.view(H, B * N, N))  # rows need not sum to 1
        x = torch.bmm(attn.view(H * B, N, N), v)  # (H*B, N, d)
        x = x.view(H, B, N, d).permute(1, 2, 0, 3).reshape(B, N, C)  # (B, N, C)
        return self.proj_drop(self.proj(x))


class Block(PreNormBlock):
    """A Refiner block: refined attention (`use_refiner`) or plain multi-head self-attention."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            grid_size: GridSize,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            use_refiner: bool = True,
            refiner_ratio: int = 3,
            refiner_kernel: int = 3,
    ):
        if use_refiner:
            attn = RefinedAttention(dim, num_heads, grid_size, qkv_bias=qkv_bias, proj_drop=proj_drop,
                                    ratio=refiner_ratio, kernel_size=refiner_kernel)
        else:
            attn = MHSA(dim, num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop)
        super().__init__(dim, attn, mlp_ratio=mlp_ratio, proj_drop=proj_drop, drop_path=drop_path)
        self.use_refiner = use_refiner


class LocalityRefinerViT(nn.Module):
    """DeiT with refined attention in the first `refiner_blocks` blocks (0 = plain DeiT).

    `embed_dim` is the total width. Class token at index 0 in every block; classification from it.
    """
    family = 'refiner'

    def __init__(
            self,
            *,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dim: int = 384,
            depth: int = 12,
            num_heads: int = 6,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            refiner_ratio: int = 3,
            refiner_kernel: int = 3,
            refiner_blocks: Optional[int] = None,
            use_pos_embed: bool = True,
    ):
        super().__init__()
        img_hw = _check_vit_args(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, use_pos_embed=use_pos_embed)
        _check_int('refiner_ratio', refiner_ratio, 1)
        _check_int('refiner_kernel', refiner_kernel, 1)
        if refiner_blocks is None:
            refiner_blocks = depth
        _check_int('refiner_blocks', refiner_blocks, 0)
        if refiner_kernel % 2 == 0:
            raise ValueError(f'refiner_kernel={refiner_kernel} must be odd (centred kernel); use '
                             f'{refiner_kernel - 1 or 1} or {refiner_kernel + 1}')
        grid = (img_hw[0] // patch_size, img_hw[1] // patch_size)
        max_kernel = 2 * max(grid) - 1
        if refiner_kernel > max_kernel:
            raise ValueError(f'refiner_kernel={refiner_kernel} is wider than needed for the {grid[0]}x{grid[1]} patch '
                             f'grid (taps beyond {max_kernel} only ever see zero padding); use <= {max_kernel}')
        if refiner_blocks > depth:
            raise ValueError(f'refiner_blocks={refiner_blocks} exceeds depth={depth}; it counts the first blocks '
                             f'with refined attention, use a value in [0, {depth}] (0 = DeiT)')

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.refiner_ratio = refiner_ratio
        self.refiner_kernel = refiner_kernel
        self.refiner_blocks = refiner_blocks
        self.use_pos_embed = use_pos_embed
        self.num_prefix_tokens = 1
        self.global_pool = 'token'

        self.patch_embed = PatchEmbed(img_size=img_hw, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.grid_size: GridSize = tuple(self.patch_embed.grid_size)
        self.num_patches = num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        if use_pos_embed:
            self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))  # class token included
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(p=drop_rate)

        dpr = calculate_drop_path_rates(drop_path_rate, depth)  # stochastic depth decay rule
        self.blocks = nn.ModuleList([
            Block(
                dim=embed_dim,
                num_heads=num_heads,
                grid_size=self.grid_size,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=drop_rate,
                drop_path=dpr[i],
                use_refiner=i < refiner_blocks,
                refiner_ratio=refiner_ratio,
                refiner_kernel=refiner_kernel,
            ) for i in range(depth)])
        self.norm = LayerNorm(embed_dim)
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f'blocks.{i}') for i in range(depth)]
        self.head = Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.cls_token, std=.02)
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=.02)
        self.apply(_init_vit_weights)  # Refiner keeps its own (near-identity) init

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'pos_embed', 'cls_token'}

    def param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        """AdamW parameter groups, each {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale).

        No weight decay: biases, norms, pos_embed, cls_token and the refiner weights (they start at the
        identity; decay would shrink the attention maps). Everything else: `weight_decay`. lr_scale 1.0.
        Frozen parameters are left out; empty groups are dropped.
        """
        skip = self.no_weight_decay()
        return hooks.param_groups(self, weight_decay, no_decay=lambda name, p: name in skip or '.refiner.' in name)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed',  # stem and embed
            blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))]
        )

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in ('token', 'avg'):
                raise ValueError(f"global_pool={global_pool!r}: use 'token' or 'avg'")
            self.global_pool = global_pool
        self.num_classes = num_classes
        w = self.norm.weight
        self.head = (Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
                     if num_classes > 0 else nn.Identity())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, h*w, C)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)  # (B, N = 1 + h*w, C)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.global_pool == 'token' else x[:, self.num_prefix_tokens:].mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _create_ls_refiner(variant: str, pretrained: bool = False, **kwargs) -> LocalityRefinerViT:
    return _build_without_weights(LocalityRefinerViT, variant, pretrained, **kwargs)


default_cfgs = generate_default_cfgs({
    'ls_refiner_nano': _fashion_mnist_cfg(),
    'ls_refiner_micro': _fashion_mnist_cfg(),
    'ls_refiner_tiny': _cfg(),
    'ls_refiner_small': _cfg(),
})


@register_model
def ls_refiner_nano(pretrained: bool = False, **kwargs) -> LocalityRefinerViT:
    """Test-sized: 28x28 grayscale, 7x7 patches of 4, width 32, 4 heads, 2 refined blocks, r=2, k=3."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                      num_heads=4, refiner_ratio=2, refiner_kernel=3)
    return _create_ls_refiner('ls_refiner_nano', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_refiner_micro(pretrained: bool = False, **kwargs) -> LocalityRefinerViT:
    """CPU default for Fashion-MNIST: 28x28 grayscale, 7x7 patches of 4, width 96, 4 heads, 8 refined
    blocks, r=2, k=3 (the sizes of ls_convit_micro)."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=8,
                      num_heads=4, refiner_ratio=2, refiner_kernel=3)
    return _create_ls_refiner('ls_refiner_micro', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_refiner_tiny(pretrained: bool = False, **kwargs) -> LocalityRefinerViT:
    """DeiT-Ti sized: 224 px, patch 16, width 192, 3 heads, depth 12, all refined, r=3, k=3."""
    model_args = dict(embed_dim=192, depth=12, num_heads=3, refiner_ratio=3, refiner_kernel=3)
    return _create_ls_refiner('ls_refiner_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_refiner_small(pretrained: bool = False, **kwargs) -> LocalityRefinerViT:
    """DeiT-S sized: 224 px, patch 16, width 384, 6 heads, depth 12, all refined, r=3, k=3."""
    model_args = dict(embed_dim=384, depth=12, num_heads=6, refiner_ratio=3, refiner_kernel=3)
    return _create_ls_refiner('ls_refiner_small', pretrained=pretrained, **dict(model_args, **kwargs))
