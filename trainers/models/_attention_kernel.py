"""The CPU attention core in bf16 as one fused kernel per direction (`csrc/attention_core.cpp`):
per (batch, head) the scores, softmax, GPSA's mix with its positional attention and the product
with v forward; the maps' recomputation, the four products of the backward, the softmax backward and
the gate's sums backward. The N x N maps never leave the kernel's cache-sized buffers (the backward
recomputes them from two numbers per row instead of keeping them), its GEMMs run on AVX512-BF16
dot products, and it reads q, k, v and writes the output and the gradients in the caller's strides,
so the projection's (B, N, 3, H, d) output needs no layout copy.

The core (`_attention_core`) runs on it wherever its GEMMs run in bfloat16 (CPU autocast on a CPU
with bf16 hardware, as `precision: auto` trains there): the GPSA layer and the whole models faster
than on the core's torch ops (README, Performance; the benchmarks time both side by side).

Built on first use with the C++ compiler that FFCV's build needs too, for CPUs with AVX512-BF16,
into ``$XDG_CACHE_HOME/locality-search/kernels`` (one file per source, torch and instruction set;
built once per machine, ~15 s, under a file lock so concurrent trials wait for one build), and
loaded as ``torch.ops.locality_search``. Where it cannot be built (no compiler, another OS) the core
runs on torch ops, with one warning saying why; ``LOCALITY_SEARCH_CPU_KERNELS=0`` chooses that path
outright.
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

__all__ = ["MAX_TOKENS", "USE_FUSED_KERNEL", "build_error", "d_out_for_kernel", "kernels", "usable"]

SOURCE = Path(__file__).with_name("csrc") / "attention_core.cpp"
MAX_TOKENS = 1024  # the kernel's row buffer (kMaxTokens)
_DISABLE_ENV = "LOCALITY_SEARCH_CPU_KERNELS"
# False: the core runs on torch ops (the benchmarks time both side by side)
USE_FUSED_KERNEL = True


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "locality-search" / "kernels"


def _isa_flags() -> Optional[list[str]]:
    """The -m flags for this CPU, or None where it lacks the AVX-512 subsets the kernel needs."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None  # torch's own dispatch level: AVX-512 F, BW, VL and DQ present and enabled
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return None
    return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]


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
        raise RuntimeError("this CPU has no AVX512-BF16 (torch dispatches "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (install g++; ./with-deps does)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), " ".join(isa).encode(),
                                     compiler.encode()])).hexdigest()[:16]
    library = _cache_dir() / f"attention_core-{key}.so"
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
    """``torch.ops.locality_search`` with ``attention_forward`` and ``attention_backward`` loaded, or None
    where the kernel cannot be built here (`build_error` says why; warned once)."""
    global _build_error
    try:
        torch.ops.load_library(str(_build()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        _build_error = str(error)
        if os.environ.get(_DISABLE_ENV, "1").strip() != "0":
            warnings.warn(f"the fused CPU attention kernel is not used ({error}); the attention core "
                          "runs on torch ops, slower", RuntimeWarning, stacklevel=2)
        return None
    return torch.ops.locality_search


def build_error() -> Optional[str]:
    """Why `kernels()` is None (after it was called), else None."""
    return _build_error


def _kernel_layout(t: torch.Tensor) -> bool:
    """Unit stride along the head dim and 32-bit aligned rows: the kernel reads bf16 pairs."""
    return (t.stride(-1) == 1 and all(stride % 2 == 0 for stride in t.stride()[:-1])
            and t.data_ptr() % 4 == 0)


def usable(qkv: torch.Tensor) -> bool:
    """Whether the core runs on the kernel for `qkv` ((3, B, H, N, d), the projection's output
    permuted): bfloat16 on the CPU, an even head dim, at most MAX_TOKENS tokens, a layout it reads
    in place, outside torch.compile (which traces the torch ops instead), the kernel built here.
    The caller makes sure the core's GEMMs run in bfloat16 (`_attention_core.gemm_dtype`)."""
    _, _, _, tokens, dim = qkv.shape
    return (USE_FUSED_KERNEL and qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu" and dim % 2 == 0
            and 1 <= tokens <= MAX_TOKENS and not torch.compiler.is_compiling() and _kernel_layout(qkv)
            and kernels() is not None)


def d_out_for_kernel(d_out: torch.Tensor) -> torch.Tensor:
    """The output's gradient in bfloat16, in a layout the kernel reads (as it comes, usually)."""
    d_out = d_out.to(torch.bfloat16)
    return d_out if _kernel_layout(d_out) else d_out.contiguous()
