"""`parameters_key`: what a value inference keeps (derived from parameters) is checked against.

Inference keeps values derived from parameters and reuses them until a parameter changes: GPSA's
positional maps and fused qkv weight (`ls_convit`'s `_frozen`), the linears' weights in oneDNN's
layout (`_linear._packed_weight`). A change shows in a parameter's storage, dtype, device, shape or
strides, or in its version counter, which every in-place op bumps (an optimizer step,
`load_state_dict`) with two exceptions: writes through `.data`, and torch's fused AdamW on the CPU
(`fused=True`, the trials' optimizer: `_fused_adamw_` updates the parameters in place and leaves
their version counters as they were, torch 2.15). So the key also counts optimizer steps, every
`torch.optim` optimizer's in this process (a global step hook): any step invalidates every kept
value, which at worst recomputes one that had not changed.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["parameters_key"]

_optimizer_steps = 0


def _count_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_step)


def parameters_key(*params: torch.Tensor) -> tuple:
    """A key that differs once any of `params` may have changed (see the module doc). The tensors
    must have version counters (not inference tensors)."""
    return (_optimizer_steps,
            *((p.data_ptr(), p._version, p.dtype, p.device, p.shape, p.stride()) for p in params))
