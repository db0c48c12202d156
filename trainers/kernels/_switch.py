"""Every switch of the kernels, in this one place:

  - the switch over every backend: `enabled()` / `set_enabled(flag)`, and the environment variable
    ``LOCALITY_SEARCH_CPU_KERNELS=0``, read once at import, which also keeps the C++ libraries from
    being built. Off, the model families run their reference math on torch ops.
  - the selection among the backends (`backends(...)` for a block, `selected_backends()` to read
    it): each backend on by default, one turned off where a benchmark times the path it replaces
    side by side or a test checks that path. Off, an op takes the path it would take where that
    backend cannot run.
Every module of the package reads them here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import ContextManager, Iterator

__all__ = ["DISABLE_ENV", "Backends", "backends", "enabled", "selected_backends", "set_enabled"]

DISABLE_ENV = "LOCALITY_SEARCH_CPU_KERNELS"


def _from_environment() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip() != "0"


_enabled = _from_environment()


def enabled() -> bool:
    """Whether the kernel backends may run (the default; off with ``set_enabled(False)`` or
    ``LOCALITY_SEARCH_CPU_KERNELS=0`` in the environment)."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Turn every kernel backend on or off for this process (tests, benchmarks, a debugging run)."""
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"set_enabled({flag!r}): pass True or False")
    _enabled = flag


@dataclasses.dataclass(frozen=True)
class Backends:
    """Which kernel backends may run where they are the quicker path (all by default, and only
    while `enabled()`): one field per backend, named as `backends` takes it, which says what each is."""

    libraries: bool = True
    explicit_plain_attention: bool = True
    fused_gpsa_layer: bool = True
    kept_maps: bool = True
    triton: bool = True
    onednn_fp32: bool = True
    onednn_bf16: bool = True
    bf16_kernel_linear: bool = True
    weight_grad_kernel: bool = True
    fused_gelu: bool = True
    packed_weights: bool = True
    norm_kernel: bool = True


_NAMES = tuple(field.name for field in dataclasses.fields(Backends))
_selected = Backends()


def selected_backends() -> Backends:
    """The backends selected now (`backends` changes them for a block)."""
    return _selected


def backends(**switches: bool) -> ContextManager[Backends]:
    """A context manager: inside it, each backend named here on (True) or off (False), the others as
    they were; on exit (also on an exception) the selection it found. Yields the selection inside.
    Off, an op takes the path it takes where that backend cannot run, so values agree up to rounding.

      libraries                 the attention cores (plain, GPSA's, GMM's masked), GPSA's fused layer
                                and the Refiner's map refinement on the C++ libraries (`cpu_library`);
                                off: on torch ops (the linears and norms have switches of their own)
      explicit_plain_attention  plain attention (`plain_attention`) on the explicit core where that is
                                the quicker (`plain_attention_on_explicit_core`); off: torch's fused
                                scaled_dot_product_attention (GPSA keeps the core)
      fused_gpsa_layer          GPSA's whole layer, projections and core, as one float32 library op per
                                direction; off: the projections and the core as ops apart
      kept_maps                 the float32 library's forward keeping the softmax maps for the backward
                                where they are small; off: the backward recomputes them
      triton                    GPSA's CUDA fp16/bf16 inference in one Triton kernel
                                (`triton_gated_attention`); off: fused SDPA plus P @ V
      onednn_fp32               float32 linears on oneDNN where it beats MKL (`onednn_beats_mkl_here`,
                                `onednn_inference_beats_mkl_here`); off: torch's F.linear (MKL)
      onednn_bf16               bf16 inference's linears on oneDNN's linear op (or the bf16 library's),
                                the bias inside the product; off: torch's F.linear
      bf16_kernel_linear        bf16 inference's linears on the bf16 library where it beats oneDNN
                                (`kernel_bf16_linear_beats_onednn_here`); off: on oneDNN
      weight_grad_kernel        a float32 linear's weight gradient on the float32 library; off: oneDNN
                                or MKL
      fused_gelu                ``linear(..., gelu=True)``'s GELU inside oneDNN's or the library's
                                product; off: applied after it
      packed_weights            inference handing oneDNN each weight in its blocked layout, kept until
                                the weight changes; off: the plain weight on every call
      norm_kernel               `LayerNorm` and `add_and_norm` on the libraries' layer norm in CPU
                                inference; off: torch's layer_norm (and the add apart)

    An unknown name, or a value not a bool, raises TypeError here, before anything changes."""
    unknown = [name for name in switches if name not in _NAMES]
    if unknown:
        raise TypeError(f"backends(): no backend named {', '.join(map(repr, unknown))}; "
                        f"the backends are {', '.join(_NAMES)}")
    not_bool = {name: flag for name, flag in switches.items() if not isinstance(flag, bool)}
    if not_bool:
        raise TypeError(f"backends({', '.join(f'{n}={f!r}' for n, f in not_bool.items())}): pass True or False")
    return _selecting(switches)


@contextlib.contextmanager
def _selecting(switches: dict[str, bool]) -> Iterator[Backends]:
    global _selected
    previous = _selected
    _selected = dataclasses.replace(previous, **switches)
    try:
        yield _selected
    finally:
        _selected = previous
