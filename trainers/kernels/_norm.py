"""`LayerNorm`, `add_and_norm`, `add_residual`: a pre-norm block's norms and residual adds, in CPU
inference (autograd not recording) one pass over the tokens on the kernel libraries' `layer_norm`
(`csrc/layer_norm_op.h`), where torch runs layer_norm (and, in bf16, then the cast).

  - float32 (no autocast): the same values but for the last bits (the float32 sums' order).
  - CPU autocast to bf16: the normalised tokens in bf16, which is what autocast casts them to at the
    linear that every such norm feeds (the qkv projection, fc1), bit for bit but for the last bit
    of about 1 in 30,000.
benchmarks/models.py measures the gain (`inference_ops_gain`).
"""
from typing import Any, Optional, Tuple

import torch
from torch import nn

from timm.layers import LayerNorm as _TimmLayerNorm
from timm.models import register_notrace_function, register_notrace_module

from trainers.kernels import _library
from trainers.kernels._hooks import has_hooks
from trainers.kernels._linear import cpu_autocast_to_bf16, records_autograd
from trainers.kernels._switch import enabled, selected_backends

__all__ = ["LayerNorm", "add_and_norm", "add_residual"]


@register_notrace_module  # reason: branches on dtype, device and autocast (timm's FX feature extraction)
class LayerNorm(_TimmLayerNorm):
    """timm's `LayerNorm` (same parameters, state dict and output) for a block's norm before its
    attention or MLP, on a kernel library in CPU inference (see the module doc). Not for a model's
    last norm, whose float32 output the caller sees in the precision it asked for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _norm_kernel(x, self) if enabled() else None
        if ops is None:
            return super().forward(x)
        return ops.layer_norm(x, None, self.weight, self.bias, self.eps)[0]


@register_notrace_function  # reason: as PreNorm's
def add_and_norm(x: torch.Tensor, branch: torch.Tensor, norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x + branch, norm(x + branch)): a block's residual add and the next norm. Where `norm` is a
    kernels `LayerNorm` that runs on a library, both in one pass (the sum in float32, exactly
    x + branch; the norm as `LayerNorm` returns it)."""
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
    one pass, where x + branch casts it to a new tensor first and adds into another."""
    if (records_autograd(x, branch) or has_hooks(norm) or branch.shape != x.shape
            or torch.promote_types(x.dtype, branch.dtype) != x.dtype):
        return x + branch
    return x.add_(branch)


def _norm_kernel(x: torch.Tensor, norm: nn.Module, branch: Optional[torch.Tensor] = None) -> Optional[Any]:
    """The kernel library whose `layer_norm` runs `norm(x)` (with a branch: `norm(x + branch)` and
    the sum; see `LayerNorm`), else None (also with the `norm_kernel` backend off): the bf16 one
    under CPU autocast to bf16, the float32 one
    without autocast, where that library is built; a branch it reads as it is (contiguous, x's
    shape, float32 or the library's dtype)."""
    if not (enabled() and selected_backends().norm_kernel and type(norm) is LayerNorm
            and x.device.type == 'cpu' and x.dtype == torch.float32
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
    return _library.cpu_library(dtype)
