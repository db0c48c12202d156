"""Test helpers for layers: a layer's output and gradients in a given dtype, optionally under CPU
bf16 autocast (for tests that hold a low-precision path against a float64 copy of the same layer),
a record of the ops a call dispatched (which path it took), and the float32 CPU kernel or a skip."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def run_layer(module: torch.nn.Module, x: torch.Tensor, *, dtype: torch.dtype, bf16: bool, train: bool,
              upstream: torch.Tensor) -> list[torch.Tensor]:
    """[module(x)] and, when `train`, the gradients of <module(x), upstream> for x and every parameter
    (in `module.parameters()` order); x and upstream cast to `dtype` (a copy: x's own grad untouched)."""
    module.zero_grad()
    inputs = x.to(dtype, copy=True).requires_grad_(train)
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = module(inputs)
        if train:
            (out.to(dtype) * upstream.to(dtype)).sum().backward()
    return [out.detach()] + ([inputs.grad] + [p.grad for p in module.parameters()] if train else [])


class OpCalls(TorchDispatchMode):
    """Counts every op dispatched inside it by "namespace.name" (e.g. "mkldnn._linear_pointwise")."""

    def __enter__(self):
        self.calls: dict[str, int] = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def float32_kernel_or_skip():
    """The float32 CPU kernel's ops (`_attention_kernel`), or a skip where it is not built here (no
    compiler, no AVX2)."""
    from trainers.models import _attention_kernel

    if not _attention_kernel.available(torch.float32, 1):
        pytest.skip(f"the float32 CPU kernel is not built here: {_attention_kernel.build_error(torch.float32)}")
    return _attention_kernel.kernels(torch.float32)
