"""The CPU attention core as one fused kernel per direction, in bf16 (`csrc/attention_core.cpp`,
AVX512-BF16) and in float32 (`csrc/attention_core_fp32.cpp`, AVX2 + FMA, or AVX-512): per (batch,
head) the scores (in float32 optionally times GMM attention's mask), softmax, GPSA's mix with its
positional attention and the product with v forward; the maps' recomputation, the four products of
the backward, the softmax backward and the gate's sums (or the mask's gradient) backward. The maps
are formed in cache-sized buffers; the backward recomputes them from two numbers per row, except
that in float32 the forward keeps the softmax maps for it where they are small (`keeps_maps`). Its
GEMMs are register-tiled SIMD loops (AVX512-BF16 dot products in bf16, FMAs in float32), and it
reads q, k, v and writes the output and the gradients in the caller's strides, so the projection's
(B, N, 3, H, d) output needs no layout copy. The float32 library also refines the Refiner's maps
(`csrc/refiner_fp32.h`, ops ``refine_forward`` and ``refine_backward``; `ls_refiner.Refiner`) and
computes a float32 linear layer's weight gradient (`csrc/linear_fp32.h`, op ``linear_weight_grad``;
`_linear`).

The core (`_attention_core`) runs on it wherever its GEMMs run in bfloat16 (CPU autocast on a CPU
with bf16 hardware, as `precision: auto` trains there) or in float32 (fp32 training and inference,
as `auto` trains on CPUs without bf16 hardware): the GPSA layer and the whole models faster than on
the core's torch ops (benchmarks/README.md; the benchmarks time both side by side).

Built on first use with the C++ compiler that FFCV's build needs too, into
``$XDG_CACHE_HOME/locality-search/kernels`` (one file per source, torch and instruction set; built
once per machine, ~15-25 s each, under a file lock so concurrent trials wait for one build), and
loaded as ``torch.ops.locality_search`` (bf16) and ``torch.ops.locality_search_fp32``. Where one
cannot be built (no compiler, another OS, a CPU without its instructions) the core runs on torch
ops in that dtype, with one warning saying why; ``LOCALITY_SEARCH_CPU_KERNELS=0`` chooses that path
outright.
"""
from __future__ import annotations

import dataclasses
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
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from trainers._atomic import atomic_write

__all__ = [
    "DTYPES", "FP32_AVX2_FLAGS", "KEPT_MAPS_BYTES", "MAX_TOKENS", "USE_FUSED_KERNEL", "available", "build_error",
    "d_out_for_kernel", "kept_maps_fit", "keeps_maps", "kernels", "usable",
]

MAX_TOKENS = 1024  # the kernel's row buffer (kMaxTokens)
# The most a float32 forward keeps of softmax maps for its backward, per call: keeping them instead
# of recomputing saves the backward's scores product and exp, 2.0-2.3 of the kernel's 15.5-16 ms
# fwd+bwd on an AVX2 EPYC at B 256, N 49, d 24, where they take 11 MiB (ConViT-Ti at 32 px; at
# 224 px, N 197: 168 MiB)
KEPT_MAPS_BYTES = 256 << 20
_DISABLE_ENV = "LOCALITY_SEARCH_CPU_KERNELS"
# False: the core runs on torch ops (the benchmarks time both side by side)
USE_FUSED_KERNEL = True


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "locality-search" / "kernels"


def _bf16_isa_flags() -> Optional[list[str]]:
    """The -m flags for the bf16 kernel on this CPU, or None where it lacks the AVX-512 subsets it needs."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return None  # torch's own dispatch level: AVX-512 F, BW, VL and DQ present and enabled
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return None
    return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]


FP32_AVX2_FLAGS = ("-mavx2", "-mfma", "-ffp-contract=fast")  # the float32 kernel's 8-lane build


def _fp32_isa_flags() -> Optional[list[str]]:
    """The flags for the float32 kernel: 16 lanes with AVX-512, 8 with AVX2 (torch's AVX2 level
    implies FMA), None below that. FMA contraction on: the source writes a * b + c."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-mavx512f", *FP32_AVX2_FLAGS]
    if capability == "AVX2":
        return list(FP32_AVX2_FLAGS)
    return None


@dataclasses.dataclass(frozen=True)
class _Kernel:
    source: Path
    namespace: str  # torch.ops.<namespace>
    isa_flags: Callable[[], Optional[list[str]]]
    needs: str  # what isa_flags looks for, for the message where it finds none


_CSRC = Path(__file__).with_name("csrc")
_KERNELS = {
    torch.bfloat16: _Kernel(_CSRC / "attention_core.cpp", "locality_search", _bf16_isa_flags, "AVX512-BF16"),
    torch.float32: _Kernel(_CSRC / "attention_core_fp32.cpp", "locality_search_fp32", _fp32_isa_flags, "AVX2 and FMA"),
}
DTYPES = tuple(_KERNELS)  # the dtypes the core has a kernel for


def _compile_command(compiler: str, source: Path, output: Path, isa: list[str]) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, str(source), "-o", str(output), "-shared", "-fPIC", "-O3", "-std=c++20", "-fopenmp", *isa,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem", str(torch_dir / "include"), "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _build(kernel: _Kernel) -> Path:
    """The compiled library's path, building it unless a build for this source, torch and
    instruction set is cached. Raises RuntimeError saying why it cannot be built."""
    if os.environ.get(_DISABLE_ENV, "1").strip() == "0":
        raise RuntimeError(f"{_DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for Linux on x86-64 only, not {sys.platform} on {platform.machine()}")
    isa = kernel.isa_flags()
    if isa is None:
        raise RuntimeError(f"this CPU has no {kernel.needs} (torch dispatches "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (install g++; ./with-deps does)")
    source = kernel.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))  # + includes
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), " ".join(isa).encode(),
                                     compiler.encode()])).hexdigest()[:16]
    library = _cache_dir() / f"{kernel.source.stem}-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent trials: one builds, the others wait and load
        if library.exists():
            return library
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            output = Path(scratch) / library.name
            done = subprocess.run(_compile_command(compiler, kernel.source, output, isa), capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                first_error = next((line for line in done.stderr.splitlines() if "error" in line),
                                   done.stderr.strip()[-300:])
                raise RuntimeError(f"compiling {kernel.source.name} failed: {first_error}")
            atomic_write(library, lambda handle: handle.write(output.read_bytes()))
    return library


_build_errors: dict[torch.dtype, str] = {}


@functools.lru_cache(maxsize=None)
def kernels(dtype: torch.dtype = torch.bfloat16) -> Optional[Any]:
    """The ops of the `dtype` kernel (``attention_forward`` and ``attention_backward``, loaded), or
    None where it cannot be built here (`build_error` says why; warned once)."""
    kernel = _KERNELS[dtype]
    try:
        torch.ops.load_library(str(_build(kernel)))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        _build_errors[dtype] = str(error)
        if os.environ.get(_DISABLE_ENV, "1").strip() != "0":
            warnings.warn(f"the fused CPU attention kernel ({str(dtype).removeprefix('torch.')}) is not used ({error}); "
                          "the attention core runs on torch ops, slower", RuntimeWarning, stacklevel=2)
        return None
    ops = getattr(torch.ops, kernel.namespace)
    _register_flop_formulas(ops)
    return ops


def _register_flop_formulas(ops: Any) -> None:
    """What `torch.utils.flop_counter` counts for the kernels' forwards (a multiply-add is 2), as for
    the torch ops they replace: the trials' `flops` column must not depend on whether a kernel was
    built. The attention core: its two products (GPSA's mix and a mask are elementwise, uncounted
    on torch ops too). GPSA's fused layer: those and its two linears (q, k, v and the output). The
    Refiner: its expand, k x k taps per patch key and reduce per row. A linear's weight gradient
    (a training step counted in full), and bf16 inference's linear: the mm they replace."""
    @register_flop_formula(ops.attention_forward)
    def _attention(qkv_shape, *args, **kwargs) -> int:
        _, batch, heads, tokens, dim = qkv_shape
        return 2 * 2 * batch * heads * tokens * tokens * dim

    if hasattr(ops, "linear_weight_grad"):  # (a backward product: counted as the mm it replaces)
        @register_flop_formula(ops.linear_weight_grad)
        def _weight_grad(grad_shape, input_shape, **kwargs) -> int:
            return 2 * grad_shape[0] * grad_shape[1] * input_shape[1]

    if hasattr(ops, "linear_bf16"):  # bf16 inference's linear: the F.linear it replaces
        @register_flop_formula(ops.linear_bf16)
        def _linear_bf16(x_shape, packed_shape, *args, **kwargs) -> int:
            rows, in_features = x_shape
            return 2 * rows * in_features * packed_shape[1]

    if hasattr(ops, "gpsa_layer_forward"):  # GPSA's whole layer: its two linears and the core's products
        @register_flop_formula(ops.gpsa_layer_forward)
        def _gpsa_layer(x_shape, *args, **kwargs) -> int:
            batch, tokens, width = x_shape
            return 2 * batch * tokens * width * 4 * width + 2 * 2 * batch * tokens * tokens * width

    if hasattr(ops, "refine_forward"):
        @register_flop_formula(ops.refine_forward)
        def _refine(maps_shape, expand_shape, kernel_shape, reduce_shape, grid_h, grid_w, **kwargs) -> int:
            heads, rows, tokens = maps_shape
            expanded, k, _ = kernel_shape
            return 2 * rows * (expanded * heads * tokens + expanded * k * k * grid_h * grid_w + heads * expanded * tokens)


def build_error(dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """Why `kernels(dtype)` is None (after it was called), else None."""
    return _build_errors.get(dtype)


def _kernel_layout(t: torch.Tensor) -> bool:
    """Unit stride along the head dim; in bf16 also 32-bit aligned rows: that kernel reads bf16 pairs."""
    if t.stride(-1) != 1:
        return False
    return t.dtype != torch.bfloat16 or (all(stride % 2 == 0 for stride in t.stride()[:-1]) and t.data_ptr() % 4 == 0)


def available(dtype: torch.dtype, tokens: int) -> bool:
    """Whether a CPU core in `dtype` over `tokens` tokens can run on a kernel here (as `usable`,
    before qkv exists: the layout and head dim aside)."""
    return (USE_FUSED_KERNEL and dtype in _KERNELS and 1 <= tokens <= MAX_TOKENS
            and not torch.compiler.is_compiling() and kernels(dtype) is not None)


def usable(qkv: torch.Tensor) -> bool:
    """Whether the core runs on a kernel for `qkv` ((3, B, H, N, d), the projection's output
    permuted): bfloat16 (with an even head dim) or float32 on the CPU, at most MAX_TOKENS tokens, a
    layout it reads in place, outside torch.compile (which traces the torch ops instead), the
    kernel built here. The caller makes sure the core's GEMMs run in qkv's dtype
    (`_attention_core.gemm_dtype`)."""
    _, _, _, tokens, dim = qkv.shape
    # torch.compile first (`available` asks), before _kernel_layout reads a fake tensor's data pointer
    return (qkv.device.type == "cpu" and (dim % 2 == 0 or qkv.dtype != torch.bfloat16)
            and available(qkv.dtype, tokens) and _kernel_layout(qkv))


def keeps_maps(qkv: torch.Tensor) -> bool:
    """Whether the kernel's forward on `qkv` (as `usable`) keeps the softmax maps for the backward:
    float32 (the bf16 kernel always recomputes them), the maps within KEPT_MAPS_BYTES (an upper
    bound: rows padded to 16 floats)."""
    _, batch, heads, tokens, _ = qkv.shape
    return qkv.dtype == torch.float32 and kept_maps_fit(batch, heads, tokens)


def kept_maps_fit(batch: int, heads: int, tokens: int) -> bool:
    """Whether a float32 forward's softmax maps for `batch` x `heads` maps of `tokens` fit
    KEPT_MAPS_BYTES (an upper bound: rows padded to 16 floats)."""
    return batch * heads * tokens * -(-tokens // 16) * 16 * 4 <= KEPT_MAPS_BYTES


def d_out_for_kernel(d_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output's gradient in the kernel's dtype, in a layout it reads (as it comes, usually)."""
    d_out = d_out.to(dtype)
    return d_out if _kernel_layout(d_out) else d_out.contiguous()
