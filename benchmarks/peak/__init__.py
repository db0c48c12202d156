"""The CPU's multiply-add peak in a kernel library's own arithmetic (`multiply_add_peak.h`), built
apart from the libraries the models use: `peak_ops(dtype)` builds `peak.cpp` with the -m flags of
the library of that dtype (`trainers.kernels._library`) and returns its ops
(``multiply_add_peak(iterations) -> flops``), or None where that library cannot run here."""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from trainers.kernels import _library

__all__ = ["peak_build_error", "peak_ops"]

_SOURCE = Path(__file__).with_name("peak.cpp")
_errors: dict[torch.dtype, str] = {}


@functools.lru_cache(maxsize=None)
def peak_ops(dtype: torch.dtype) -> Optional[Any]:
    """The peak's ops for the `dtype` library's instruction (float32: its vector FMA; bf16:
    vdpbf16ps), built on first use; None where it cannot be built here (`peak_build_error`)."""
    kernel = _library._KERNELS[dtype]
    isa = kernel.isa_flags()
    if isa is None:
        _errors[dtype] = f"this CPU has no {kernel.needs}"
        return None
    variant = kernel.variant(isa)
    namespace = f"locality_search_peak_{variant}"
    defines = [f"-DATTENTION_LIBRARY={namespace}"] + (["-DMULTIPLY_ADD_PEAK_BF16"] if dtype == torch.bfloat16 else [])
    try:
        _library.load_library(_SOURCE, variant, [*isa, *defines])
    except (RuntimeError, OSError) as error:
        _errors[dtype] = str(error)
        warnings.warn(f"the multiply-add peak ({variant}) is not measured ({error})", RuntimeWarning, stacklevel=2)
        return None
    return getattr(torch.ops, namespace)


def peak_build_error(dtype: torch.dtype) -> Optional[str]:
    """Why `peak_ops(dtype)` is None (after it was called), else None."""
    return _errors.get(dtype)
