"""How far a speed-up over a baseline can go here: the baseline's counted arithmetic at this
machine's peak, measured in the same rotation.

A workload of F flops on a machine that does at most R flop/s takes at least F / R seconds,
however it is written. Against a baseline that does the same arithmetic in T seconds, no
implementation beats it by more than T R / F (`arithmetic_ceiling`). R is measured, not taken from
a data sheet, as one more contender in the benchmark's rotation, so it sees the same load drifts
and clocks as the workloads:

- `MultiplyAddPeak` (CPU, where the kernels are built): every thread issuing nothing but the
  multiply-add the kernels' GEMMs are made of (float32 FMA; bf16 vdpbf16ps). No code doing the
  arithmetic in that precision on these cores runs faster: the strict ceiling. On the Zen 4 VM:
  242-247 GFLOP/s in float32 (2 cores x 32 flops a cycle at 3.8-3.9 GHz), 446-465 in bf16.
- `PeakMatmul`: a large square matmul on torch's GEMM library, what a library reaches at its best
  shapes (182-196 GFLOP/s float32 and 387-441 bf16 there); on a GPU the only peak timed.

The ceiling is loose: it credits the workload's small products (49 x 49 x 24 in GPSA) with the
peak rate, and its softmax, norms and copies with no time at all. A target above it is out of
reach of any code doing the same arithmetic; one close below it needs nearly all of the peak,
throughout.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["MultiplyAddPeak", "PeakMatmul", "counted_flops", "arithmetic_ceiling", "ceilings", "describe", "PEAK_SIZE"]

# the matmul's side: at 1024 on the Zen 4 VM torch's GEMM runs at its largest sizes' rate (196 vs
# 193 GFLOP/s at 2048, float32) in an eighth of the time; on a GPU, large enough to fill it
PEAK_SIZE = {"cpu": 1024, "cuda": 8192}


class MultiplyAddPeak:
    """`peak(precision)`: every torch thread running `ITERATIONS` steps of independent multiply-add
    chains of the attention kernels' library's instruction of that precision (`benchmarks/peak`);
    `flops[precision]` what one call does, for the `precisions` asked whose kernel is built here
    (asking only for those: a kernel that cannot be built warns)."""

    ITERATIONS = 1 << 20  # 4.4-4.7 ms a call on the Zen 4 VM, fp32 and bf16

    def __init__(self, precisions: Sequence[str]) -> None:
        from benchmarks.peak import peak_ops
        from trainers import kernels

        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        # where the models' library of that precision is built: its instruction runs here
        self._ops = {precision: ops for precision in precisions
                     if kernels.cpu_library(dtypes[precision]) is not None
                     and (ops := peak_ops(dtypes[precision])) is not None}
        # the op counts what it did: one iteration's flops, on as many threads as the timed calls
        self.flops = {precision: int(ops.multiply_add_peak(1)) * self.ITERATIONS for precision, ops in self._ops.items()}

    def __contains__(self, precision: str) -> bool:
        return precision in self._ops

    def __call__(self, precision: str) -> None:
        self._ops[precision].multiply_add_peak(self.ITERATIONS)


class PeakMatmul:
    """An n x n x n matmul, `peak(precision)`: float32 operands for "fp32", bf16 for "bf16" (no
    cast timed), into a preallocated output (no allocation timed), without autograd. A forward
    product only: timed in a training step's shape (a backward from `.sum()`'s expanded gradient,
    fresh gradient tensors) it read 5-8% slower on the Zen 4 VM, which would understate the peak
    and so the ceiling."""

    def __init__(self, n: int, device: str | torch.device = "cpu"):
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=generator)
        b = torch.randn(n, n, generator=generator) / n ** 0.5
        self._operands = {precision: (a.to(device, dtype), b.to(device, dtype))
                          for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        self._out = {precision: torch.empty(n, n, device=device, dtype=a_.dtype)
                     for precision, (a_, _) in self._operands.items()}
        self.flops = {precision: 2 * n ** 3 for precision in self._operands}  # what one call does

    def __call__(self, precision: str) -> None:
        a, b = self._operands[precision]
        with torch.no_grad():
            torch.mm(a, b, out=self._out[precision])


def counted_flops(run: Callable[[], object]) -> int:
    """The flops `torch.utils.flop_counter` counts for one call of `run` (its matmuls and
    convolutions, a multiply-add 2; a backward `run` does, counted too). Ops it has no formula for
    count 0: count a workload of torch ops (the baseline), not one of custom kernels without
    backward formulas."""
    with FlopCounterMode(display=False) as counter:
        run()
    return int(counter.get_total_flops())


def arithmetic_ceiling(*, baseline_flops: int, baseline_s: float, peak_flops: int, peak_s: float,
                       ours_s: float | None = None) -> dict[str, float]:
    """The baseline's arithmetic at a measured peak: the rate (flop/s) the peak ran at
    (`peak_flops` in `peak_s`), the least time that arithmetic takes at it (`floor_s`), the
    highest ratio baseline / any implementation (`ratio`), and given our time, the share of the
    peak ours runs the same arithmetic at (`ours_share_of_peak`: floor_s / ours_s)."""
    if min(baseline_flops, peak_flops) <= 0 or min(baseline_s, peak_s) <= 0:
        raise ValueError("arithmetic_ceiling needs positive flops and times "
                         f"(baseline {baseline_flops} in {baseline_s} s, peak {peak_flops} in {peak_s} s)")
    rate = peak_flops / peak_s
    floor_s = baseline_flops / rate
    out = {"peak_flop_per_s": rate, "baseline_flops": float(baseline_flops), "floor_s": floor_s,
           "ratio": baseline_s / floor_s}
    if ours_s is not None:
        out["ours_share_of_peak"] = floor_s / ours_s
    return out


def ceilings(*, baseline_flops: int, baseline_s: float, ours_s: float,
             peaks: dict[str, tuple[int, float]]) -> dict[str, dict[str, float]]:
    """`arithmetic_ceiling` at each peak timed: kind ("multiply_add", "matmul") -> (its flops, its median s)."""
    return {kind: arithmetic_ceiling(baseline_flops=baseline_flops, baseline_s=baseline_s, peak_flops=flops,
                                     peak_s=seconds, ours_s=ours_s)
            for kind, (flops, seconds) in peaks.items()}


_PEAK_NAMES = {"multiply_add": "this CPU's multiply-add peak", "matmul": "a large matmul's rate"}


def describe(ceilings_: dict[str, dict[str, float]], *, baseline: str, what: str, column: str = "") -> str:
    """One line for a benchmark's report, the strictest ceiling first; `column` names the timing
    column ("bf16", "inference fp32")."""
    parts = []
    for kind, c in ceilings_.items():
        if not parts:
            parts.append(f"ceiling{f' ({column})' if column else ''}: {baseline}'s {c['baseline_flops'] / 1e9:.2f} GFLOP "
                         f"take {c['floor_s'] * 1e3:.2f} ms at {_PEAK_NAMES[kind]} ({c['peak_flop_per_s'] / 1e9:.0f} "
                         f"GFLOP/s, timed alongside) -> no {what} doing this arithmetic beats {baseline} by more than "
                         f"{c['ratio']:.2f}x here; ours runs it at {c['ours_share_of_peak']:.0%} of that peak")
        else:
            parts.append(f"at {_PEAK_NAMES[kind]} ({c['peak_flop_per_s'] / 1e9:.0f} GFLOP/s) {c['ratio']:.2f}x, "
                         f"ours {c['ours_share_of_peak']:.0%}")
    return "; ".join(parts)
