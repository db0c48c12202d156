""" Gaussian Mixture Mask (GMM) attention ViT for locality-search

Paper: `Gaussian Mixture Mask Attention` (boosting ViTs on small datasets with a Gaussian mixture
mask); code: https://github.com/CatworldLee/Gaussian-Mixture-Mask-Attention

Per head h (eq. 9), the mask multiplies the scaled scores before the softmax:
    out = softmax((Q K^T / sqrt(d)) * M_h) V,  M_h(i, j) = sum_k alpha[h, k] exp(-d2_ij / (2 sigma[h, k]^2 + eps))
with d2_ij the squared distance of patches i and j on the grid (row-major, as Algorithm 1) and
alpha, sigma (H, K) per layer. What differs from the reference code:
* The mask's exponent is formed before exponentiating once (`gmm_mask`), so it does not underflow
  on large grids; it is computed once per forward in the parameters' dtype, shared by the batch.
* `GMMAttention.forward` is the formula; with `trainers.kernels` on it calls
  `kernels.masked_attention` where that runs (the maps never materialised), except with dropout.
* No class token (the mask needs a patch grid): average pooling, then `fc_norm` and the head.
* `drop_rate` is DeiT-style dropout (position embedding, projections, MLP), as in `ls_convit`.
Knobs: `num_kernels` (K), `alpha_init_mean/std` and `sigma_init_mean/std` (paper: alpha ~ N(0, 2^2),
sigma ~ N(10, 10^2)), `mask_weight_decay` (whether alpha/sigma decay, through `param_groups()`),
`use_mask` (False: plain softmax attention, the control of the mask with every other line of the
model the same; alpha and sigma are still drawn, so a seed initialises every shared weight alike,
and frozen).
"""
import math
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

from timm.layers import LayerNorm, PatchEmbed, calculate_drop_path_rates, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models import register_notrace_module

from trainers import hooks, kernels
from trainers.models._common import (
    GridSize, PreNormBlock, _build_without_weights, _cfg, _check_bool, _check_int, _check_real, _check_vit_args,
    _fashion_mnist_cfg, _grid_offsets, _init_vit_weights, _patch_tokens, _token_grid,
)
from trainers.kernels import Linear

__all__ = ['gmm_mask', 'grid_sq_distances', 'GMMAttention', 'Block', 'LocalityGMMViT']


GMM_EPS = 1e-6


def grid_sq_distances(grid_size: GridSize) -> torch.Tensor:
    """Squared 2D distances d2[i, j] = dx^2 + dy^2 between patches i and j, shape (N, N), float32
    (`_grid_offsets`: patches row-major, as Algorithm 1 of the paper: dx from n % W, dy from n // W).
    Exact integers, so float32 is exact up to huge grids."""
    dx, dy = _grid_offsets(grid_size)
    return dx * dx + dy * dy


def gmm_mask(d2: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor, eps: float = GMM_EPS) -> torch.Tensor:
    """Gaussian mixture mask M (H, N, N), M[h] = sum_k alpha[h, k] exp(-d2 / (2 sigma[h, k]^2 + eps)).

    d2: (N, N) squared patch distances; alpha, sigma: (H, K). The exponent is formed first and
    exponentiated once (never a power of an underflowed exp), so an entry is 0 only when its exact
    value is below the dtype's range. Computed in the dtype of alpha/sigma (d2 is cast to it).
    sigma may be <= 0: it only enters as sigma^2 (the mask is even in sigma), and the denominator is
    >= eps > 0.

    sigma <= 0 or tiny: sigma enters only through sigma^2 in `2 sigma^2 + eps` (eps = 1e-6), so the mask
    is even in sigma (a negative sigma acts as |sigma|; no clamp, no abs) and the denominator is always
    >= eps > 0, so no division by zero and no NaN. sigma = 0 gives exp(-d2 / eps): 1 on the diagonal
    (d2 = 0), 0 elsewhere -- a "self only" kernel; its gradient w.r.t. sigma is 0 exactly at sigma = 0
    (a measure-zero event under the random init), so it can still move away through the other pairs
    once sigma != 0.

    Underflow: the reference code computes the mask as a power of a precomputed exp(-d2 / 2), i.e.
    exp(-d2/2) ** (1/sigma^2). In float32 exp(-x) underflows to 0 for x > ~103 (and is subnormal past
    ~87), so on a 16x16 grid (d2 up to 450) or larger the base is already 0 for far pairs and the mask
    entry is 0 whatever sigma is. Here the exponent -d2 / (2 sigma^2 + eps) is formed first and
    exponentiated once (`gmm_mask`). "No underflow" means precisely: every kernel value whose exact
    value exp(-d2 / (2 sigma^2 + eps)) is a normal number of the compute dtype (float32: exponent
    >= -87.3, e.g. every pair of a 32x32 grid for sigma >= 3.4) is computed to a relative error of
    about |exponent| * 2^-24 (a few 1e-6) and in particular is > 0. Values whose exact result is below
    the dtype's range (e.g. sigma = 1 on a 32x32 grid, exp(-961)) are 0 in float32 and float64 alike:
    that is the true value rounded, not an artefact. The mask is computed in the parameters' dtype
    (float32 normally, also under autocast) and cast to the scores' dtype only for the multiply.
    """
    if alpha.shape != sigma.shape or alpha.ndim != 2:
        raise ValueError(f'gmm_mask: alpha {tuple(alpha.shape)} and sigma {tuple(sigma.shape)} must both be (H, K)')
    denom = 2. * sigma * sigma + eps  # (H, K)
    expo = -d2.to(sigma.dtype)[None, None] / denom[:, :, None, None]  # (H, K, N, N)
    return torch.einsum('hk,hknm->hnm', alpha, torch.exp(expo))


@register_notrace_module  # reason: the d2 cache is Python control flow
class GMMAttention(nn.Module):
    """Multi-head self-attention with a per-head Gaussian mixture mask on the scaled scores.

    Parameters: qkv (dim -> 3 dim), proj, alpha (H, K), sigma (H, K). `dim` is the total width.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            num_kernels: int = 5,
            alpha_init_mean: float = 0.,
            alpha_init_std: float = 2.,
            sigma_init_mean: float = 10.,
            sigma_init_std: float = 10.,
            eps: float = GMM_EPS,
            grid_size: Optional[GridSize] = None,
            use_mask: bool = True,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'GMMAttention: dim={dim} is not divisible by num_heads={num_heads}; pick a multiple')
        if num_kernels < 1:
            raise ValueError(f'GMMAttention: num_kernels={num_kernels}; use num_kernels >= 1')
        self.num_heads = num_heads
        self.dim = dim
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.num_kernels = num_kernels
        self.eps = float(eps)
        self.use_mask = bool(use_mask)
        self.alpha_init_mean, self.alpha_init_std = float(alpha_init_mean), float(alpha_init_std)
        self.sigma_init_mean, self.sigma_init_std = float(sigma_init_mean), float(sigma_init_std)
        self.grid_size = tuple(grid_size) if grid_size is not None else None

        self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.alpha = nn.Parameter(torch.empty(num_heads, num_kernels))
        self.sigma = nn.Parameter(torch.empty(num_heads, num_kernels))

        # d2 for the last grid seen, (N, N); non-persistent: rebuilt, never saved
        self._d2_grid: Optional[GridSize] = None
        self.register_buffer('d2', torch.zeros(0, 0), persistent=False)
        if self.grid_size is not None:
            self._set_d2(self.grid_size)
        # standalone, initialise as LocalityGMMViT does (the model re-applies the same scheme)
        for linear in (self.qkv, self.proj):
            trunc_normal_(linear.weight, std=.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.reset_mask_parameters()
        if not self.use_mask:  # unused: out of the optimizer (param_groups leaves frozen ones out)
            self.alpha.requires_grad_(False)
            self.sigma.requires_grad_(False)

    @torch.no_grad()
    def reset_mask_parameters(self) -> None:
        """alpha ~ N(alpha_init_mean, alpha_init_std^2), sigma ~ N(sigma_init_mean, sigma_init_std^2)."""
        self.alpha.normal_(self.alpha_init_mean, self.alpha_init_std)
        self.sigma.normal_(self.sigma_init_mean, self.sigma_init_std)

    # --- distances ---------------------------------------------------------------------------
    def _set_d2(self, grid: GridSize) -> None:
        self.d2 = grid_sq_distances(grid).to(device=self.alpha.device)  # kept float32 (exact integers)
        self._d2_grid = grid

    def init_non_persistent_buffers(self) -> None:
        """Recompute the cached distances (e.g. after materialising from the meta device)."""
        if self._d2_grid is not None:
            self._set_d2(self._d2_grid)

    # --- mask and attention ------------------------------------------------------------------
    def mask(self, grid: GridSize) -> torch.Tensor:
        """The Gaussian mixture mask M (H, N, N) for `grid`, in the parameters' dtype."""
        if self._d2_grid != grid or self.d2.device != self.alpha.device:
            self._set_d2(grid)
        return gmm_mask(self.d2, self.alpha, self.sigma, self.eps)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        return self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)

    def _scaled_mask(self, num_patches: int) -> torch.Tensor:
        return self.mask(_token_grid(self.grid_size, num_patches, 'GMMAttention')) * self.scale  # (H, N, N), 1/sqrt(d) folded into the mask

    def _scores(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Masked scores B = (Q K^T / sqrt(d)) * M (B, H, N, N) and V (B, H, N, d), on torch ops
        (M = 1 with `use_mask` off)."""
        q, k, v = qkv.unbind(0)
        scores = q @ k.transpose(-2, -1)  # (B, H, N, N)
        if not self.use_mask:
            return scores * self.scale, v
        return scores * self._scaled_mask(q.shape[2]).to(scores.dtype), v

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """softmax((Q K^T / sqrt(d)) * M) (B, H, N, N), no dropout; every row sums to 1."""
        scores, _ = self._scores(self._qkv(x))
        return scores.softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self._qkv(x)
        if (self.use_mask and kernels.enabled() and kernels.masked_attention_usable(qkv)
                and not (self.training and self.attn_drop.p > 0.)):
            out = kernels.masked_attention(qkv, self._scaled_mask(N), 1.)  # (B, H, N, d), on a fused kernel
        else:
            scores, v = self._scores(qkv)
            out = self.attn_drop(scores.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


class Block(PreNormBlock):
    """A GMM block: Gaussian-mixture-masked attention."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            num_kernels: int = 5,
            alpha_init_mean: float = 0.,
            alpha_init_std: float = 2.,
            sigma_init_mean: float = 10.,
            sigma_init_std: float = 10.,
            grid_size: Optional[GridSize] = None,
            use_mask: bool = True,
    ):
        attn = GMMAttention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, num_kernels=num_kernels,
            alpha_init_mean=alpha_init_mean, alpha_init_std=alpha_init_std,
            sigma_init_mean=sigma_init_mean, sigma_init_std=sigma_init_std, grid_size=grid_size, use_mask=use_mask)
        super().__init__(dim, attn, mlp_ratio=mlp_ratio, proj_drop=proj_drop, drop_path=drop_path)


class LocalityGMMViT(nn.Module):
    """ViT with Gaussian-mixture-masked attention in every layer; no class token, average pooling.

    `embed_dim` is the total width. `num_kernels` (K) Gaussians per head and layer; `use_mask`
    False: the same ViT with plain attention (the mask's control).
    """
    family = 'gmm'

    def __init__(
            self,
            *,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dim: int = 192,
            depth: int = 12,
            num_heads: int = 3,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            num_kernels: int = 5,
            alpha_init_mean: float = 0.,
            alpha_init_std: float = 2.,
            sigma_init_mean: float = 10.,
            sigma_init_std: float = 10.,
            mask_weight_decay: bool = False,
            use_pos_embed: bool = True,
            use_mask: bool = True,
    ):
        super().__init__()
        img_hw = _check_vit_args(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, use_pos_embed=use_pos_embed)
        _check_int('num_kernels', num_kernels, 1)
        _check_real('alpha_init_mean', alpha_init_mean, -math.inf)
        _check_real('alpha_init_std', alpha_init_std, 0.)
        _check_real('sigma_init_mean', sigma_init_mean, -math.inf)
        _check_real('sigma_init_std', sigma_init_std, 0.)
        _check_bool('mask_weight_decay', mask_weight_decay)
        _check_bool('use_mask', use_mask)

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_kernels = num_kernels
        self.mask_weight_decay = mask_weight_decay
        self.use_mask = use_mask
        self.use_pos_embed = use_pos_embed
        self.num_prefix_tokens = 0
        self.global_pool = 'avg'

        self.patch_embed = PatchEmbed(img_size=img_hw, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.grid_size: GridSize = tuple(self.patch_embed.grid_size)
        self.num_patches = num_patches = self.patch_embed.num_patches

        self.pos_drop = nn.Dropout(p=drop_rate)
        if use_pos_embed:
            self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))
            trunc_normal_(self.pos_embed, std=.02)
        else:
            self.pos_embed = None

        dpr = calculate_drop_path_rates(drop_path_rate, depth)  # stochastic depth decay rule
        self.blocks = nn.ModuleList([
            Block(
                dim=embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=drop_rate,
                drop_path=dpr[i],
                num_kernels=num_kernels,
                alpha_init_mean=alpha_init_mean,
                alpha_init_std=alpha_init_std,
                sigma_init_mean=sigma_init_mean,
                sigma_init_std=sigma_init_std,
                grid_size=self.grid_size,
                use_mask=use_mask,
            ) for i in range(depth)])
        self.fc_norm = LayerNorm(embed_dim)  # after pooling
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f'blocks.{i}') for i in range(depth)]
        self.head = Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        self.apply(_init_vit_weights)  # linears and norms only; alpha/sigma keep their N(mean, std^2) init

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        skip = {'pos_embed'}
        if not self.mask_weight_decay:
            skip |= {n for n, _ in self.named_parameters() if n.endswith(('attn.alpha', 'attn.sigma'))}
        return skip

    @torch.no_grad()
    def mechanism_metrics(self, probe: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """Each Gaussian's width |sigma|, `sigma.BLOCK.HEAD.KERNEL` (trainers.hooks.ReportsMechanisms;
        the mask is even in sigma; read from the parameters, ``probe`` unused); none with the mask off."""
        if not self.use_mask:
            return {}
        return {f'sigma.{i}.{h}.{k}': float(s) for i, blk in enumerate(self.blocks)
                for h, row in enumerate(blk.attn.sigma.float().abs().tolist()) for k, s in enumerate(row)}

    def mask_parameters(self) -> List[nn.Parameter]:
        """alpha and sigma of every layer."""
        return [p for m in self.modules() if isinstance(m, GMMAttention) for p in (m.alpha, m.sigma)]

    def param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        """AdamW parameter groups, each {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale).

        Mask parameters (alpha, sigma): `weight_decay` if `mask_weight_decay` else 0. Biases, norms and
        pos_embed: no weight decay. Everything else: `weight_decay`. All lr_scale 1.0. Frozen
        parameters are left out; empty groups are dropped.
        """
        mask_ids = {id(p) for p in self.mask_parameters()}
        return hooks.param_groups(self, weight_decay, no_decay=lambda name, p: name == 'pos_embed',
                             special=lambda name, p: id(p) in mask_ids,
                             special_weight_decay=weight_decay if self.mask_weight_decay else 0.)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^pos_embed|patch_embed',  # stem and embed
            blocks=[(r'^blocks\.(\d+)', None), (r'^fc_norm', (99999,))]
        )

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None and global_pool != 'avg':
            raise ValueError(f"global_pool={global_pool!r}: this model has no class token, use 'avg'")
        self.num_classes = num_classes
        w = self.fc_norm.weight
        self.head = (Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
                     if num_classes > 0 else nn.Identity())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = _patch_tokens(self.patch_embed, x)  # (B, N, C)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x)
        return x  # (B, N, C); the LayerNorm comes after pooling

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.fc_norm(x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _create_ls_gmm(variant: str, pretrained: bool = False, **kwargs) -> LocalityGMMViT:
    return _build_without_weights(LocalityGMMViT, variant, pretrained, **kwargs)


default_cfgs = generate_default_cfgs({
    'ls_gmm_nano': _fashion_mnist_cfg(),
    'ls_gmm_micro': _fashion_mnist_cfg(),
    'ls_gmm_tiny': _cfg(),
    'ls_gmm_small': _cfg(),
})


@register_model
def ls_gmm_nano(pretrained: bool = False, **kwargs) -> LocalityGMMViT:
    """Test-sized: 28x28 grayscale, 7x7 patches of 4, width 32, 4 heads, depth 2, K = 2."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                      num_heads=4, num_kernels=2)
    return _create_ls_gmm('ls_gmm_nano', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_gmm_micro(pretrained: bool = False, **kwargs) -> LocalityGMMViT:
    """CPU default for Fashion-MNIST: 28x28 grayscale, 7x7 patches of 4, width 96, 4 heads, depth 8, K = 3
    (the sizes of ls_convit_micro)."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=8,
                      num_heads=4, num_kernels=3)
    return _create_ls_gmm('ls_gmm_micro', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_gmm_tiny(pretrained: bool = False, **kwargs) -> LocalityGMMViT:
    """DeiT-Ti sizes with GMM attention: 224 px, patch 16, width 192, 3 heads, depth 12, K = 5 (paper)."""
    model_args = dict(embed_dim=192, depth=12, num_heads=3, num_kernels=5)
    return _create_ls_gmm('ls_gmm_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_gmm_small(pretrained: bool = False, **kwargs) -> LocalityGMMViT:
    """DeiT-S sizes with GMM attention: 224 px, patch 16, width 384, 6 heads, depth 12, K = 5."""
    model_args = dict(embed_dim=384, depth=12, num_heads=6, num_kernels=5)
    return _create_ls_gmm('ls_gmm_small', pretrained=pretrained, **dict(model_args, **kwargs))
