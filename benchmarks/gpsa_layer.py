"""One GPSA layer, forward + backward: timm's GPSA vs trainers.models.ls_convit.GPSA.

    python -m benchmarks.gpsa_layer                      # batch 256, 49 tokens, dim 96, 4 heads; CPU (+ CUDA)
    python -m benchmarks.gpsa_layer --device cpu --repeats 30

Both layers hold the same weights (ours loads timm's state dict) and see the same input; they are
timed alternately after a warm-up, one step of each contender per round, each round in a new
(seeded) order (`_env.shuffled_rounds`), so drifts in machine load hit all alike and none always
runs right after the same other. Reports the median of each and the ratio timm / ours (> 1: ours
is faster), and writes benchmarks/results/gpsa_layer-<device>.json.

bf16 column (on by default on CUDA and on a CPU with bf16 hardware; --no-bf16 skips it, --bf16
forces it where bf16 is emulated): the same two layers, fp32 weights and
input, each under `torch.autocast(device, dtype=torch.bfloat16)` (as the trainer's `precision:
bf16`), timed in the same rounds as the fp32 steps (timm and ours in each precision). Three ratios:
  ratio_timm_over_ours            fp32 vs fp32 (like for like; the original key)
  ratio_timm_over_ours_bf16       bf16 vs bf16 (like for like)
  ratio_timm_fp32_over_ours_bf16  timm in fp32 vs ours in bf16: a PRECISION CHANGE, not like for like

Ours apart (same rotation, fp32, CPU, where the float32 kernel is built): the same layer with its
projections and its core as separate ops instead of the fused layer (`trainers/kernels/_gpsa_layer.py`,
which runs them a few images at a time in one op per direction): `ratio_fused_layer_gain` = apart /
ours.

Ours on torch ops (same rotation, each precision, CPU, where a kernel is built): the same layer
with its attention core on torch ops instead of the fused kernels
(`trainers/kernels/_library.py`: float32, and bf16 on bf16 hardware):
`ratio_fused_kernel_gain[_bf16]` = torch ops / the kernel (in fp32 against ours apart: the core's
gain alone).

Ours recomputing its maps (same rotation, fp32, where the float32 kernel is built): the same layer
with the kernel's forward keeping no softmax maps for the backward (`KEPT_MAPS_BYTES` 0), so the
backward recomputes them as it does over that budget: `ratio_kept_maps_gain` = recomputing / ours.

Ours with MKL's float32 projections (same rotation, fp32, on a CPU where `trainers/kernels/_linear.py`
puts them on oneDNN: AVX-512 where MKL runs AVX2 code, AMD's Zen 4 and 5): the same layer apart with torch's
`F.linear` for its projections, `ratio_onednn_linear_gain` = MKL / oneDNN (both apart), and
`ratio_timm_over_ours_mkl_linear` (timm / ours on the GEMM library timm uses). There too, where the
float32 kernel is built, ours with the weight gradients of its projections on oneDNN or MKL instead of
the kernel's `linear_weight_grad` (`_linear._USE_WEIGHT_GRAD_KERNEL` off): `ratio_weight_grad_kernel_gain`.

The floor (same rotation, each precision): our layer's projections alone, forward + backward (the
q/k/v matmul and the output projection, with the shapes and upstream gradients the layer has), as
ops of their own. They are the same products as timm's (its qk and v are ours concatenated; on
oneDNN and the weight-grad kernel where ours are), so no attention core, however fast, can take
the layer apart below them: `ratio_bound` = timm / floor is the best ratio reachable that way. The
fused layer runs the same products on the kernel's tiles with their operands in cache, so it is
not bound by this floor, only by the products' arithmetic.

The ceilings (`_ceiling`; same rotation, each precision): timm's layer step does the flops
`torch.utils.flop_counter` counts for it (its per-image positional projection included, under 1%
of them); two peaks timed as contenders give the most flops a second this machine does:
`multiply_add` (CPU, where the kernel of the precision is built), its threads issuing nothing but
the multiply-adds the kernels' GEMMs are made of, the strict ceiling; `matmul`, a 1024^3 matmul
(8192^3 on CUDA), what torch's GEMM library reaches. `ceiling[_bf16]` per peak: that arithmetic's
least time at it (`floor_s`), `ratio` = timm / that time, the most any layer doing the same
products could reach here, and `ours_share_of_peak`, the share of the peak ours runs it at.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import ModuleType
from typing import Callable

import torch
from timm.models.convit import GPSA as TimmGPSA

from benchmarks._ceiling import PEAK_SIZE, MultiplyAddPeak, PeakMatmul, ceilings, counted_flops, describe
from benchmarks._env import (add_malloc_option, autocast, bf16_by_default, parse_and_set_up, shuffled_rounds, sync,
                            write_result)
from trainers.kernels import _gpsa, _gpsa_layer, _library, _linear
from trainers.models.ls_convit import GPSA


def _step(layer: torch.nn.Module, x: torch.Tensor, precision: str = "fp32") -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with autocast(x.device, precision):
        y = layer(x)
    y.float().sum().backward()  # .float(): a no-op in fp32


def _step_with(*settings: tuple[ModuleType, str, object]) -> Callable[[GPSA, torch.Tensor, str], None]:
    """`_step` with modules' settings (module, name, value) changed for the step (and restored): a
    path of ours off."""
    def step(layer: GPSA, x: torch.Tensor, precision: str = "fp32") -> None:
        saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
        for module, name, value in settings:
            setattr(module, name, value)
        try:
            _step(layer, x, precision)
        finally:
            for module, name, value in saved:
                setattr(module, name, value)
    return step


_APART = (_gpsa_layer, "_USE_FUSED_LAYER", False)  # the projections and the core as separate ops
_apart_step = _step_with(_APART)
_torch_ops_step = _step_with((_library, "_USE_LIBRARIES", False))  # the core on torch ops (so apart)
_recomputing_step = _step_with((_library, "KEPT_MAPS_BYTES", 0))  # the float32 kernel keeping no maps
# apart, the float32 projections on MKL (torch's default), and their weight grads on oneDNN/MKL
_mkl_linear_step = _step_with(_APART, (_linear, "_USE_ONEDNN_FP32", False))
_library_weight_grad_step = _step_with(_APART, (_linear, "_USE_WEIGHT_GRAD_KERNEL", False))


def _projections_step(layer: GPSA, x: torch.Tensor, z: torch.Tensor, precision: str = "fp32") -> None:
    """The layer's matmuls without its attention core: q, k, v from x and the output projection of z
    (the core's output shape), forward + backward with upstream gradients of ones."""
    layer.zero_grad(set_to_none=True)
    x.grad = z.grad = None
    with autocast(x.device, precision):
        qkv = _gpsa._qkv(x, layer.qk, layer.v, layer._frozen_cache)  # (B, N, 3C)
        out = layer.proj(z)  # (B, N, C)
    torch.autograd.backward((qkv, out), (torch.ones_like(qkv), torch.ones_like(out)))


def _time(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def run(*, batch: int, tokens: int, dim: int, heads: int, repeats: int, warmup: int, device: str,
        bf16: bool = True) -> dict:
    dev = torch.device(device)
    torch.manual_seed(0)
    ref = TimmGPSA(dim, num_heads=heads, locality_strength=1.0).to(dev)
    ref.local_init()
    with torch.no_grad():  # move off the init so content and position both matter
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = GPSA(dim, num_heads=heads).to(dev)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(batch, tokens, dim, device=dev, requires_grad=True)
    with torch.no_grad():
        max_abs_diff = (ref(x) - ours(x)).abs().max().item()
        if bf16:
            with autocast(dev, "bf16"):
                y_ref, y_ours = ref(x).float(), ours(x).float()
            max_abs_diff_bf16 = (y_ref - y_ours).abs().max().item()
            max_abs_out = y_ref.abs().max().item()

    z = torch.randn(batch, tokens, dim, device=dev, requires_grad=True)  # the core's output, for the floor
    peak = PeakMatmul(PEAK_SIZE[dev.type], dev)
    precisions = ["fp32", "bf16"] if bf16 else ["fp32"]
    multiply_add_peak = MultiplyAddPeak(precisions if dev.type == "cpu" else [])
    steps: dict[str, Callable[[str], None]] = {
        "timm": lambda precision: _step(ref, x, precision),
        "ours": lambda precision: _step(ours, x, precision),
        "floor": lambda precision: _projections_step(ours, x, z, precision),
        "matmul_peak": peak,
    }
    if multiply_add_peak.flops:
        steps["multiply_add_peak"] = multiply_add_peak
    kernel_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}
    fused_kernel = {precision: dev.type == "cpu" and _library.kernels(kernel_dtype[precision]) is not None
                    for precision in precisions}
    if any(fused_kernel.values()):
        steps["ours_torch_ops"] = lambda precision: _torch_ops_step(ours, x, precision)
    if fused_kernel["fp32"]:
        steps["ours_apart"] = lambda precision: _apart_step(ours, x, precision)
        steps["ours_recomputing"] = lambda precision: _recomputing_step(ours, x, precision)
    onednn_linear = dev.type == "cpu" and _linear.onednn_beats_mkl_here()
    if onednn_linear:
        steps["ours_mkl_linear"] = lambda precision: _mkl_linear_step(ours, x, precision)
        if fused_kernel["fp32"]:
            steps["ours_library_weight_grad"] = lambda precision: _library_weight_grad_step(ours, x, precision)
    # (the fused layer is float32's; the bf16 kernel always recomputes; bf16 linears are oneDNN's anyway)
    fp32_only = ("ours_apart", "ours_recomputing", "ours_mkl_linear", "ours_library_weight_grad")
    contenders = [(precision, name) for precision in precisions for name in steps  # the rotation
                  if (name not in fp32_only or precision == "fp32")
                  and (name != "multiply_add_peak" or precision in multiply_add_peak)]
    for _ in range(warmup):
        for precision, name in contenders:
            steps[name](precision)
    times: dict[str, dict[str, list[float]]] = {precision: {} for precision in precisions}
    for precision, name in contenders:
        times[precision][name] = []
    for round_ in shuffled_rounds(contenders, repeats):
        for precision, name in round_:
            times[precision][name].append(_time(lambda: steps[name](precision), dev))
    med = {precision: {name: statistics.median(ts) for name, ts in by_name.items()}
           for precision, by_name in times.items()}
    ceiling = {precision: ceilings(
        baseline_flops=counted_flops(lambda: _step(ref, x, precision)), baseline_s=med[precision]["timm"],
        ours_s=med[precision]["ours"],
        peaks={kind: (flops, med[precision][name]) for kind, name, flops in (
            ("multiply_add", "multiply_add_peak", multiply_add_peak.flops.get(precision)),
            ("matmul", "matmul_peak", peak.flops[precision])) if name in med[precision]})
        for precision in precisions}
    out = {
        "config": dict(batch=batch, tokens=tokens, dim=dim, heads=heads, repeats=repeats, warmup=warmup,
                       device=str(dev), dtype="float32", what="one GPSA layer, forward + backward",
                       precisions=precisions,
                       bf16="torch.autocast(bfloat16) around the forward; fp32 weights and input" if bf16 else None),
        "median_s": med["fp32"],
        "times_s": times["fp32"],
        "ratio_timm_over_ours": med["fp32"]["timm"] / med["fp32"]["ours"],
        "ratio_bound": med["fp32"]["timm"] / med["fp32"]["floor"],
        "ceiling": ceiling["fp32"],
        "max_abs_output_diff": max_abs_diff,
        "fused_kernel": fused_kernel if dev.type == "cpu" else None,
        "fused_kernel_unavailable_because": None if dev.type != "cpu" else {
            precision: _library.build_error(kernel_dtype[precision]) for precision in precisions},
    }
    if fused_kernel["fp32"]:
        out["ratio_fused_layer_gain"] = med["fp32"]["ours_apart"] / med["fp32"]["ours"]
        out["ratio_fused_kernel_gain"] = med["fp32"]["ours_torch_ops"] / med["fp32"]["ours_apart"]
        out["ratio_kept_maps_gain"] = med["fp32"]["ours_recomputing"] / med["fp32"]["ours"]
    if onednn_linear:
        out["ratio_onednn_linear_gain"] = med["fp32"]["ours_mkl_linear"] / med["fp32"]["ours_apart"]
        out["ratio_timm_over_ours_mkl_linear"] = med["fp32"]["timm"] / med["fp32"]["ours_mkl_linear"]
        if "ours_library_weight_grad" in med["fp32"]:
            out["ratio_weight_grad_kernel_gain"] = med["fp32"]["ours_library_weight_grad"] / med["fp32"]["ours_apart"]
    if bf16:
        out.update({
            "median_s_bf16": med["bf16"],
            "times_s_bf16": times["bf16"],
            "ratio_timm_over_ours_bf16": med["bf16"]["timm"] / med["bf16"]["ours"],
            "ratio_timm_fp32_over_ours_bf16": med["fp32"]["timm"] / med["bf16"]["ours"],
            "ratio_ours_fp32_over_ours_bf16": med["fp32"]["ours"] / med["bf16"]["ours"],
            "ratio_bound_bf16": med["bf16"]["timm"] / med["bf16"]["floor"],
            "ceiling_bf16": ceiling["bf16"],
            "max_abs_output_diff_bf16": max_abs_diff_bf16,
            **({"ratio_fused_kernel_gain_bf16": med["bf16"]["ours_torch_ops"] / med["bf16"]["ours"]}
               if fused_kernel["bf16"] else {}),
            "max_abs_output_bf16": max_abs_out,
            "ratios": {
                "fp32 timm / fp32 ours (like for like)": med["fp32"]["timm"] / med["fp32"]["ours"],
                "bf16 timm / bf16 ours (like for like)": med["bf16"]["timm"] / med["bf16"]["ours"],
                "fp32 timm / bf16 ours (precision change, NOT like for like)":
                    med["fp32"]["timm"] / med["bf16"]["ours"],
            },
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=49, help="patch tokens; must be a square number")
    parser.add_argument("--dim", type=int, default=96, help="total width (timm GPSA's dim)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", action="append", choices=["cpu", "cuda"],
                        help="repeatable; default: cpu, plus cuda when available")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="also both layers under bf16 autocast, same rotation (default: where bf16 is "
                             "native: CUDA, CPUs with bf16 hardware); --no-bf16: fp32 only")
    add_malloc_option(parser)
    args = parse_and_set_up(parser, argv)
    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    for device in devices:
        bf16, why_not = (args.bf16, "") if args.bf16 is not None else bf16_by_default(device)
        if why_not:
            print(f"[{device}] no bf16 column: {why_not} (--bf16 times it anyway)")
        result = run(batch=args.batch, tokens=args.tokens, dim=args.dim, heads=args.heads,
                     repeats=args.repeats, warmup=args.warmup, device=device, bf16=bf16)
        path = write_result("gpsa_layer", result, device=device)
        med = result["median_s"]
        print(f"[{device}] batch={args.batch} tokens={args.tokens} dim={args.dim} heads={args.heads} "
              f"threads={torch.get_num_threads()}")
        print(f"  timm GPSA  fwd+bwd median: {med['timm'] * 1e3:8.2f} ms")
        print(f"  ours GPSA  fwd+bwd median: {med['ours'] * 1e3:8.2f} ms")
        print(f"  ratio timm/ours: {result['ratio_timm_over_ours']:.2f}x   "
              f"(max |out diff| {result['max_abs_output_diff']:.1e})")
        print(f"  floor, the projections alone: {med['floor'] * 1e3:8.2f} ms -> best reachable ratio "
              f"{result['ratio_bound']:.2f}x")
        print("  " + describe(result["ceiling"], baseline="timm", what="layer"))
        if "ratio_fused_kernel_gain" in result:
            print(f"  ours apart, the projections and the core as separate ops: {med['ours_apart'] * 1e3:8.2f} ms -> "
                  f"fused layer gain {result['ratio_fused_layer_gain']:.2f}x")
            print(f"  ours apart with the core on torch ops: {med['ours_torch_ops'] * 1e3:8.2f} ms -> "
                  f"fused kernel gain {result['ratio_fused_kernel_gain']:.2f}x")
            print(f"  ours recomputing the softmax maps in the backward: {med['ours_recomputing'] * 1e3:8.2f} ms -> "
                  f"kept maps gain {result['ratio_kept_maps_gain']:.2f}x")
        if "ratio_onednn_linear_gain" in result:
            print(f"  ours apart with MKL's float32 projections (torch's default): {med['ours_mkl_linear'] * 1e3:8.2f} ms -> "
                  f"oneDNN linear gain {result['ratio_onednn_linear_gain']:.2f}x; timm/ours on MKL "
                  f"{result['ratio_timm_over_ours_mkl_linear']:.2f}x")
        if "ratio_weight_grad_kernel_gain" in result:
            print(f"  ours apart with its weight gradients on oneDNN/MKL: {med['ours_library_weight_grad'] * 1e3:8.2f} ms -> "
                  f"weight-grad kernel gain {result['ratio_weight_grad_kernel_gain']:.2f}x")
        if "ratio_fused_kernel_gain" not in result and device == "cpu":
            print(f"  (the fused attention kernel is not built here: {result['fused_kernel_unavailable_because']['fp32']})")
        if "median_s_bf16" in result:
            mb = result["median_s_bf16"]
            print(f"  timm GPSA  fwd+bwd median, bf16 autocast: {mb['timm'] * 1e3:8.2f} ms")
            print(f"  ours GPSA  fwd+bwd median, bf16 autocast: {mb['ours'] * 1e3:8.2f} ms")
            print(f"  ratio timm/ours, bf16 vs bf16 (like for like): {result['ratio_timm_over_ours_bf16']:.2f}x   "
                  f"(max |out diff| {result['max_abs_output_diff_bf16']:.1e} of max |out| "
                  f"{result['max_abs_output_bf16']:.1f})")
            print(f"  floor, the projections alone, bf16: {mb['floor'] * 1e3:8.2f} ms -> best reachable ratio "
                  f"{result['ratio_bound_bf16']:.2f}x")
            print("  " + describe(result["ceiling_bf16"], baseline="timm", what="layer", column="bf16"))
            if "ratio_fused_kernel_gain_bf16" in result:
                print(f"  ours with the core on torch ops, bf16: {mb['ours_torch_ops'] * 1e3:8.2f} ms -> "
                      f"fused kernel gain {result['ratio_fused_kernel_gain_bf16']:.2f}x")
            print(f"  ratio timm fp32 / ours bf16 (precision change, NOT like for like): "
                  f"{result['ratio_timm_fp32_over_ours_bf16']:.2f}x")
        print(f"  -> {path}")


if __name__ == "__main__":
    main()
