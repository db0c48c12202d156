"""Keep freed heap memory in the process (glibc), so CPU training does not page-fault every step.

glibc's malloc hands big blocks back to the kernel as soon as they are freed: a block above the
mmap threshold (128 KiB at first, adapting up to 32 MiB) is unmapped on free, and the heap is
trimmed whenever more than the trim threshold sits free at its top. PyTorch's CPU allocator
frees every activation after use, so each training step maps its activations again and touches
every page anew: thousands of minor page faults a step, a sizeable share of a CPU layer's time
(benchmarks/models.py --glibc-default-malloc times the models without this). Raising both thresholds
keeps freed memory in the process for the next step; the resident size stays at the peak a step
needs, which the step needs anyway.

`retain_freed_memory()` is idempotent and a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["retain_freed_memory", "freed_memory_retained"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap (glibc caps it lower on old versions)
_TRIM_THRESHOLD = (1 << 31) - 1  # an int: trim only when 2 GiB sit free at the heap's top

_state: bool | None = None


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when they are in effect."""
    global _state
    if _state is not None:
        return _state
    _state = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) or mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    trim_ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    _state = bool(mmap_ok and trim_ok)
    return _state


def freed_memory_retained() -> bool:
    """Whether `retain_freed_memory` has put its thresholds in effect in this process (False
    before it is called, and where it could not)."""
    return bool(_state)
