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
from timm.layers import LayerNorm as _TimmLayerNorm
from timm.layers import Mlp as _TimmMlp
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg
from timm.models._features_fx import register_notrace_function, register_notrace_module

from trainers.models import _attention_kernel
from trainers.models._attention_core import attention, use_explicit_core
from trainers.models._linear import Linear, cpu_autocast_to_bf16, linear, records_autograd

__all__ = [
    'IMAGENET_DEFAULT_MEAN', 'IMAGENET_DEFAULT_STD', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD', 'GridSize',
    '_pair', '_check_int', '_check_real', '_check_bool', '_check_vit_args', '_init_vit_weights', '_cfg',
    '_fashion_mnist_cfg', '_build_without_weights',
    '_gated_param_groups', '_param_groups', '_patch_tokens', 'MHSA', 'Mlp', 'PreNorm', 'PreNormBlock',
    'USE_NORM_KERNEL', 'add_and_norm', 'add_residual', 'has_hooks', 'scaled_dot_product_attention',
]

# False: PreNorm and add_and_norm run on torch ops only (the benchmarks' side-by-side rows)
USE_NORM_KERNEL = True

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
    copy its input first (about 9% of ls_convit_tiny's CPU inference at 224 px). One copy here.
    """
    return patch_embed(x).contiguous()


def _pair(name: str, value: Any) -> Tuple[int, int]:
    if isinstance(value, Integral) and not isinstance(value, bool):
        return int(value), int(value)
    if isinstance(value, Sequence) and len(value) == 2 and all(
            isinstance(v, Integral) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f'{name}={value!r}: expected a positive int or an (height, width) pair of ints')


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ValueError(f'{name}={value!r}: expected an int >= {low}')


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
    _check_int('embed_dim', embed_dim, 1)
    _check_int('depth', depth, 1)
    _check_int('num_heads', num_heads, 1)
    _check_real('mlp_ratio', mlp_ratio, 0., None)
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


def _param_groups(model: nn.Module, weight_decay: float, *, no_decay: Callable[[str, nn.Parameter], bool],
                  special: Callable[[str, nn.Parameter], bool] = lambda name, p: False,
                  special_weight_decay: float = 0., special_lr_scale: float = 1.) -> List[Dict[str, Any]]:
    """AdamW groups {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale), the rule
    every family's `param_groups` applies with its own parameters picked out:
    `special(name, p)` (a family's gates or masks): `special_weight_decay`, `special_lr_scale`;
    biases, norms and `no_decay(name, p)`: no weight decay; everything else: `weight_decay`.
    lr_scale 1.0 but for the special group. Frozen parameters are left out; empty groups dropped.
    """
    _check_real('weight_decay', weight_decay, 0.)
    decay, no_decay_params, special_params = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if special(name, p):
            special_params.append(p)
        elif p.ndim <= 1 or no_decay(name, p):
            no_decay_params.append(p)
        else:
            decay.append(p)
    groups = [
        dict(params=decay, weight_decay=float(weight_decay), lr_scale=1.0),
        dict(params=no_decay_params, weight_decay=0.0, lr_scale=1.0),
        dict(params=special_params, weight_decay=float(special_weight_decay), lr_scale=float(special_lr_scale)),
    ]
    return [g for g in groups if g['params']]


def _gated_param_groups(model: nn.Module, weight_decay: float, *, gate_lr_mult: float,
                        no_decay_names: Set[str]) -> List[Dict[str, Any]]:
    """`_param_groups` for models with GPSA gates (names ending in 'gating_param'): lr_scale =
    gate_lr_mult, no weight decay; `no_decay_names` without weight decay either."""
    return _param_groups(model, weight_decay, no_decay=lambda name, p: name in no_decay_names,
                         special=lambda name, p: name.endswith('gating_param'), special_lr_scale=gate_lr_mult)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 dropout_p: float = 0.) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, computed in float32 when a CPU backward in bf16/fp16 follows.

    q, k, v: (B, H, N, d). torch's CPU kernel for bf16/fp16 is fast forward only: with autograd,
    fwd + bwd of a micro model's attention layer (B 256, 50 tokens, 4 heads of 24, projections
    included) took 105 ms in bf16 against 29 ms in float32, and 25 ms with the core cast up to
    float32 (autocast off) and its output cast back, which is what this does. Inference keeps the
    low-precision kernel, which is the faster one there (6.0 vs 6.6 ms). (`MHSA` runs neither where
    the CPU multiplies bf16 in hardware: `_attention_core` is quicker still there.)
    """
    if (q.device.type == 'cpu' and q.dtype in _LOW_PRECISION and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        with torch.autocast('cpu', enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


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
        if use_explicit_core(qkv) and not (self.training and self.attn_drop_p > 0.):
            # CPU bf16 (autocast on bf16 hardware), or float32 on the float32 kernel: the explicit
            # core beats the fused kernel forward and backward (`_attention_core`)
            x = attention(qkv, self.head_dim ** -0.5)  # (B, H, N, d)
        else:
            q, k, v = qkv.unbind(0)
            x = scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop_p if self.training else 0.)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


@register_notrace_module  # reason: the in-place branch reads requires_grad, Python control flow
class Mlp(_TimmMlp):
    """timm's `Mlp` (fc1, GELU, fc2; same parameter names) with the GELU applied in place on fc1's
    output wherever autograd does not record it (inference, no_grad, frozen layers), and fc1 and fc2
    as `Linear` (float32 on oneDNN where MKL is the slower, `_linear`).

    That output is a fresh (B, N, hidden) tensor nothing else holds, so overwriting it is safe and
    bit for bit the same; a new tensor for the GELU's result costs an allocation of the block's
    hidden width per token, which glibc's default thresholds hand back to the OS and fault in again
    on every call: there about 4% of ls_convit_tiny's CPU inference at 224 px, batch 8 (37.6 vs 39.1
    img/s, 39.4 with no activation at all; 2-core AVX2 EPYC). In a process that keeps freed memory
    (`trainers._malloc`, as trials and the benchmarks run) the gain is within noise (38.3 vs 38.3,
    41.9 vs 41.1 img/s). With autograd recording, the GELU's backward needs its input: out of place.
    In bf16 inference fc1 and the GELU are one oneDNN op (`_linear`), the GELU on the float32 sums.
    """

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.):
        super().__init__(in_features=in_features, hidden_features=hidden_features, act_layer=nn.GELU, drop=drop)
        # timm built them as nn.Linear: recast, not rebuilt (a second init would draw from the seeded
        # random stream and change every later layer's initial weights)
        for fc in (self.fc1, self.fc2):
            fc.__class__ = Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fc1_takes_gelu(x):
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
        x, h = add_and_norm(x, self.drop_path(self.attn(self.norm1(x))), self.norm2)  # x + attn, norm2 of it
        return add_residual(x, self.drop_path(self.mlp(h)), self.norm2)  # x + mlp, in place where it can be


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs forward hooks (its own or global ones): a fused path that
    bypasses the call must not, or the hooks would miss it."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


@register_notrace_module  # reason: branches on dtype, device and autocast (timm's FX feature extraction)
class PreNorm(_TimmLayerNorm):
    """A block's norm before its attention or MLP: timm's `LayerNorm` (same parameters, state dict
    and output), run in CPU inference (autograd not recording) as one pass over the tokens on the
    kernel libraries' `layer_norm` (`csrc/layer_norm_op.h`), where torch runs layer_norm (and, in
    bf16, then the cast):
      - float32 (no autocast): the same values but for the last bits (the float32 sums' order);
        2-core Zen 5 EPYC, ls_convit_tiny's tokens (8 x 197 x 192) 26 vs 57 us, ls_convit_micro's
        batch (256 x 50 x 96) 108 vs 275 us; the AVX2 build there 40 and 150 us.
      - CPU autocast to bf16: returns the normalised tokens in bf16, which is what autocast casts
        them to at the linear that every such norm feeds (the qkv projection, fc1), bit for bit but
        for the last bit of about 1 in 30,000; 34 vs 74 us, 152 vs 335 us.
    Not for a model's last norm, whose float32 output the caller sees in the precision it asked for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _norm_kernel(x, self)
        if ops is None:
            return super().forward(x)
        return ops.layer_norm(x, None, self.weight, self.bias, self.eps)[0]


@register_notrace_function  # reason: as PreNorm's
def add_and_norm(x: torch.Tensor, branch: torch.Tensor, norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x + branch, norm(x + branch)): a block's residual add and the next norm. Where `norm` is a
    `PreNorm` that runs on a kernel, both in one pass (the sum in float32, exactly x + branch; the
    norm as `PreNorm` returns it). 2-core Zen 5 EPYC, 8 x 197 x 192 tokens: float32 34 vs 76 us,
    with a bf16 branch in bf16 inference 43 vs 106 us; 256 x 50 x 96: 148 vs 358, 249 vs 477 us."""
    ops = _norm_kernel(x, norm, branch)
    if ops is None:
        x = x + branch
        return x, norm(x)
    normed, x = ops.layer_norm(x, branch, norm.weight, norm.bias, norm.eps)
    return x, normed


@register_notrace_function  # reason: branches on autograd and hooks, as add_and_norm
def add_residual(x: torch.Tensor, branch: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """x + branch: a block's last residual add, where x is the sum `add_and_norm(..., norm)` returned
    (no one else's tensor). In place on x where nothing can still hold it: autograd not recording
    (norm's backward would need it), no hooks on `norm` (torch's path hands them x), and the sum
    keeping x's dtype and shape. Then the bf16 branch of bf16 inference is converted and added in
    one pass, where x + branch casts it to a new tensor first and adds into another. 2-core Zen 5
    EPYC, in-process, alternating: ls_convit_micro's inference (batch 256) 1.013-1.029x in bf16,
    1.015x in float32; ls_convit_tiny's (batch 8) 1.011x in bf16, 0.991x in float32 (noise)."""
    if (records_autograd(x, branch) or has_hooks(norm) or branch.shape != x.shape
            or torch.promote_types(x.dtype, branch.dtype) != x.dtype):
        return x + branch
    return x.add_(branch)


def _norm_kernel(x: torch.Tensor, norm: nn.Module, branch: Optional[torch.Tensor] = None) -> Optional[Any]:
    """The kernel library whose `layer_norm` runs `norm(x)` (with a branch: `norm(x + branch)` and
    the sum; see `PreNorm`), else None: the bf16 one under CPU autocast to bf16, the float32 one
    without autocast, where that library is built; a branch it reads as it is (contiguous, x's
    shape, float32 or the library's dtype)."""
    if not (USE_NORM_KERNEL and type(norm) is PreNorm and x.device.type == 'cpu' and x.dtype == torch.float32
            and x.is_contiguous() and norm.normalized_shape == x.shape[-1:] and norm.weight is not None
            and norm.bias is not None and norm.weight.dtype == norm.bias.dtype == torch.float32
            and norm.weight.is_contiguous() and norm.bias.is_contiguous()
            and (branch is None or branch.is_contiguous() and branch.shape == x.shape)
            and not records_autograd(x, norm.weight, norm.bias, branch) and not torch.compiler.is_compiling()
            and not has_hooks(norm)):
        return None
    if torch.is_autocast_enabled('cpu'):
        dtype = torch.bfloat16 if cpu_autocast_to_bf16() else None
    else:
        dtype = torch.float32
    if dtype is None or branch is not None and branch.dtype not in (torch.float32, dtype):
        return None
    return _attention_kernel.kernels(dtype)
