"""What a ``precision`` setting computes in on a device: one rule for ``train.precision`` (the
trial's training and validation) and ``throughput.precision`` (its inference measurement).

    fp32 | bf16 | fp16   as asked (bf16 on a GPU without it: a SettingError)
    auto                 reduced precision where the hardware multiplies in it: on CUDA bf16 where
                         the GPU supports it, else fp16; on a CPU with bf16 hardware (AMX or
                         AVX512-BF16, `cpu_has_native_bf16`) bf16; fp32 on any other CPU, which
                         would emulate bf16 far slower than fp32

A trial's accuracy and its throughput are thus obtained in the same precision.
benchmarks/training_precision.py measures a trial's time and accuracy in each.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch

from trainers._cpu import cpu_has_native_bf16
from trainers.config import PRECISIONS, SettingError

__all__ = ["resolve_precision", "autocast_dtype", "autocast_for", "bf16_in_hardware"]

_AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def bf16_in_hardware(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 in hardware: a GPU that supports it, a CPU with AMX or
    AVX512-BF16 that oneDNN may use (`cpu_has_native_bf16`)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def resolve_precision(precision: str, device: torch.device, *, bf16_hardware: bool | None = None) -> str:
    """fp32, bf16 or fp16: what ``precision`` computes in on ``device`` (see the module doc).
    ``bf16_hardware``: whether the device multiplies bf16 in hardware; None asks it
    (`bf16_in_hardware`)."""
    if precision not in PRECISIONS:
        raise SettingError("precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")

    def hardware() -> bool:  # asked only where the answer matters
        return bf16_in_hardware(device) if bf16_hardware is None else bf16_hardware

    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if hardware() else "fp16"
        return "bf16" if device.type == "cpu" and hardware() else "fp32"
    if precision == "bf16" and device.type == "cuda" and not hardware():
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
        raise SettingError("precision", f"bf16: {name} does not support it; use fp16 or auto")
    return precision


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (`resolve_precision`); None: float32, no
    autocast."""
    return _AUTOCAST_DTYPES[resolve_precision(precision, device)]


def autocast_for(precision: str, device: torch.device) -> Callable[[], ContextManager]:
    """A factory of the autocast context ``precision`` asks for on ``device`` (float32: autocast
    off, so an outer autocast does not leak in)."""
    dtype = autocast_dtype(precision, device)

    def autocast() -> ContextManager:
        if dtype is None:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=dtype)

    return autocast
