"""What this machine has, for the hardware markers (declared in pyproject.toml) that
tests/conftest.py turns into skips. Each check runs at most once a process, and only where a
collected test carries its marker; none initialises CUDA beyond `torch.cuda.is_available()`.

A test that needs more than one thing carries more than one marker (the Triton kernel: `triton`,
which implies `cuda`; the bf16 kernel: `avx512` and `avx512_bf16`)."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["MARKERS", "missing"]


def _cuda() -> bool:
    return torch.cuda.is_available()


def _triton() -> bool:
    if not _cuda():
        return False  # no GPU: never import triton
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:  # CPU-only torch builds ship without Triton
        return False
    return True


def _capability() -> str:
    # the code torch's own kernels run ("AVX2", "AVX512", "DEFAULT", ...); ATEN_CPU_CAPABILITY may
    # cap it below the CPU's, and the kernels' builds follow it, so the markers do too
    return torch.backends.cpu.get_cpu_capability()


def _avx512() -> bool:
    return _capability().startswith("AVX512")


def _avx2() -> bool:
    return _capability() == "AVX2" or _avx512()


def _avx512_bf16() -> bool:
    # bf16 products in hardware: AVX512-BF16 dot products or AMX tiles, the CPU facts behind
    # trainers._cpu.cpu_has_native_bf16 (which also asks oneDNN's ISA cap, a setting, not hardware)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # absent in a torch too old to tell
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def _chromium() -> bool:
    from dashboards.browser import find_chromium

    return find_chromium() is not None


# marker name -> (whether this machine has it, the skip's reason where it does not)
MARKERS: dict[str, tuple[Callable[[], bool], str]] = {
    "cuda": (_cuda, "needs a CUDA GPU"),
    "triton": (_triton, "needs a CUDA GPU and Triton"),
    "avx2": (_avx2, "needs an AVX2 or AVX-512 CPU"),
    "avx512": (_avx512, "needs an AVX-512 (AVX-512F) CPU"),
    "avx512_bf16": (_avx512_bf16, "needs AVX512-BF16 or AMX (bf16 in hardware)"),
    "chromium": (_chromium, "needs Chromium: install Debian's chromium (./with-deps installs it) "
                            "to test the page in a browser"),
}


@functools.cache
def missing(marker: str) -> str | None:
    """The skip's reason where this machine lacks what `marker` names, else None."""
    present, reason = MARKERS[marker]
    return None if present() else reason
