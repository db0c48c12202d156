""" ConViT (gated positional self-attention, GPSA) for locality-search

Paper: `ConViT: Improving Vision Transformers with Soft Convolutional Inductive Biases`
  - https://arxiv.org/abs/2103.10697 (d'Ascoli, Touvron, Leavitt, Morcos, Biroli, Sagun, 2021)

Per head h: A = (1 - s) softmax(Q K^T / sqrt(d)) + s P, s = sigmoid(gating_param[h]),
P = softmax(v_pos . r_ij), r_ij = (dx, dy, dx^2 + dy^2) (key patch minus query patch).
Parameters, names and init follow timm's `convit.py` (its state dicts load unchanged). Differences:
* `embed_dim` is the TOTAL width (timm: per head); `ls_convit_tiny` is timm's `convit_tiny`.
* No renormalisation of A (its rows already sum to 1); P is computed once per forward in the
  parameters' dtype (even under autocast) and shared by the batch.
* `GPSA.forward` is the formula above; with `trainers.kernels` on it calls `kernels.gated_attention`
  (same values up to rounding; see that module for the backends), except with attention dropout.
* With every layer GPSA (`local_up_to_layer == depth`) there is no class token: average pooling.
* `drop_rate` is the original code's dropout (position embedding, projections, MLP).
Knobs: `local_up_to_layer`, `locality_strength`, `gate_init` (paper 1.0), `gate_lr_mult` (the
gates' learning-rate multiplier, through `param_groups()`); the paper's Table 3 ablation:
`use_local_init` (timm's name; False: GPSA starts from the random init, no convolutional one) and
`train_gating` (False: every gate frozen at lambda = 0, equal weight to content and position).
"""
import contextlib
import math
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

from timm.layers import LayerNorm, PatchEmbed, calculate_drop_path_rates, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models import register_notrace_module

from trainers import kernels
from trainers.kernels import Linear
from trainers.models._common import (
    MHSA, GridSize, PreNormBlock, _build_without_weights, _cfg, _check_bool, _check_int, _check_real, _check_vit_args,
    _fashion_mnist_cfg, _gated_param_groups, _grid_offsets, _init_vit_weights, _patch_tokens, _token_grid,
)

__all__ = ['GPSA', 'MHSA', 'Block', 'LocalityConViT']


def rel_indices(grid_size: GridSize) -> torch.Tensor:
    """Relative positions r_ij = (dx, dy, dx^2 + dy^2) of key j minus query i, shape (N, N, 3)
    (`_grid_offsets`: patches row-major, x the column, y the row); for a square grid exactly timm's
    `GPSA.get_rel_indices` (without its leading batch dim)."""
    dx, dy = _grid_offsets(grid_size)  # (N, N) each: [query, key]
    return torch.stack((dx, dy, dx ** 2 + dy ** 2), dim=-1)


_NEGLIGIBLE = 1e-30


def _softmax_without_denormals(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, with the entries below 1e-30 set to 0.

    A local positional attention on a large grid (14 x 14 at 224 px) puts most keys hundreds of
    units below the peak, so a plain softmax fills P with subnormal floats, and every op that
    reads P (the mixing, over the whole batch) then runs several times slower on x86. Rows sum to
    1, so those entries are below 1e-30 of the row: zeroing them changes no output or gradient
    beyond float32 rounding (nor float64 at the tolerances of tests/trainers/models/test_convit.py), and what is
    left, times any gate above 1e-8, stays a normal float.
    """
    P = scores.softmax(dim=-1)
    return P.masked_fill(P < _NEGLIGIBLE, 0.)


@register_notrace_module  # reason: the rel_indices cache is Python control flow
class GPSA(nn.Module):
    """Gated positional self-attention; `dim` is the total width (as in timm's GPSA).

    Parameters (names as timm): qk (dim -> 2 dim), v, proj, pos_proj (3 -> H), gating_param (H,).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            grid_size: Optional[GridSize] = None,
            use_local_init: bool = True,
            train_gating: bool = True,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'GPSA: dim={dim} is not divisible by num_heads={num_heads}; pick a multiple')
        self.num_heads = num_heads
        self.dim = dim
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.locality_strength = locality_strength
        self.gate_init = gate_init
        self.use_local_init = use_local_init
        self.train_gating = train_gating
        self.attn_drop_p = float(attn_drop)
        self.grid_size = tuple(grid_size) if grid_size is not None else None

        self.qk = Linear(dim, dim * 2, bias=qkv_bias)
        self.v = Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = Linear(dim, dim)
        self.pos_proj = nn.Linear(3, num_heads)
        self.proj_drop = nn.Dropout(proj_drop)
        self.gating_param = nn.Parameter(torch.full((num_heads,), float(gate_init)), requires_grad=train_gating)

        # r_ij for the last grid seen, (N, N, 3); non-persistent: rebuilt, never saved.
        self._rel_grid: Optional[GridSize] = None
        self.register_buffer('rel_indices', torch.zeros(0, 0, 3), persistent=False)
        # what inference reuses until the parameters change: P, the qkv weight, s P (kernels.KeptValues)
        self._frozen_cache = kernels.KeptValues()
        if self.grid_size is not None:
            self._set_rel_indices(self.grid_size)
        # standalone, initialise as LocalityConViT does (the model re-applies the same scheme)
        for linear in (self.qk, self.v, self.proj, self.pos_proj):
            trunc_normal_(linear.weight, std=.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.local_init()

    # --- relative positions ------------------------------------------------------------------
    def _set_rel_indices(self, grid: GridSize) -> None:
        w = self.qk.weight
        with torch.inference_mode(False):  # a normal tensor even when first built during inference
            self.rel_indices = rel_indices(grid).to(device=w.device, dtype=w.dtype)
        self._rel_grid = grid

    def init_non_persistent_buffers(self) -> None:
        """Recompute the cached relative positions (e.g. after materialising from the meta device)."""
        if self._rel_grid is not None:
            self._set_rel_indices(self._rel_grid)

    # --- attention maps ----------------------------------------------------------------------
    def positional_attention(self, grid: GridSize) -> torch.Tensor:
        """P = softmax(v_pos . r_ij) over keys j, (H, N, N); independent of the input, so kept
        for inference with the kernels on (`kernels.KeptValues`)."""
        if self._rel_grid != grid or self.rel_indices.device != self.qk.weight.device:
            self._set_rel_indices(grid)
        if not kernels.enabled():
            return self._positional_attention(grid)
        return self._frozen_cache.keep('pos', (self.pos_proj.weight, self.pos_proj.bias), grid,
                                       lambda: self._positional_attention(grid))

    def _positional_attention(self, grid: GridSize) -> torch.Tensor:
        N = grid[0] * grid[1]
        weight = self.pos_proj.weight
        rel = self.rel_indices.to(weight.dtype).view(N * N, 3)
        # in the parameters' dtype even under autocast: none of the casts autocast would add (8
        # per layer and training step; a model this small trains host-bound on a GPU), and the
        # scores, up to hundreds of units apart on a 14 x 14 grid, are not rounded to bf16
        device_type = weight.device.type
        # (no autocast on the meta device, say; under torch.compile the availability check is not
        # traced: it broke the graph in every GPSA layer)
        with (torch.autocast(device_type, enabled=False)
              if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
              else contextlib.nullcontext()):
            # v_pos . r_ij + bias as (H, 3) @ (3, N*N): the scores come out head-major and contiguous
            pos = torch.addmm(self.pos_proj.bias.view(-1, 1), weight, rel.t()).view(-1, N, N)
            if pos.device.type != 'cpu':  # subnormals slow down only x86 (see the helper)
                return pos.softmax(dim=-1)  # (H, N, N)
            return _softmax_without_denormals(pos)

    def get_attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """The full mixed attention A (B, H, N, N) by the explicit formula (no dropout).

        Unlike timm's `get_attention_map` (batch-averaged distances), this returns A itself; every
        row sums to 1. Materialises B x H x N x N: for analysis and tests, not for training.
        """
        B, N, C = x.shape
        q, k = self.qk(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        content = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # (B, H, N, N)
        gate = torch.sigmoid(self.gating_param).view(-1, 1, 1)  # (H, 1, 1)
        return (1. - gate) * content + gate * self.positional_attention(_token_grid(self.grid_size, N, 'GPSA'))

    # --- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim
        grid = _token_grid(self.grid_size, N, 'GPSA')
        if kernels.enabled() and not (self.training and self.attn_drop_p > 0.):
            return kernels.gated_attention(
                x, qk=self.qk, v=self.v, proj=self.proj, proj_drop=self.proj_drop, gating_param=self.gating_param,
                pos=self.positional_attention(grid), pos_params=(self.pos_proj.weight, self.pos_proj.bias),
                grid=grid, num_heads=H, scale=self.scale, kept=self._frozen_cache)
        # the paper's formula: A = (1 - s) softmax(Q K^T / sqrt(d)) + s P, dropout on A, then A V
        v = self.v(x).reshape(B, N, H, d)  # (B, N, H, d)
        attn = self.attn_drop(self.get_attention_map(x))  # (B, H, N, N)
        out = (attn @ v.transpose(1, 2)).transpose(1, 2)  # (B, N, H, d)
        return self.proj_drop(self.proj(out.reshape(B, N, C)))

    @torch.no_grad()
    def local_init(self) -> None:
        """Convolutional init (timm's): W_val = I; the first floor(sqrt(H))^2 heads centred on their
        offset of a sqrt(H) x sqrt(H) kernel; all of v_pos scaled by the locality strength. Without
        `use_local_init` only the gates are set; frozen gates (not `train_gating`) are set to 0."""
        self.gating_param.fill_(self.gate_init if self.train_gating else 0.)
        if not self.use_local_init:
            return
        self.v.weight.copy_(torch.eye(self.dim))
        kernel_size = math.isqrt(self.num_heads)
        center = (kernel_size - 1) / 2 if kernel_size % 2 == 0 else kernel_size // 2
        for h1 in range(kernel_size):
            for h2 in range(kernel_size):
                position = h1 + kernel_size * h2
                self.pos_proj.weight[position, 2] = -1
                self.pos_proj.weight[position, 1] = 2 * (h1 - center)  # dy centre
                self.pos_proj.weight[position, 0] = 2 * (h2 - center)  # dx centre
        self.pos_proj.weight.mul_(self.locality_strength)


class Block(PreNormBlock):
    """A ConViT block: GPSA (`use_gpsa`) or plain multi-head self-attention."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            use_gpsa: bool = True,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            grid_size: Optional[GridSize] = None,
            use_local_init: bool = True,
            train_gating: bool = True,
    ):
        if use_gpsa:
            attn = GPSA(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop,
                        locality_strength=locality_strength, gate_init=gate_init, grid_size=grid_size,
                        use_local_init=use_local_init, train_gating=train_gating)
        else:
            attn = MHSA(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop)
        super().__init__(dim, attn, mlp_ratio=mlp_ratio, proj_drop=proj_drop, drop_path=drop_path)
        self.use_gpsa = use_gpsa


class LocalityConViT(nn.Module):
    """ConViT: `local_up_to_layer` GPSA blocks, then the class token, then plain MHSA blocks.

    `embed_dim` is the total width (timm's ConVit: per head). `local_up_to_layer=0` is a DeiT.
    """
    family = 'convit'

    def __init__(
            self,
            *,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 16,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            local_up_to_layer: int = 10,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            gate_lr_mult: float = 1.,
            use_pos_embed: bool = True,
            use_local_init: bool = True,
            train_gating: bool = True,
    ):
        super().__init__()
        img_hw = _check_vit_args(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, use_pos_embed=use_pos_embed, width_hint=' (timm ConViT takes it per head)')
        _check_int('local_up_to_layer', local_up_to_layer, 0)
        _check_real('locality_strength', locality_strength, 0.)
        _check_real('gate_init', gate_init, -math.inf)
        _check_real('gate_lr_mult', gate_lr_mult, 0.)
        _check_bool('use_local_init', use_local_init)
        _check_bool('train_gating', train_gating)
        if local_up_to_layer > depth:
            raise ValueError(
                f'local_up_to_layer={local_up_to_layer} exceeds depth={depth}; it counts GPSA layers, '
                f'use a value in [0, {depth}] (0 = DeiT)')

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.local_up_to_layer = local_up_to_layer
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.locality_strength = locality_strength
        self.gate_init = gate_init
        self.gate_lr_mult = gate_lr_mult
        self.use_pos_embed = use_pos_embed
        self.use_local_init = use_local_init
        self.train_gating = train_gating

        self.patch_embed = PatchEmbed(img_size=img_hw, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.grid_size: GridSize = tuple(self.patch_embed.grid_size)
        self.num_patches = num_patches = self.patch_embed.num_patches

        # the class token joins after the last GPSA layer; with no SA layer after it, there is none
        if local_up_to_layer < depth:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            self.num_prefix_tokens = 1
            self.global_pool = 'token'
        else:
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.global_pool = 'avg'
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
                use_gpsa=i < local_up_to_layer,
                locality_strength=locality_strength,
                gate_init=gate_init,
                grid_size=self.grid_size,
                use_local_init=use_local_init,
                train_gating=train_gating,
            ) for i in range(depth)])
        self.norm = LayerNorm(embed_dim)
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f'blocks.{i}') for i in range(depth)]
        self.head = Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)
        self.apply(_init_vit_weights)
        for m in self.modules():
            if isinstance(m, GPSA):
                m.local_init()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'pos_embed', 'cls_token'}

    @torch.no_grad()
    def mechanism_metrics(self, probe: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """(trainers.hooks.ReportsMechanisms) Each GPSA head's gate sigma(lambda), `gate.BLOCK.HEAD`:
        the share of its attention paid to position; the paper's Fig. 6 follows its mean over the
        heads falling in training, to near 0 in the later layers.

        With ``probe`` images (B, C, H, W), also each head's nonlocality on them,
        `nonlocality.BLOCK.HEAD` (the paper's Eq. 8, its Fig. 5: averaged over the images and the
        query patches, the distance in patches to each key weighted by its attention). A plain
        block after the class token is measured among the patches (its class-token column left
        out, each row renormalised): the class token has no position."""
        metrics = {f'gate.{i}.{h}': float(g) for i, blk in enumerate(self.blocks) if blk.use_gpsa
                   for h, g in enumerate(torch.sigmoid(blk.attn.gating_param.float()).tolist())}
        if probe is not None:
            metrics.update(self._nonlocality(probe))
        return metrics

    def _nonlocality(self, images: torch.Tensor) -> Dict[str, float]:
        inputs: Dict[int, torch.Tensor] = {}
        hooks = [blk.attn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].float()))
                 for i, blk in enumerate(self.blocks)]
        was_training = self.training
        try:
            self.eval()
            self.forward_features(images)  # whichever path is selected: only the blocks' inputs are kept
        finally:
            self.train(was_training)
            for hook in hooks:
                hook.remove()
        dx, dy = _grid_offsets(self.grid_size)
        distance = (dx ** 2 + dy ** 2).sqrt().to(images.device)  # (N, N): [query, key], in patches
        metrics = {}
        for i, blk in enumerate(self.blocks):
            x = inputs[i]  # (B, T, C): the block's attention input (after its norm)
            if blk.use_gpsa:
                attn = blk.attn.get_attention_map(x)  # (B, H, N, N)
            else:
                attn = _plain_attention_map(blk.attn, x)  # (B, H, T, T)
                prefix = attn.shape[-1] - distance.shape[0]  # the class token, where it is there
                attn = attn[..., prefix:, prefix:]
                attn = attn / attn.sum(dim=-1, keepdim=True)
            per_head = (attn * distance).sum(dim=-1).mean(dim=(0, 2))  # (H,)
            metrics.update({f'nonlocality.{i}.{h}': float(d) for h, d in enumerate(per_head.tolist())})
        return metrics

    def param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        """AdamW parameter groups, each {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale).

        Gating parameters: lr_scale = gate_lr_mult, no weight decay. Biases, norms, pos_embed and
        cls_token: no weight decay. Everything else: `weight_decay`. Frozen parameters are left out;
        empty groups are dropped.
        """
        return _gated_param_groups(self, weight_decay, gate_lr_mult=self.gate_lr_mult,
                                   no_decay_names=self.no_weight_decay())

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
            if global_pool not in ('token', 'avg') or (global_pool == 'token' and self.cls_token is None):
                raise ValueError(f"global_pool={global_pool!r}: use 'avg'"
                                 + ('' if self.cls_token is None else " or 'token'"))
            self.global_pool = global_pool
        self.num_classes = num_classes
        w = self.norm.weight
        self.head = (Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
                     if num_classes > 0 else nn.Identity())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = _patch_tokens(self.patch_embed, x)  # (B, N, C)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x = self.pos_drop(x)
        for i, blk in enumerate(self.blocks):
            if i == self.local_up_to_layer and self.cls_token is not None:
                x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)  # (B, N + 1, C)
            x = blk(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.global_pool == 'token' else x[:, self.num_prefix_tokens:].mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _plain_attention_map(attn: MHSA, x: torch.Tensor) -> torch.Tensor:
    """A plain MHSA block's attention softmax(Q K^T / sqrt(d)) (B, H, T, T), by the explicit formula."""
    B, T, C = x.shape
    q, k, _ = attn.qkv(x).reshape(B, T, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return ((q @ k.transpose(-2, -1)) * attn.head_dim ** -0.5).softmax(dim=-1)


def _create_ls_convit(variant: str, pretrained: bool = False, **kwargs) -> LocalityConViT:
    hint = ' (timm convit_* weights load directly, the keys are the same)'
    return _build_without_weights(LocalityConViT, variant, pretrained, weights_hint=hint, **kwargs)


default_cfgs = generate_default_cfgs({
    'ls_convit_nano': _fashion_mnist_cfg(),
    'ls_convit_micro': _fashion_mnist_cfg(),
    'ls_convit_tiny': _cfg(),
    'ls_convit_small': _cfg(),
    'ls_convit_base': _cfg(),
})


@register_model
def ls_convit_nano(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """Test-sized: 28x28 grayscale, 7x7 patches of 4, width 32, 4 heads, 1 GPSA + 1 SA layer."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                      num_heads=4, local_up_to_layer=1, locality_strength=1.0)
    return _create_ls_convit('ls_convit_nano', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_micro(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """CPU default for Fashion-MNIST: 28x28 grayscale, 7x7 patches of 4, width 96, 4 heads, 3 GPSA + 5 SA
    (0.9 M parameters; sized for a small CPU, see benchmarks/models.py)."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=8,
                      num_heads=4, local_up_to_layer=3, locality_strength=1.0)
    return _create_ls_convit('ls_convit_micro', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_tiny(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_tiny (ConViT-Ti): width 192, 4 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=192, depth=12, num_heads=4, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_small(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_small (ConViT-S): width 432, 9 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=432, depth=12, num_heads=9, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_base(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_base (ConViT-B): width 768, 16 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=768, depth=12, num_heads=16, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_base', pretrained=pretrained, **dict(model_args, **kwargs))
