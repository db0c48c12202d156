"""The attention core's passes over its maps as one fused CPU kernel per direction
(`csrc/attention_maps.cpp`): softmax, the mix with GPSA's positional attention and the cast to the
GEMM dtype in one pass forward; the softmax backward, the (1 - s) * scale factor, the cast and the
gate's sums in one pass backward, recomputing the softmax from the scores and two numbers per row
instead of keeping a float32 copy of the maps.

The core uses it where its GEMMs run in bfloat16 (CPU autocast on bf16 hardware, as `precision:
auto` trains there): the GPSA layer 1.10x faster, ConViT-Ti 1.13x in inference and 1.08x in
training (README, Performance). The kernel takes float32 maps too (tested to 1e-6 against float64),
but measured even with the separate ops there (0.96-1.00x), so float32 keeps them.

Built on first use with the C++ compiler that FFCV's build needs too, for CPUs with AVX-512, into
``$XDG_CACHE_HOME/locality-search/kernels`` (one file per source, torch and instruction set; built
once per machine, ~10 s, under a file lock so concurrent trials wait for one build), and loaded as
``torch.ops.locality_search``. Where it cannot be built (no compiler, no AVX-512, another OS) the
core runs the same passes as separate torch ops, with one warning saying why;
``LOCALITY_SEARCH_CPU_KERNELS=0`` chooses that path outright.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from trainers._atomic import atomic_write

__all__ = ["MAX_TOKENS", "USE_FUSED_KERNEL", "build_error", "kernels", "usable"]

SOURCE = Path(__file__).with_name("csrc") / "attention_maps.cpp"
MAX_TOKENS = 1024  # the kernel's row buffers (kMaxTokens)
_DISABLE_ENV = "LOCALITY_SEARCH_CPU_KERNELS"
# False: the core runs its map passes as separate torch ops (the benchmarks time both side by side)
USE_FUSED_KERNEL = True


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "locality-search" / "kernels"


def _isa_flags() -> Optional[list[str]]:
    """The -m flags for this CPU, or None where it lacks the AVX-512 subsets the kernel needs."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None  # torch's own dispatch level: AVX-512 F, BW, VL and DQ present and enabled
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.append("-mavx512bf16")  # bf16 rounding in one instruction
    return flags


def _compile_command(compiler: str, output: Path, isa: list[str]) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, str(SOURCE), "-o", str(output), "-shared", "-fPIC", "-O3", "-std=c++20", "-fopenmp", *isa,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem", str(torch_dir / "include"), "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _build() -> Path:
    """The compiled library's path, building it unless a build for this source, torch and
    instruction set is cached. Raises RuntimeError saying why it cannot be built."""
    if os.environ.get(_DISABLE_ENV, "1").strip() == "0":
        raise RuntimeError(f"{_DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for Linux on x86-64 only, not {sys.platform} on {platform.machine()}")
    isa = _isa_flags()
    if isa is None:
        raise RuntimeError(f"this CPU has no AVX-512 (torch dispatches {torch.backends.cpu.get_cpu_capability()})")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (install g++; ./with-deps does)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), " ".join(isa).encode(),
                                     compiler.encode()])).hexdigest()[:16]
    library = _cache_dir() / f"attention_maps-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent trials: one builds, the others wait and load
        if library.exists():
            return library
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            output = Path(scratch) / library.name
            done = subprocess.run(_compile_command(compiler, output, isa), capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                first_error = next((line for line in done.stderr.splitlines() if "error" in line),
                                   done.stderr.strip()[-300:])
                raise RuntimeError(f"compiling {SOURCE.name} failed: {first_error}")
            atomic_write(library, lambda handle: handle.write(output.read_bytes()))
    return library


_build_error: Optional[str] = None


@functools.lru_cache(maxsize=None)
def kernels() -> Optional[Any]:
    """``torch.ops.locality_search`` with ``maps_forward`` and ``maps_backward`` loaded, or None
    where the kernel cannot be built here (`build_error` says why; warned once)."""
    global _build_error
    try:
        torch.ops.load_library(str(_build()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        _build_error = str(error)
        if os.environ.get(_DISABLE_ENV, "1").strip() != "0":
            warnings.warn(f"the fused attention-map kernel is not used ({error}); the CPU attention core "
                          "runs its passes as separate torch ops, slower", RuntimeWarning, stacklevel=2)
        return None
    return torch.ops.locality_search


def build_error() -> Optional[str]:
    """Why `kernels()` is None (after it was called), else None."""
    return _build_error


def usable(maps_dtype: torch.dtype, tokens: int) -> bool:
    """Whether the core runs its map passes on the kernel: bfloat16 maps (the GEMMs' output) of at
    most MAX_TOKENS tokens, outside torch.compile (which traces the torch ops instead), the kernel
    built here."""
    return (USE_FUSED_KERNEL and maps_dtype == torch.bfloat16 and tokens <= MAX_TOKENS
            and not torch.compiler.is_compiling() and kernels() is not None)
