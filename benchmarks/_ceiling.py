"""How far a speed-up over a baseline can go here: the baseline's counted arithmetic at the
matmul peak this machine reaches, measured in the same rotation.

A workload of F flops on a machine whose best matmul runs at R flop/s takes at least F / R
seconds, however it is written. Against a baseline that does the same arithmetic in T seconds,
no implementation beats it by more than T R / F (`arithmetic_ceiling`). R is measured, not taken
from a data sheet: `PeakMatmul`, a large square matmul, is timed as one more contender in the
benchmark's rotation, so it sees the same load drifts and clock as the workloads, and its rate is
what the GEMM library reaches while they run (on the Zen 4 VM: 196-201 GFLOP/s in float32, about
2 cores x 32 flops a cycle at 3.1 GHz; 437-441 in bf16).

The ceiling is loose: it credits the workload's small products (49 x 49 x 24 in GPSA) with the
rate of a 1024^3 one, and its softmax, norms and copies with no time at all. A target above it is
out of reach of any code doing the same arithmetic; one close below it needs nearly all of the
machine's peak, throughout.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["PeakMatmul", "counted_flops", "arithmetic_ceiling", "describe", "PEAK_SIZE"]

# the matmul's side: at 1024 on the Zen 4 VM oneDNN runs at its largest sizes' rate (196 vs 193
# GFLOP/s at 2048, float32) in a twelfth of the time; on a GPU, large enough to fill it
PEAK_SIZE = {"cpu": 1024, "cuda": 8192}


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
        self.flops = 2 * n ** 3
        self._operands = {precision: (a.to(device, dtype), b.to(device, dtype))
                          for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        self._out = {precision: torch.empty(n, n, device=device, dtype=a_.dtype)
                     for precision, (a_, _) in self._operands.items()}

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
    """The baseline's arithmetic at the measured peak: the rate (flop/s) the peak matmul ran at
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


def describe(ceiling: dict[str, float], *, baseline: str, what: str, column: str = "") -> str:
    """One line for a benchmark's report; `column` names the timing column ("bf16", "inference fp32")."""
    line = (f"ceiling{f' ({column})' if column else ''}: {baseline}'s {ceiling['baseline_flops'] / 1e9:.2f} GFLOP at "
            f"the matmul peak measured alongside ({ceiling['peak_flop_per_s'] / 1e9:.0f} GFLOP/s) take "
            f"{ceiling['floor_s'] * 1e3:.2f} ms -> no {what} doing this arithmetic beats {baseline} by more than "
            f"{ceiling['ratio']:.2f}x here")
    if "ours_share_of_peak" in ceiling:
        line += f"; ours runs it at {ceiling['ours_share_of_peak']:.0%} of that peak"
    return line
