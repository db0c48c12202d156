"""What makes the models fast rather than what defines them: a few ops, each one entry point that
picks its backend (C++ libraries built on first use, oneDNN, Triton, torch's fused attention), and
one switch over all of them. The model families (`trainers.models`) keep the papers' math as their
reference path and call an op in one place where `enabled()`; this package knows nothing of them.

Ops:  gated_attention (GPSA), masked_attention (GMM), refine_maps (Refiner), attention (plain
multi-head), linear / Linear, LayerNorm with add_and_norm / add_residual (a pre-norm block's norms).
Switch: `enabled()`, `set_enabled(flag)`, env ``LOCALITY_SEARCH_CPU_KERNELS=0`` (also skips builds).
Build: `prebuild_cpu_kernels()` compiles the C++ libraries this CPU can run (`_library`).
"""
from trainers.kernels._attention_core import masked_attention, masked_attention_usable
from trainers.kernels._attention_core import plain_attention as attention
from trainers.kernels._gpsa import gated_attention
from trainers.kernels._hooks import has_hooks
from trainers.kernels._kept import KeptValues
from trainers.kernels._library import prebuild_cpu_kernels
from trainers.kernels._linear import Linear, linear, records_autograd
from trainers.kernels._norm import LayerNorm, add_and_norm, add_residual
from trainers.kernels._refine import refine_maps, refine_maps_usable
from trainers.kernels._switch import enabled, set_enabled

__all__ = [
    "KeptValues", "LayerNorm", "Linear", "add_and_norm", "add_residual", "attention",
    "enabled", "gated_attention", "has_hooks", "linear", "masked_attention", "masked_attention_usable", "prebuild_cpu_kernels",
    "records_autograd", "refine_maps", "refine_maps_usable", "set_enabled",
]
