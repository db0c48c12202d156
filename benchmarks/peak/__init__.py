"""The CPU's multiply-add peak in a kernel library's own arithmetic (`multiply_add_peak.h`), built
apart from the libraries the models use: `peak_ops(dtype)` builds `peak.cpp` with the -m flags of
the library of that dtype (`trainers.kernels.build_cpu_library`) and returns its ops
(``multiply_add_peak(iterations) -> flops``), or None where that library cannot run here."""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from trainers import kernels

__all__ = ["peak_build_error", "peak_ops"]

_SOURCE = Path(__file__).with_name("peak.cpp")
_errors: dict[torch.dtype, str] = {}


@functools.lru_cache(maxsize=None)
def peak_ops(dtype: torch.dtype) -> Optional[Any]:
    """The peak's ops for the `dtype` library's instruction (float32: its vector FMA; bf16:
    vdpbf16ps), built on first use; None where it cannot be built here (`peak_build_error`)."""
    bf16 = dtype == torch.bfloat16
    variant = "bf16" if bf16 else "fp32"
    try:
        return kernels.build_cpu_library(dtype, f"locality_search_peak_{variant}", source=_SOURCE,
                                         defines=["-DMULTIPLY_ADD_PEAK_BF16"] if bf16 else [])
    except (RuntimeError, OSError) as error:
        _errors[dtype] = str(error)
        warnings.warn(f"the multiply-add peak ({variant}) is not measured ({error})", RuntimeWarning, stacklevel=2)
        return None


def peak_build_error(dtype: torch.dtype) -> Optional[str]:
    """Why `peak_ops(dtype)` is None (after it was called), else None."""
    return _errors.get(dtype)
