"""The C++ kernel libraries: built with `torch.utils.cpp_extension.load` on first use, loaded as
``torch.ops.locality_search_fp32`` (`csrc/attention_core_fp32.cpp`: float32, AVX2 + FMA in 8 lanes
or AVX-512 in 16) and ``torch.ops.locality_search`` (`csrc/attention_core.cpp`: bf16, AVX512-BF16).

The float32 library holds the attention core (optionally GPSA's mix with a positional attention or
GMM's score mask), GPSA's whole layer, the Refiner's map refinement, a linear layer's weight gradient
and the blocks' layer norm; the bf16 one the attention core, the layer norm and bf16 inference's
linear. Each op reads its inputs in the caller's strides (the projection's (B, N, 3, H, d) output
needs no layout copy) and recomputes the maps in the backward from two numbers per row, except
that in float32 the forward keeps the softmax maps where they are small (`keeps_maps`).

Built once per machine into ``$XDG_CACHE_HOME/locality-search/kernels/<name>``, the name holding
the source, the variant and a hash of the sources, the -m flags and torch's version, so an edit
rebuilds; cpp_extension's lock file makes concurrent trials wait for one build. Where a library
cannot be built (no compiler, another OS, a CPU without its instructions) `cpu_library` returns None
with one warning saying why, and the ops run on torch; ``LOCALITY_SEARCH_CPU_KERNELS=0`` chooses
that outright, and the `libraries` backend off (`_switch.backends`) for a block.
`build_cpu_library` builds another source (or a second copy of a library) the same way.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from trainers.kernels._switch import DISABLE_ENV, enabled, selected_backends

__all__ = [
    "DTYPES", "KEPT_MAPS_BYTES", "MAX_TOKENS", "build_cpu_library", "cpu_library", "cpu_library_available",
    "cpu_library_error", "d_out_for_kernel", "kept_maps_fit", "keeps_maps", "load_library", "prebuild_cpu_kernels",
    "usable",
]

MAX_TOKENS = 1024  # the kernel's row buffer (kMaxTokens)
# The most a float32 forward keeps of softmax maps for its backward, per call: keeping them saves
# the backward's scores product and exp (benchmarks/gpsa_layer.py: `ratio_kept_maps_gain`; the
# `kept_maps` backend off keeps none)
KEPT_MAPS_BYTES = 256 << 20


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

    def variant(self, isa: Sequence[str]) -> str:
        """The build's name part: bf16, avx512 (16 float32 lanes) or avx2 (8)."""
        if self.namespace == "locality_search":
            return "bf16"
        return "avx512" if "-mavx512f" in isa else "avx2"


_CSRC = Path(__file__).with_name("csrc")
_KERNELS = {
    torch.bfloat16: _Kernel(_CSRC / "attention_core.cpp", "locality_search", _bf16_isa_flags, "AVX512-BF16"),
    torch.float32: _Kernel(_CSRC / "attention_core_fp32.cpp", "locality_search_fp32", _fp32_isa_flags, "AVX2 and FMA"),
}
DTYPES = tuple(_KERNELS)  # the dtypes the core has a kernel for


def _source_key(source: Path, flags: Sequence[str]) -> str:
    """A hash of what a build depends on: the source and every header beside it, the flags, torch."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    return hashlib.sha256(b"\0".join([source.read_bytes(), headers, " ".join(flags).encode(),
                                      torch.__version__.encode()])).hexdigest()[:16]


def load_library(source: Path, variant: str, flags: Sequence[str]) -> None:
    """Build `source` with `flags` (-m flags, defines) unless cached, and load it into torch.ops.
    Raises RuntimeError saying why it cannot be built."""
    import contextlib
    import io
    import logging

    # its import warns on a machine without CUDA, which these CPU libraries do not need: through
    # logging (newer torch), or printed to stderr (torch 2.4-2.6), which would break a command's
    # one-line error
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for Linux on x86-64 only, not {sys.platform} on {platform.machine()}")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        raise RuntimeError("no C++ compiler (install g++; ./with-deps does)")
    name = f"{source.stem}_{variant}_{_source_key(source, flags)}"
    build_directory = _cache_dir() / name
    build_directory.mkdir(parents=True, exist_ok=True)
    staged = _staged(source, build_directory)
    try:
        cpp_extension.load(name=name, sources=[str(staged)], build_directory=str(build_directory),
                           extra_cflags=["-O3", "-std=c++20", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except subprocess.CalledProcessError as error:  # (cpp_extension's own, wrapped in RuntimeError)
        raise RuntimeError(f"compiling {source.name} failed: {error}") from error
    except RuntimeError as error:
        text = str(error)
        first_error = next((line.strip() for line in text.splitlines() if "error" in line.lower()), text[-300:])
        raise RuntimeError(f"compiling {source.name} failed: {first_error}") from error


def _staged(source: Path, build_directory: Path) -> Path:
    """``source`` and the headers beside it, copied into ``build_directory`` (whose name holds their
    hash): ninja's build file names the source's path, so building from the checkout rebuilt the
    cached library whenever another checkout (a clone, a worktree, CI) built the same source."""
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        target = build_directory / path.name
        data = path.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            temporary = build_directory / f".{path.name}.{os.getpid()}.tmp"
            temporary.write_bytes(data)
            os.replace(temporary, target)  # whole, whichever process copies it
    return build_directory / source.name


def _isa(kernel: _Kernel) -> list[str]:
    """`kernel`'s -m flags for this CPU, or RuntimeError saying what it lacks."""
    isa = kernel.isa_flags()
    if isa is None:
        raise RuntimeError(f"this CPU has no {kernel.needs} (torch dispatches "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    return isa


def _build(kernel: _Kernel) -> None:
    """Build and load `kernel`'s library for this CPU, or raise RuntimeError saying why not."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        raise RuntimeError(f"{DISABLE_ENV}=0")
    isa = _isa(kernel)
    load_library(kernel.source, kernel.variant(isa), isa)


def build_cpu_library(dtype: torch.dtype, namespace: str, *, source: Optional[Path] = None,
                      defines: Sequence[str] = (), avx2: bool = False) -> Any:
    """Build (or load from the cache) a C++ source as the `dtype` library is built, its ops
    registered as ``torch.ops.<namespace>`` (the source's ``ATTENTION_LIBRARY`` macro), and return
    them: the `dtype` library's own source by default (a second copy of it), or `source`, a file
    that includes its headers (benchmarks/peak); `defines` more -D flags. The -m flags are this
    CPU's for that library, or with `avx2` (float32 only) its 8-lane AVX2 build's, the code an
    AVX2-only CPU runs. Raises RuntimeError saying why it cannot be built here (no compiler, a CPU
    without the instructions). Not affected by the switches: nothing runs these ops but the caller."""
    kernel = _KERNELS[dtype]
    if avx2 and dtype != torch.float32:
        raise ValueError(f"build_cpu_library({dtype}, avx2=True): only the float32 library has an AVX2 build")
    isa = list(FP32_AVX2_FLAGS) if avx2 else _isa(kernel)
    load_library(source or kernel.source, kernel.variant(isa), [*isa, f"-DATTENTION_LIBRARY={namespace}", *defines])
    return getattr(torch.ops, namespace)


_build_errors: dict[torch.dtype, str] = {}


@functools.lru_cache(maxsize=None)
def cpu_library(dtype: torch.dtype = torch.bfloat16) -> Optional[Any]:
    """The ops of the `dtype` library (float32 or bf16; ``attention_forward``, ``attention_backward``
    and the rest, loaded: built on the first call), or None where it cannot be built here, or for a
    dtype without a library (`cpu_library_error` says why; warned once). Whether the ops run is
    `cpu_library_available`'s question: the switches aside, this only says the library is here."""
    kernel = _KERNELS.get(dtype)
    if kernel is None:
        _build_errors[dtype] = f"no C++ library for {dtype} (only {', '.join(map(str, DTYPES))})"
        return None
    try:
        _build(kernel)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        _build_errors[dtype] = str(error)
        if os.environ.get(DISABLE_ENV, "1").strip() != "0":
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


def prebuild_cpu_kernels() -> dict:
    """Build (or load from the cache) the libraries this CPU can run, before trials start, so they
    do not wait for a build: {dtype: None where built, else why not}. The bf16 library only where
    the CPU multiplies bf16 in hardware (elsewhere it could not run)."""
    from trainers._cpu import cpu_has_native_bf16

    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else [])
    return {dtype: None if cpu_library(dtype) is not None else cpu_library_error(dtype) for dtype in dtypes}


def cpu_library_error(dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """Why `cpu_library(dtype)` is None (after it was called), else None."""
    return _build_errors.get(dtype)


def _kernel_layout(t: torch.Tensor) -> bool:
    """Unit stride along the head dim; in bf16 also 32-bit aligned rows: that kernel reads bf16 pairs."""
    if t.stride(-1) != 1:
        return False
    return t.dtype != torch.bfloat16 or (all(stride % 2 == 0 for stride in t.stride()[:-1]) and t.data_ptr() % 4 == 0)


def cpu_library_available(dtype: torch.dtype, tokens: int = 1) -> bool:
    """Whether an attention core, GPSA's fused layer or the Refiner's refinement in `dtype` over
    `tokens` tokens can run on a library here now: the kernels `enabled()` with the `libraries`
    backend on, outside torch.compile, at most MAX_TOKENS tokens, the `dtype` library built (on
    this first call where it is not yet; `cpu_library`). For the core, as `usable` before qkv
    exists (the layout and head dim aside)."""
    return (enabled() and selected_backends().libraries and dtype in _KERNELS and 1 <= tokens <= MAX_TOKENS
            and not torch.compiler.is_compiling() and cpu_library(dtype) is not None)


def usable(qkv: torch.Tensor) -> bool:
    """Whether the core runs on a kernel for `qkv` ((3, B, H, N, d), the projection's output
    permuted): bfloat16 (with an even head dim) or float32 on the CPU, at most MAX_TOKENS tokens, a
    layout it reads in place, outside torch.compile (which traces the torch ops instead), the
    kernel built here. The caller makes sure the core's GEMMs run in qkv's dtype
    (`_attention_core.gemm_dtype`)."""
    _, _, _, tokens, dim = qkv.shape
    # torch.compile first (`cpu_library_available` asks), before _kernel_layout reads a fake tensor's data pointer
    return (qkv.device.type == "cpu" and (dim % 2 == 0 or qkv.dtype != torch.bfloat16)
            and cpu_library_available(qkv.dtype, tokens) and _kernel_layout(qkv))


def keeps_maps(qkv: torch.Tensor) -> bool:
    """Whether the kernel's forward on `qkv` (as `usable`) keeps the softmax maps for the backward:
    float32 (the bf16 kernel always recomputes them), the maps within KEPT_MAPS_BYTES (an upper
    bound: rows padded to 16 floats)."""
    _, batch, heads, tokens, _ = qkv.shape
    return qkv.dtype == torch.float32 and kept_maps_fit(batch, heads, tokens)


def kept_maps_fit(batch: int, heads: int, tokens: int) -> bool:
    """Whether a float32 forward keeps its softmax maps for `batch` x `heads` maps of `tokens`: the
    `kept_maps` backend on, the maps within KEPT_MAPS_BYTES (an upper bound: rows padded to 16
    floats)."""
    return selected_backends().kept_maps and batch * heads * tokens * -(-tokens // 16) * 16 * 4 <= KEPT_MAPS_BYTES


def d_out_for_kernel(d_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output's gradient in the kernel's dtype, in a layout it reads (as it comes, usually)."""
    d_out = d_out.to(dtype)
    return d_out if _kernel_layout(d_out) else d_out.contiguous()
