"""The one switch over every kernel backend: `enabled()` / `set_enabled(flag)`, and the environment
variable ``LOCALITY_SEARCH_CPU_KERNELS=0``, read once at import, which also keeps the C++ libraries
from being built. Off, the model families run their reference math on torch ops."""
from __future__ import annotations

import os

__all__ = ["DISABLE_ENV", "enabled", "set_enabled"]

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
