"""`KeptValues` and `parameters_key`: values inference keeps (derived from parameters) and what they
are checked against.

Inference keeps values derived from parameters and reuses them until a parameter changes: GPSA's
positional maps and fused qkv weight (a layer's `KeptValues`), the linears' weights in oneDNN's
layout (`_linear._packed_weight`). A change shows in a parameter's storage, dtype, device, shape or
strides, or in its version counter, which every in-place op bumps (an optimizer step,
`load_state_dict`) with two exceptions: writes through `.data`, and torch's fused AdamW on the CPU
(`fused=True`, the trials' optimizer: `_fused_adamw_` updates the parameters in place and leaves
their version counters as they were). So the key also counts optimizer steps, every
`torch.optim` optimizer's in this process (a global step hook): any step invalidates every kept
value, which at worst recomputes one that had not changed.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["KeptValues", "parameters_key"]

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


class KeptValues(dict):
    """name -> (key, value): what one layer's inference reuses until its parameters change."""

    def keep(self, name: str, params: tuple, extra: Any, compute: Callable[[], Any]) -> Any:
        """compute(), which depends only on `params` and `extra`; without autograd (inference) it is
        kept and reused until a parameter may have changed (`parameters_key`: an optimizer step,
        load_state_dict, a move or a cast) or `extra` does. With autograd it is recomputed (part of
        the graph) and the kept copy dropped. Kept values are normal tensors, not inference tensors.
        Under torch.compile it is traced into the graph (a Python-side cache keyed on storage would
        only cause recompiles)."""
        if torch.compiler.is_compiling():
            return compute()
        if torch.is_grad_enabled():
            self.pop(name, None)
            return compute()
        key = (extra, torch.is_inference_mode_enabled(), parameters_key(*params))
        kept = super().get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        # normal tensors even when built during inference: _linear keeps the oneDNN layout of a
        # weight (the qkv one) only where a version counter tracks it (see _linear._packed_weight)
        with torch.inference_mode(False), torch.no_grad():
            value = compute()
        self[name] = (key, value)
        return value
