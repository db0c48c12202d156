"""What makes the models fast rather than what defines them: a few ops, each one entry point that
picks its backend (C++ libraries built on first use, oneDNN, Triton, torch's fused attention), and
the switches over them. The model families (`trainers.models`) keep the papers' math as their
reference path and call an op in one place where `enabled()`; this package knows nothing of them.

Ops:  gated_attention (GPSA), masked_attention (GMM), refine_maps (Refiner), plain_attention (plain
multi-head), linear / Linear, LayerNorm with add_and_norm / add_residual (a pre-norm block's norms).
Switches (`_switch`, the one place they live): `enabled()`, `set_enabled(flag)`, env
``LOCALITY_SEARCH_CPU_KERNELS=0`` (also skips builds) over every backend; `backends(name=flag, ...)`
turns single backends on or off for a block (its docstring says what each is),
`selected_backends()` reads the selection.
Where each backend runs: `plain_attention_on_explicit_core`, `masked_attention_usable`,
`refine_maps_usable`, `triton_gated_attention_usable`, `cpu_library_available`, and the CPU facts
the linears' libraries are chosen by (`onednn_beats_mkl_here`, `onednn_inference_beats_mkl_here`,
`onednn_runs_bf16_here`, `kernel_bf16_linear_beats_onednn_here`).
Libraries: `prebuild_cpu_kernels()` compiles the C++ libraries this CPU can run; `cpu_library(dtype)`
their ops (or None, `cpu_library_error` says why); `build_cpu_library` builds another source the
same way (`_library`). `triton_gated_attention` is GPSA's CUDA inference kernel by itself.
"""
from trainers.kernels._attention_core import (masked_attention, masked_attention_usable, plain_attention,
                                              plain_attention_on_explicit_core)
from trainers.kernels._gpsa import gated_attention
from trainers.kernels._gpsa_triton import available as triton_gated_attention_usable
from trainers.kernels._gpsa_triton import gated_attention_inference as triton_gated_attention
from trainers.kernels._hooks import has_hooks
from trainers.kernels._kept import KeptValues
from trainers.kernels._library import (build_cpu_library, cpu_library, cpu_library_available, cpu_library_error,
                                       prebuild_cpu_kernels)
from trainers.kernels._linear import (Linear, kernel_bf16_linear_beats_onednn_here, linear, onednn_beats_mkl_here,
                                      onednn_inference_beats_mkl_here, onednn_runs_bf16_here, records_autograd)
from trainers.kernels._norm import LayerNorm, add_and_norm, add_residual
from trainers.kernels._refine import refine_maps, refine_maps_usable
from trainers.kernels._switch import Backends, backends, enabled, selected_backends, set_enabled

__all__ = [
    "Backends", "KeptValues", "LayerNorm", "Linear", "add_and_norm", "add_residual", "backends", "build_cpu_library",
    "cpu_library", "cpu_library_available", "cpu_library_error", "enabled", "gated_attention", "has_hooks",
    "kernel_bf16_linear_beats_onednn_here", "linear", "masked_attention", "masked_attention_usable",
    "onednn_beats_mkl_here", "onednn_inference_beats_mkl_here", "onednn_runs_bf16_here", "plain_attention",
    "plain_attention_on_explicit_core", "prebuild_cpu_kernels", "records_autograd", "refine_maps",
    "refine_maps_usable", "selected_backends", "set_enabled", "triton_gated_attention",
    "triton_gated_attention_usable",
]
