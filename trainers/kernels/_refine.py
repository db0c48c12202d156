"""`refine_maps`: the Refiner's refinement of attention maps (expand H -> rH heads, a k x k conv over
the key grid per query, reduce rH -> H) as one pass per query row on the float32 library
(`csrc/refiner_fp32.h`: all in registers and L1, k^2 multiply-adds per key where the torch paths'
GEMMs spend N). `ls_refiner.Refiner.choose_path` decides when it is the quicker way
(benchmarks/attention_blocks.py times them).
"""
import torch

from trainers.kernels import _library

__all__ = ["refine_maps", "refine_maps_usable"]

_MAX_KERNEL_HEADS = 64  # the kernel's per-vector arrays (kMaxRefinerHeads)


def refine_maps_usable(device: torch.device, tokens: int, expand: torch.Tensor, kernel: torch.Tensor,
                       reduce: torch.Tensor) -> bool:
    """Whether maps over `tokens` keys on `device` with these float32 weights can go to the library:
    on the CPU, at most 64 heads either side, the float32 library built (`cpu_library_available`:
    also off under torch.compile and with the kernels or the `libraries` backend switched off)."""
    return (device.type == 'cpu' and all(p.dtype == torch.float32 for p in (expand, kernel, reduce))
            and max(reduce.shape[0], expand.shape[0]) <= _MAX_KERNEL_HEADS
            and _library.cpu_library_available(torch.float32, tokens))


def refine_maps(maps: torch.Tensor, expand: torch.Tensor, kernel: torch.Tensor, reduce: torch.Tensor,
                grid_h: int, grid_w: int) -> torch.Tensor:
    """The refined maps (H, M, N) of float32 `maps` (H, M, N), differentiable in the maps and the
    weights: expand (rH, H), kernel (rH, k, k), reduce (H, rH), the patch keys on a grid_h x grid_w
    grid after the prefix keys. Only where `refine_maps_usable`."""
    return _RefineOnKernel.apply(maps.contiguous(), expand, kernel, reduce, grid_h, grid_w)


class _RefineOnKernel(torch.autograd.Function):
    """`Refiner.refine_rows` on the float32 kernel: (H, M, N) maps -> refined maps, and back the
    gradients of the maps and of expand, kernel and reduce (summed over rows in double)."""

    @staticmethod
    def forward(ctx, maps: torch.Tensor, expand: torch.Tensor, kernel: torch.Tensor, reduce: torch.Tensor,
                grid_h: int, grid_w: int) -> torch.Tensor:
        ctx.save_for_backward(maps, expand, kernel, reduce)
        ctx.grid = (grid_h, grid_w)
        return _library.cpu_library(torch.float32).refine_forward(maps, expand.contiguous(), kernel.contiguous(),
                                                                  reduce.contiguous(), grid_h, grid_w)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        maps, expand, kernel, reduce = ctx.saved_tensors
        d_maps, d_expand, d_kernel, d_reduce = _library.cpu_library(torch.float32).refine_backward(
            d_out.contiguous(), maps, expand.contiguous(), kernel.contiguous(), reduce.contiguous(), *ctx.grid)
        return d_maps, d_expand, d_kernel, d_reduce, None, None
