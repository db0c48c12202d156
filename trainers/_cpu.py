"""What the CPU can do that changes how a trial computes: bf16 in hardware or not; its
/proc/cpuinfo facts (vendor, family), which pick the float32 GEMM library (`trainers/kernels/_linear.py`);
and how many CPUs this process was given."""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["cpu_family", "cpu_has_native_bf16", "cpuinfo_field", "cpus_given"]


def cpuinfo_field(name: str) -> str | None:
    """The first /proc/cpuinfo line's value for `name` (e.g. "model name"), or None (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpus_given() -> int:
    """The CPUs this process may use: those it may run on (its affinity), fewer where
    OMP_NUM_THREADS says so. Ray sets OMP_NUM_THREADS to a task's or trial's CPU request, so in
    a search this is the trial's `resources.cpus`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # "8" or a nested "8,2"
    if omp.isdigit() and int(omp) > 0:
        cpus = min(cpus, int(omp))
    return max(1, cpus)


def cpu_family() -> int | None:
    """The x86 CPU family (/proc/cpuinfo's "cpu family", e.g. 25 or 26 on AMD), or None where it has none."""
    family = cpuinfo_field("cpu family")
    return int(family) if family and family.isdigit() else None


# oneDNN ISA levels (ONEDNN_MAX_CPU_ISA) that include bf16 dot products (AVX512-BF16) or AMX tiles
_ONEDNN_BF16_LEVELS = {
    "ALL", "DEFAULT",
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
}


@functools.lru_cache(maxsize=None)
def _hardware_bf16() -> bool:
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # absent in a torch too old to tell
    return torch.backends.mkldnn.is_available() and any(
        bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


@torch.compiler.assume_constant_result  # torch.compile: a fact of the machine, not traced
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 dot products or AMX tiles) and
    oneDNN may use it
    (``ONEDNN_MAX_CPU_ISA``, when set, names such a level).

    With it, bf16 matmuls run faster than float32 ones, so `train.precision: auto` trains in bf16
    and GPSA's attention core multiplies in bf16 under autocast; without it oneDNN emulates bf16,
    far slower than float32 (benchmarks/training_precision.py measures both)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in _ONEDNN_BF16_LEVELS:
        return False
    return _hardware_bf16()
