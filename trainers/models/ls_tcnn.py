""" Transformed CNNs: a ResNet whose last-stage 3x3 convolutions become GPSA layers.

Paper: `Transformed CNNs: recasting pre-trained convolutional layers with self-attention`
    - https://arxiv.org/abs/2106.05795  (d'Ascoli, Sagun, Biroli, Morcos, 2021)

No reference code was published; the equivalence tests in tests/trainers/models/test_tcnn.py are the reference.
Each converted k x k conv becomes a `ReparamGPSA` with k*k heads, one per filter tap, whose gated
positional attention reproduces the convolution (paper Sec. 2, Eq. 4-7; details in `ReparamGPSA`).
What differs from the paper: alpha is a standard softplus (the paper's footnote has the sign the
other way), the padding is an explicit ring of zero tokens, and the last stage's strided conv stays
a convolution (making it stride 1, as the paper does, changes the function and quadruples the cost).

When to convert is a knob: the trainer asks `reparam_epoch_for(total_epochs)` and calls
`reparametrise()` before that epoch (`reparam_epoch`, or `reparam_fraction` of the trial's epochs;
0 = a hybrid from scratch). Knobs: `reparam_optimizer` ('fresh' AdamW after the conversion, the
paper's fine-tuning, or 'keep', its starred rows), `gate_lr_mult` (paper: 0.1 vs 1e-4 for the rest),
`pretrained_path` (a local timm ResNet checkpoint, `torch.load(weights_only=True)`).
Variants: `ls_tcnn_resnet18/26/50` are timm's resnet18/26/50 (same keys); the `_s` variants swap
the 7x7/2 stem and max-pool for a 3x3/1 conv, for 28-32 px images.
"""
import logging
import math
from numbers import Integral
from typing import Any, Dict, List, Optional, Set

import torch
import torch.nn.functional as F
from torch import nn

from timm.layers import trunc_normal_
from timm.models import adapt_input_conv, generate_default_cfgs, register_model
from timm.models import load_state_dict
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from trainers.hooks import ConvertsDuringTraining

from ._common import _build_without_weights, _cfg, _check_real, _fashion_mnist_cfg, _gated_param_groups
from trainers.kernels import Linear, linear

__all__ = ['TransformedResNet', 'ReparamGPSA', 'inverse_softplus']

_logger = logging.getLogger(__name__)

ALPHA_BETA = 5.0  # softplus sharpness for the locality strength (paper footnote 1)


def inverse_softplus(alpha: float, beta: float = ALPHA_BETA) -> float:
    """The raw value whose softplus(., beta) is `alpha` (> 0), stable for large alpha."""
    if not alpha > 0:
        raise ValueError(f'alpha={alpha!r}: the locality strength must be > 0')
    # log(exp(b a) - 1) / b = a + log(1 - exp(-b a)) / b
    return alpha + math.log(-math.expm1(-beta * alpha)) / beta


class ReparamGPSA(nn.Module):
    """A k x k stride-1 convolution recast as gated positional self-attention with k*k heads.

    Input and output are feature maps (B, C, H, W), like the conv it replaces. Build it with
    `from_conv()`; a fresh one (random filter) is only useful for shape tests.

    The reparametrisation (paper Sec. 2, Eq. 4-7), for a k x k conv with weight W (C_out, C_in, k, k):
    * N_h = k*k heads, one per filter tap h = (ky, kx) in row-major order, centred on the tap's
      offset Delta^h = (ky - k//2, kx - k//2) relative to the query pixel.
    * Value projection W_val = I (C_in x C_in), shared by all heads (value dim = input channels).
    * Output projection of head h = the filter tap W[:, :, ky, kx]. The layer keeps the conv's weight
      Parameter itself, so an optimizer's state for it carries over (the paper's starred rows).
    * Positional attention of head h: softmax_j(-alpha_h * |delta_ij - Delta^h|^2), which is
      softmax(v_pos^h . r_ij) of Eq. 4 with v_pos^h = -alpha_h (1, -2 Delta^h) (the alpha_h |Delta^h|^2
      term is constant over j). Three learnable numbers per head: Delta^h (2) and alpha_h.
    * alpha_h = softplus(alpha_raw_h, beta=5) = log(1 + exp(5 alpha_raw_h)) / 5, so it stays
      positive. (The paper's footnote writes exp(-beta alpha_raw): with that sign alpha would fall
      as alpha_raw grows; we use the usual softplus, which is what "rectified" means.)
    * Gate (Eq. 7): A^h = (1 - sigmoid(lambda_h)) softmax(Q K^T / sqrt(d)) + sigmoid(lambda_h) P^h.
      W_qry, W_key: C_in x (N_h * d) with d = C_in // N_h, so the layer adds at most 3 C_in^2
      weights (query, key, value) plus 4 numbers per head over the conv (the paper's bound).
      Query/key start as small random matrices (std 0.02, as in ConViT), not zero: with both zero
      neither gets a gradient.
    * Explicit zero padding: the feature map gets a ring of k//2 zero tokens before attention. The
      queries are the H x W real pixels; the keys are all (H + 2p) x (W + 2p) tokens. The padding
      tokens' values are 0 (W_val has no bias), so with alpha and lambda large the layer computes
      exactly the zero-padded convolution, border pixels included. (`ReparamGPSA.forward` computes
      this without materialising the ring's keys and values, which are all zero.) At alpha = 1, lambda = 1 (the
      paper's init) it does not: each head spreads its attention over neighbouring pixels and 27%
      of it goes to content; tests/trainers/models/test_tcnn.py measures how far the logits move.

    What is converted: every non-strided, non-dilated, ungrouped k x k conv (k odd, k > 1, padding
    k//2) of the last stage (`layer4`). The first block's strided conv stays a convolution: a
    stride-2 conv has no attention counterpart with one output per query pixel, and making it
    stride 1 (as the paper does, after BoTNet) changes the function and quadruples the stage's cost,
    which defeats "the converted network reproduces the CNN". So ResNet-18 converts 3 convs
    (BasicBlock: block0.conv2, block1.conv1, block1.conv2) and ResNet-26/50 convert 1/2 (Bottleneck:
    the conv2 of every block after the first).
    """

    def __init__(
            self,
            in_chans: int,
            out_chans: int,
            kernel_size: int = 3,
            alpha_init: float = 1.0,
            gate_init: float = 1.0,
            bias: bool = False,
    ) -> None:
        super().__init__()
        if kernel_size < 3 or kernel_size % 2 == 0:
            raise ValueError(f'kernel_size={kernel_size}: expected an odd size >= 3')
        self.in_chans, self.out_chans, self.kernel_size = in_chans, out_chans, kernel_size
        self.num_heads = kernel_size * kernel_size
        self.pad = kernel_size // 2
        self.head_dim = max(1, in_chans // self.num_heads)
        self.scale = self.head_dim ** -0.5
        self.qk = Linear(in_chans, 2 * self.num_heads * self.head_dim, bias=False)  # W_qry | W_key
        self.v = Linear(in_chans, in_chans, bias=False)  # W_val, shared by the heads
        # W_out, kept in the conv's layout (C_out, C_in, k, k): tap (ky, kx) is head ky*k + kx
        self.weight = nn.Parameter(torch.empty(out_chans, in_chans, kernel_size, kernel_size))
        self.register_parameter('bias', nn.Parameter(torch.zeros(out_chans)) if bias else None)  # a conv's bias
        taps = torch.arange(kernel_size) - self.pad
        centers = torch.stack(torch.meshgrid(taps, taps, indexing='ij'), dim=-1).reshape(-1, 2)
        self.centers = nn.Parameter(centers.float())  # Delta^h (dy, dx), (N_h, 2)
        self.alpha_raw = nn.Parameter(torch.full((self.num_heads,), inverse_softplus(alpha_init)))
        self.gating_param = nn.Parameter(torch.full((self.num_heads,), float(gate_init)))
        trunc_normal_(self.qk.weight, std=.02)
        with torch.no_grad():
            self.v.weight.copy_(torch.eye(in_chans))
        nn.init.kaiming_normal_(self.weight, mode='fan_out', nonlinearity='relu')

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, alpha_init: float, gate_init: float) -> 'ReparamGPSA':
        """The GPSA layer that takes over `conv`'s filter (the same Parameter object)."""
        if not is_convertible(conv):
            raise ValueError(f'{conv} cannot be recast: need a k x k conv, k odd >= 3, stride 1, '
                             f'dilation 1, groups 1, padding k//2, zero padding')
        weight = conv.weight
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size[0], alpha_init=alpha_init,
                    gate_init=gate_init, bias=conv.bias is not None).to(device=weight.device, dtype=weight.dtype)
        layer.weight = weight
        layer.bias = conv.bias
        return layer

    @property
    def alpha(self) -> torch.Tensor:
        return F.softplus(self.alpha_raw, beta=ALPHA_BETA)  # (N_h,)

    def positional_attention(self, height: int, width: int) -> torch.Tensor:
        """P^h_ij = softmax_j(-alpha_h |delta_ij - Delta^h|^2): (N_h, H*W queries, Hp*Wp keys)."""
        p = self.pad
        device = self.centers.device
        ky, kx = torch.meshgrid(torch.arange(height + 2 * p, device=device),
                                torch.arange(width + 2 * p, device=device), indexing='ij')
        keys = torch.stack([ky, kx], dim=-1).reshape(-1, 2).float()  # (Nk, 2) padded-grid coords
        qy, qx = torch.meshgrid(torch.arange(height, device=device) + p,
                                torch.arange(width, device=device) + p, indexing='ij')
        queries = torch.stack([qy, qx], dim=-1).reshape(-1, 2).float()  # (Nq, 2)
        rel = keys[None, :, :] - queries[:, None, :]  # delta_ij (Nq, Nk, 2)
        dist2 = (rel[None] - self.centers[:, None, None, :]).pow(2).sum(-1)  # (N_h, Nq, Nk)
        return torch.softmax(-self.alpha[:, None, None] * dist2, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        p, nh, d = self.pad, self.num_heads, self.head_dim
        Nq = H * W
        # (B, Nq, C): the real pixels, queries and keys; one contiguous copy, as the two projections
        # on the transposed view would each run as a slow strided GEMM
        tokens = x.flatten(2).transpose(1, 2).contiguous()
        # The ring of zero tokens (the conv's padding) has zero keys and values (no biases): each ring
        # key scores 0 for every query and adds nothing to A @ V. So keys and values are computed for
        # the real pixels only, and the ring's share of the content softmax enters as one extra column
        # scoring log(#ring) (exp of it = the ring's sum of exp(0)). Same result, about half the work.
        ring = (H + 2 * p) * (W + 2 * p) - Nq
        q, k = self.qk(tokens).view(B, Nq, 2, nh, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, N_h, Nq, d)
        v = self.v(tokens)  # (B, Nq, C): one value map for every head
        scores = torch.cat((q @ k.transpose(-2, -1) * self.scale,
                            q.new_full((B, nh, Nq, 1), math.log(ring))), dim=-1)  # (B, N_h, Nq, Nq + 1)
        content = torch.softmax(scores, dim=-1)[..., :Nq]  # (B, N_h, Nq, Nq): real keys
        # the mix in the content's dtype: CUDA autocast runs softmax in float32 (CPU autocast does not)
        positional = self.positional_attention(H, W)[..., self._real_keys(H, W)].to(content.dtype)  # (N_h, Nq, Nq)
        gate = torch.sigmoid(self.gating_param).to(content.dtype).view(1, 1, nh, 1)
        # A laid out (B, Nq, N_h, keys), so A @ V comes out as (B, Nq, N_h * C), the layout the
        # output projection needs (the maps are tiny next to N_h x C, so this is where layout pays)
        attn = torch.lerp(content.transpose(1, 2), positional.transpose(0, 1).unsqueeze(0), gate)
        attn = attn.contiguous(memory_format=torch.contiguous_format)  # (B, Nq, N_h, Nq)
        mixed = (attn.view(B, Nq * nh, Nq) @ v).view(B, Nq, nh * C)  # sum over keys, per head
        # sum_h (A^h V) W_out^h as one matmul: (B, Nq, N_h*C) @ (N_h*C, C_out)
        w_out = self.weight.permute(2, 3, 1, 0).reshape(nh * C, self.out_chans)
        out = linear(mixed, w_out.t())  # (B, Nq, C_out)
        if self.bias is not None:
            out = out + self.bias
        return out.transpose(1, 2).reshape(B, self.out_chans, H, W)

    def _real_keys(self, height: int, width: int) -> torch.Tensor:
        """Indices of the real pixels among the padded grid's (H + 2p) x (W + 2p) keys, row-major."""
        p, device = self.pad, self.centers.device
        rows = torch.arange(height, device=device) + p
        cols = torch.arange(width, device=device) + p
        return (rows[:, None] * (width + 2 * p) + cols[None, :]).reshape(-1)

    def extra_repr(self) -> str:
        return (f'{self.in_chans}, {self.out_chans}, kernel_size={self.kernel_size}, '
                f'num_heads={self.num_heads}, head_dim={self.head_dim}')


def is_convertible(module: nn.Module) -> bool:
    if not isinstance(module, nn.Conv2d):
        return False
    k = module.kernel_size
    return (k[0] == k[1] and k[0] >= 3 and k[0] % 2 == 1 and module.stride == (1, 1)
            and module.dilation == (1, 1) and module.groups == 1
            and module.padding == (k[0] // 2, k[0] // 2) and module.padding_mode == 'zeros')


def _check_optional_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 0):
        raise ValueError(f'{name}={value!r}: expected an int >= 0 (or leave it out)')


class TransformedResNet(ResNet, ConvertsDuringTraining):
    """timm's ResNet, plus `reparametrise()`: last-stage 3x3 convs -> GPSA (see module docstring)."""

    family = 'tcnn'

    def __init__(
            self,
            *,
            small_input: bool = False,
            reparam_epoch: Optional[int] = None,
            reparam_fraction: Optional[float] = None,
            reparam_alpha: float = 1.0,
            reparam_gate: float = 1.0,
            reparam_optimizer: str = 'fresh',
            gate_lr_mult: float = 1.0,
            reparametrised: bool = False,
            pretrained_path: Optional[str] = None,
            **kwargs: Any,
    ) -> None:
        _check_optional_int('reparam_epoch', reparam_epoch)
        if reparam_fraction is not None:
            _check_real('reparam_fraction', reparam_fraction, 0., 1., high_open=False)
        if reparam_epoch is not None and reparam_fraction is not None:
            raise ValueError(f'reparam_epoch={reparam_epoch} and reparam_fraction={reparam_fraction}: '
                             f'give one of them (epochs, or a fraction of the epoch budget)')
        _check_real('reparam_alpha', reparam_alpha, 1e-6)
        _check_real('reparam_gate', reparam_gate, -1e6)
        _check_real('gate_lr_mult', gate_lr_mult, 0.)
        if reparam_optimizer not in ('fresh', 'keep'):
            raise ValueError(f"reparam_optimizer={reparam_optimizer!r}: expected 'fresh' (a new AdamW after "
                             f"the conversion) or 'keep' (the same optimizer)")
        super().__init__(**kwargs)
        self.small_input = small_input
        if small_input:  # 3x3/1 stem, no max-pool: 28-32 px inputs keep 4 x 4 pixels in layer4
            dd = dict(device=self.conv1.weight.device, dtype=self.conv1.weight.dtype)
            self.conv1 = nn.Conv2d(self.conv1.in_channels, self.conv1.out_channels, 3, 1, 1, bias=False, **dd)
            nn.init.kaiming_normal_(self.conv1.weight, mode='fan_out', nonlinearity='relu')
            self.maxpool = nn.Identity()
        self.reparam_epoch = reparam_epoch
        self.reparam_fraction = 0.25 if reparam_epoch is None and reparam_fraction is None else reparam_fraction
        self.reparam_alpha = float(reparam_alpha)
        self.reparam_gate = float(reparam_gate)
        self.reparam_optimizer = reparam_optimizer
        self.gate_lr_mult = float(gate_lr_mult)
        self.is_reparametrised = False
        if pretrained_path is not None:
            self.load_pretrained(pretrained_path)
        if reparametrised:
            self.reparametrise()

    # -- the conversion -------------------------------------------------------------------
    def reparam_epoch_for(self, total_epochs: int) -> int:
        """Epochs trained as a CNN before the conversion, in [0, total_epochs]."""
        if self.reparam_epoch is not None:
            return min(int(self.reparam_epoch), total_epochs)
        return min(total_epochs, int(round(self.reparam_fraction * total_epochs)))

    def convertible_convs(self) -> List[str]:
        return [f'layer4.{name}' for name, m in self.layer4.named_modules() if is_convertible(m)]

    @torch.no_grad()
    def reparametrise(self) -> List[str]:
        """Recast the last stage's convertible convs as GPSA layers, in place; their names."""
        if self.is_reparametrised:
            raise RuntimeError('the model is already reparametrised')
        names = self.convertible_convs()
        if not names:
            raise RuntimeError('layer4 has no stride-1 k x k conv to recast')
        for name in names:
            parent_name, _, attr = name.rpartition('.')
            parent = self.get_submodule(parent_name)
            conv = getattr(parent, attr)
            setattr(parent, attr, ReparamGPSA.from_conv(
                conv, alpha_init=self.reparam_alpha, gate_init=self.reparam_gate))
        self.is_reparametrised = True
        return names

    def load_pretrained(self, path: str) -> None:
        """Weights from a local timm ResNet (or T-CNN) checkpoint; see the module docstring."""
        try:
            state = load_state_dict(path, use_ema=False, weights_only=True)
        except FileNotFoundError:
            raise ValueError(f'pretrained_path={path!r}: no such file; give a local checkpoint '
                             f'(a timm ResNet state dict saved with torch.save)') from None
        if any(k.endswith('gating_param') for k in state) and not self.is_reparametrised:
            self.reparametrise()  # a converted model's checkpoint
        own = self.state_dict()
        if 'conv1.weight' in state and state['conv1.weight'].shape[1] != own['conv1.weight'].shape[1]:
            state['conv1.weight'] = adapt_input_conv(own['conv1.weight'].shape[1], state['conv1.weight'])
        head = [k for k in ('fc.weight', 'fc.bias') if k in state and state[k].shape != own[k].shape]
        for k in head:  # another number of classes: keep the fresh classifier
            del state[k]
        mismatched = [k for k in state if k in own and state[k].shape != own[k].shape]
        if mismatched:
            raise ValueError(f'pretrained_path={path!r} does not fit this model: {mismatched[0]} is '
                             f'{tuple(state[mismatched[0]].shape)}, the model has '
                             f'{tuple(own[mismatched[0]].shape)}; pick the variant it was trained as')
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in head]
        if missing or unexpected:
            raise ValueError(f'pretrained_path={path!r} does not fit this model: missing {missing[:3]}, '
                             f'unexpected {unexpected[:3]}; pick the variant it was trained as')
        if head:
            _logger.info('%s: classifier of another size, left freshly initialised', path)

    # -- optimisation ---------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith(('.centers', '.alpha_raw', '.gating_param'))}

    def param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        """AdamW parameter groups, each {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale).

        Gates: lr_scale = gate_lr_mult, no weight decay. Biases, norms, attention centres and
        locality strengths: no weight decay. Everything else (convs, W_out, W_qry/key/val, fc):
        `weight_decay`. Frozen parameters are left out; empty groups (the gates of a CNN not yet
        converted) are dropped.
        """
        return _gated_param_groups(self, weight_decay, gate_lr_mult=self.gate_lr_mult,
                                   no_decay_names=self.no_weight_decay())

def _create_ls_tcnn(variant: str, pretrained: bool = False, **kwargs) -> TransformedResNet:
    hint = ' (or pass pretrained_path=<a local timm ResNet checkpoint>)'
    return _build_without_weights(TransformedResNet, variant, pretrained, weights_hint=hint, **kwargs)


def _resnet_cfg(**kwargs) -> Dict[str, Any]:
    return _cfg(first_conv='conv1', classifier='fc', pool_size=(7, 7), fixed_input_size=False,
                interpolation='bilinear', **kwargs)


default_cfgs = generate_default_cfgs({
    'ls_tcnn_nano': _fashion_mnist_cfg(first_conv='conv1', classifier='fc', fixed_input_size=False),
    'ls_tcnn_resnet10_micro_s': _fashion_mnist_cfg(first_conv='conv1', classifier='fc', fixed_input_size=False),
    'ls_tcnn_resnet18_s': _cfg(first_conv='conv1', classifier='fc', input_size=(3, 32, 32), crop_pct=1.0,
                               fixed_input_size=False),
    'ls_tcnn_resnet18': _resnet_cfg(),
    'ls_tcnn_resnet26': _resnet_cfg(),
    'ls_tcnn_resnet50': _resnet_cfg(),
})


def _drop_img_size(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    kwargs.pop('img_size', None)  # ResNets take any input size
    return kwargs


@register_model
def ls_tcnn_nano(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """Test-sized, small input: BasicBlock x [1, 1, 1, 2], widths 8-16-32-64, 1 x 28 x 28; 3 convs convert."""
    model_args = dict(block=BasicBlock, layers=(1, 1, 1, 2), channels=(8, 16, 32, 64), stem_width=8,
                      small_input=True, in_chans=1, num_classes=10)
    return _create_ls_tcnn('ls_tcnn_nano', pretrained, **dict(model_args, **_drop_img_size(kwargs)))


@register_model
def ls_tcnn_resnet10_micro_s(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """CPU default for Fashion-MNIST: BasicBlock x [1, 1, 1, 2], widths 32-64-128-256, small input.
    Converts 3 convs (256 channels, 9 heads of 28 dims) on a 4 x 4 map at 28 px."""
    model_args = dict(block=BasicBlock, layers=(1, 1, 1, 2), channels=(32, 64, 128, 256), stem_width=32,
                      small_input=True, in_chans=1, num_classes=10)
    return _create_ls_tcnn('ls_tcnn_resnet10_micro_s', pretrained, **dict(model_args, **_drop_img_size(kwargs)))


@register_model
def ls_tcnn_resnet18_s(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """ResNet-18 with a 3x3/1 stem and no max-pool, for 32 x 32 (CIFAR-size) images."""
    model_args = dict(block=BasicBlock, layers=(2, 2, 2, 2), small_input=True)
    return _create_ls_tcnn('ls_tcnn_resnet18_s', pretrained, **dict(model_args, **_drop_img_size(kwargs)))


@register_model
def ls_tcnn_resnet18(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """timm resnet18 (same keys: its checkpoints load through `pretrained_path`)."""
    model_args = dict(block=BasicBlock, layers=(2, 2, 2, 2))
    return _create_ls_tcnn('ls_tcnn_resnet18', pretrained, **dict(model_args, **_drop_img_size(kwargs)))


@register_model
def ls_tcnn_resnet26(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """timm resnet26: Bottleneck x [2, 2, 2, 2]."""
    model_args = dict(block=Bottleneck, layers=(2, 2, 2, 2))
    return _create_ls_tcnn('ls_tcnn_resnet26', pretrained, **dict(model_args, **_drop_img_size(kwargs)))


@register_model
def ls_tcnn_resnet50(pretrained: bool = False, **kwargs) -> TransformedResNet:
    """timm resnet50: Bottleneck x [3, 4, 6, 3]."""
    model_args = dict(block=Bottleneck, layers=(3, 4, 6, 3))
    return _create_ls_tcnn('ls_tcnn_resnet50', pretrained, **dict(model_args, **_drop_img_size(kwargs)))
