"""Test helpers for layers: a layer's output and gradients in a given dtype, optionally under CPU
bf16 autocast (for tests that hold a low-precision path against a float64 copy of the same layer),
a record of the ops a call dispatched (which path it took), and the float32 CPU kernel (this CPU's
build, or its 8-lane AVX2 build on an AVX-512 CPU) or a skip."""
from __future__ import annotations

import functools

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
    """The float32 CPU kernel's ops (`kernels.cpu_library`), or a skip where it is not built here (no
    compiler, no AVX2)."""
    from trainers import kernels

    if not kernels.cpu_library_available(torch.float32):
        pytest.skip(f"the float32 CPU kernel is not built here: {kernels.cpu_library_error(torch.float32)}")
    return kernels.cpu_library(torch.float32)


AVX2_NAMESPACE = "locality_search_fp32_avx2"


@functools.lru_cache(maxsize=None)
def _float32_avx2_build() -> tuple[object | None, str]:
    """(ops, "") for the float32 kernel compiled with the AVX2 flags alone (8 lanes) under its own op
    namespace, or (None, why not)."""
    from trainers import kernels

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        return None, "this CPU's own float32 kernel is the 8-lane AVX2 build"
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None, "this CPU runs neither AVX2 nor AVX-512 code"
    # raises where the build fails: a test failure
    return kernels.build_cpu_library(torch.float32, AVX2_NAMESPACE, avx2=True), ""


def float32_avx2_kernel_or_skip():
    """The float32 kernel's 8-lane AVX2 build, on a CPU whose own build has 16 lanes (AVX-512): the
    code the AVX2-only machines run, tested here too. A skip where this CPU's build is that one."""
    ops, why_not = _float32_avx2_build()
    if ops is None:
        pytest.skip(why_not)
    return ops
