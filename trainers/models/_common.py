"""What every model family file shares: argument checks, timm's default-config helpers, the plain
multi-head self-attention (`MHSA`) the families use after their locality layers, and the blocks:
`PreNormBlock` around a family's attention, its `Mlp` and norms (`PreNorm`, `add_and_norm`,
`add_residual`)."""
import math
from numbers import Integral, Real
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from timm.layers import DropPath
from timm.layers import Mlp as _TimmMlp
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg
from timm.models import register_notrace_function, register_notrace_module

from trainers import hooks, kernels
from trainers.kernels import LayerNorm as PreNorm
from trainers.kernels import Linear, add_and_norm, add_residual, has_hooks, linear, records_autograd

__all__ = [
    'IMAGENET_DEFAULT_MEAN', 'IMAGENET_DEFAULT_STD', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD', 'GridSize',
    '_pair', '_check_int', '_check_real', '_check_bool', '_check_vit_args', '_init_vit_weights', '_cfg',
    '_fashion_mnist_cfg', '_build_without_weights',
    '_gated_param_groups', '_grid_offsets', '_patch_tokens', '_token_grid', 'MHSA', 'Mlp', 'PreNorm', 'PreNormBlock',
]

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)
GridSize = Tuple[int, int]


def _patch_tokens(patch_embed: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm `PatchEmbed`'s tokens (B, N, C), laid out contiguously.

    PatchEmbed returns the conv output flattened and transposed: a view of a (B, C, N) tensor.
    Element-wise ops keep their input's layout, so the position-embedding add and every residual
    add after it would carry that layout through the blocks, and each LayerNorm and linear would
    copy its input first. One copy here.
    """
    return patch_embed(x).contiguous()


def _grid_offsets(grid_size: GridSize) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dy), each (N, N) float32 indexed [query i, key j]: key patch j's column and row minus
    query patch i's. Patches are numbered row-major (n = row * W + col), x is the column and y the
    row. Exact integers, so float32 is exact up to huge grids."""
    h, w = grid_size
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)  # (N,) row of patch n
    cols = torch.arange(w, dtype=torch.float32).repeat(h)  # (N,) column of patch n
    return cols[None, :] - cols[:, None], rows[None, :] - rows[:, None]


def _token_grid(grid_size: Optional[GridSize], num_patches: int, layer: str) -> GridSize:
    """The patch grid of `num_patches` tokens: `grid_size` where it holds that many, else a square
    one; a ValueError naming the `layer` class where the tokens make none."""
    if grid_size is not None and grid_size[0] * grid_size[1] == num_patches:
        return grid_size
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(
            f'{layer} got {num_patches} tokens, which is not a square patch grid; pass grid_size=(rows, cols) '
            f'to {layer}, or feed it patch tokens only (no class token)')
    return side, side


def _pair(name: str, value: Any) -> Tuple[int, int]:
    if isinstance(value, Integral) and not isinstance(value, bool):
        return int(value), int(value)
    if isinstance(value, Sequence) and len(value) == 2 and all(
            isinstance(v, Integral) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f'{name}={value!r}: expected a positive int or an (height, width) pair of ints')


MAX_DEPTH = 1024
MAX_WIDTH = 2**16
MAX_MLP_RATIO = 64.0


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low or (high is not None and value > high):
        raise ValueError(f'{name}={value!r}: expected an int >= {low}' + ('' if high is None else f' and <= {high}'))


def _check_real(name: str, value: Any, low: float, high: Optional[float] = None, high_open: bool = True) -> None:
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bound = '' if high is None else f' and {"<" if high_open else "<="} {high}'
        raise ValueError(f'{name}={value!r}: expected a finite number >= {low}{bound}')


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f'{name}={value!r}: expected True or False')


def _check_vit_args(*, img_size: Any, patch_size: Any, in_chans: Any, num_classes: Any, embed_dim: Any, depth: Any,
                    num_heads: Any, mlp_ratio: Any, qkv_bias: Any, drop_rate: Any, drop_path_rate: Any,
                    use_pos_embed: Any, width_hint: str = '') -> GridSize:
    """Check the arguments every ViT family takes; return `img_size` as (height, width).

    `width_hint` follows "embed_dim is the TOTAL width" in the error for a width that does not
    split into heads (ConViT's: timm takes it per head).
    """
    img_hw = _pair('img_size', img_size)
    _check_int('patch_size', patch_size, 1)
    _check_int('in_chans', in_chans, 1)
    _check_int('num_classes', num_classes, 0)
    # Upper bounds far above any trainable size: a spec's check builds the model on the meta
    # device, where a depth of 10**9 would loop for hours rather than fail.
    _check_int('embed_dim', embed_dim, 1, MAX_WIDTH)
    _check_int('depth', depth, 1, MAX_DEPTH)
    _check_int('num_heads', num_heads, 1, MAX_WIDTH)
    _check_real('mlp_ratio', mlp_ratio, 0., MAX_MLP_RATIO, high_open=False)
    _check_real('drop_rate', drop_rate, 0., 1.)
    _check_real('drop_path_rate', drop_path_rate, 0., 1.)
    _check_bool('qkv_bias', qkv_bias)
    _check_bool('use_pos_embed', use_pos_embed)
    if min(img_hw) < 1 or any(s % patch_size for s in img_hw):
        raise ValueError(
            f'img_size={img_size!r} is not a multiple of patch_size={patch_size}; pick a patch_size that '
            f'divides the image size (e.g. {math.gcd(*img_hw)}) or resize the images')
    if embed_dim % num_heads:
        raise ValueError(
            f'embed_dim={embed_dim} is not divisible by num_heads={num_heads}; embed_dim is the TOTAL width'
            f'{width_hint}: use a multiple of num_heads, '
            f'e.g. embed_dim={num_heads * max(1, round(embed_dim / num_heads))}')
    if int(mlp_ratio * embed_dim) < 1:
        raise ValueError(f'mlp_ratio={mlp_ratio} gives an empty MLP for embed_dim={embed_dim}; raise mlp_ratio')
    return img_hw


def _init_vit_weights(m: nn.Module) -> None:
    """timm's ViT init, for `model.apply`: linears truncated-normal (std .02) with zero biases,
    LayerNorms the identity. Other modules keep their own init."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.constant_(m.bias, 0)
    elif isinstance(m, nn.LayerNorm):
        nn.init.constant_(m.bias, 0)
        nn.init.constant_(m.weight, 1.0)


def _cfg(**kwargs) -> Dict[str, Any]:
    return {
        'url': '',
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
        'crop_pct': .875, 'interpolation': 'bicubic', 'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head',
        **kwargs
    }


def _fashion_mnist_cfg(**kwargs) -> Dict[str, Any]:
    return _cfg(num_classes=10, input_size=(1, 28, 28), crop_pct=1.0, interpolation='bilinear',
                mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD, **kwargs)


def _build_without_weights(model_cls: type, variant: str, pretrained: bool, weights_hint: str = '', **kwargs: Any):
    """timm's build_model_with_cfg for families with no downloadable weights and no features_only."""
    if kwargs.pop('features_only', False):
        raise RuntimeError(f'{variant}: features_only is not supported; use forward_features() instead')
    if pretrained:
        raise ValueError(f'{variant} has no pretrained weights; create it with pretrained=False and load a '
                         f'state dict{weights_hint}')
    return build_model_with_cfg(model_cls, variant, pretrained, **kwargs)


def _gated_param_groups(model: nn.Module, weight_decay: float, *, gate_lr_mult: float,
                        no_decay_names: Set[str]) -> List[Dict[str, Any]]:
    """`trainers.hooks.param_groups` for models with GPSA gates (names ending in 'gating_param'):
    lr_scale = gate_lr_mult, no weight decay; `no_decay_names` without weight decay either."""
    return hooks.param_groups(model, weight_decay, no_decay=lambda name, p: name in no_decay_names,
                         special=lambda name, p: name.endswith('gating_param'), special_lr_scale=gate_lr_mult)


class MHSA(nn.Module):
    """Plain multi-head self-attention (parameter names as timm's `Attention`: qkv, proj)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop_p = float(attn_drop)
        self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        dropout_p = self.attn_drop_p if self.training else 0.
        if kernels.enabled():
            x = kernels.plain_attention(qkv, self.head_dim ** -0.5, dropout_p=dropout_p)  # (B, H, N, d)
        else:
            q, k, v = qkv.unbind(0)
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


@register_notrace_module  # reason: the in-place branch reads requires_grad, Python control flow
class Mlp(_TimmMlp):
    """timm's `Mlp` (fc1, GELU, fc2; same parameter names) with the GELU applied in place on fc1's
    output wherever autograd does not record it (inference, no_grad, frozen layers), and fc1 and fc2
    as `Linear` (float32 on oneDNN where MKL is the slower, `_linear`).

    That output is a fresh (B, N, hidden) tensor nothing else holds, so overwriting it is safe and
    bit for bit the same, and saves an allocation of the block's hidden width per token (which
    glibc's default thresholds hand back to the OS and fault in again on every call; see
    `trainers._malloc`). With autograd recording, the GELU's backward needs its input: out of place.
    With the kernels on, in inference fc1 and the GELU are one op (`kernels.linear(..., gelu=True)`).
    """

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.):
        super().__init__(in_features=in_features, hidden_features=hidden_features, act_layer=nn.GELU, drop=drop)
        # timm built them as nn.Linear: recast, not rebuilt (a second init would draw from the seeded
        # random stream and change every later layer's initial weights)
        for fc in (self.fc1, self.fc2):
            fc.__class__ = Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled() and self._fc1_takes_gelu(x):
            x = linear(x, self.fc1.weight, self.fc1.bias, gelu=True)  # (B, N, hidden)
        else:
            x = self.fc1(x)  # (B, N, hidden)
            x = self.act(x) if x.requires_grad else torch.ops.aten.gelu_(x, approximate=self.act.approximate)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))

    def _fc1_takes_gelu(self, x: torch.Tensor) -> bool:
        """Whether fc1 and the GELU run as one `linear(..., gelu=True)`: autograd not recording (else
        the GELU module runs, as in timm), the exact GELU (the one oneDNN fuses) and no hooks on fc1
        (they would see the GELU's output as fc1's)."""
        fc1 = self.fc1
        return (type(self.act) is nn.GELU and self.act.approximate == 'none' and type(fc1) is Linear
                and not records_autograd(x, fc1.weight, fc1.bias)
                and not has_hooks(fc1))


class PreNormBlock(nn.Module):
    """A pre-norm transformer block around a family's attention: x + attn(norm1(x)), then
    x + mlp(norm2(x)), each residual add fused with the norm after it where it can be
    (`add_and_norm`, `add_residual`). Submodules named as in timm's ViT and ConViT blocks (norm1,
    attn, drop_path, norm2, mlp: timm's ConViT checkpoints load into ls_convit). Each family's
    `Block` builds its attention and hands it here."""

    def __init__(self, dim: int, attn: nn.Module, *, mlp_ratio: float = 4., proj_drop: float = 0.,
                 drop_path: float = 0.):
        super().__init__()
        self.norm1 = PreNorm(dim)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = PreNorm(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), drop=proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.enabled():  # each residual add fused with the norm after it where it can be
            x, h = add_and_norm(x, self.drop_path(self.attn(self.norm1(x))), self.norm2)  # x + attn, norm2 of it
            return add_residual(x, self.drop_path(self.mlp(h)), self.norm2)  # x + mlp, in place where it can be
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


