"""Whole models: each family's tiny/small vs the DeiT of that size, and ls_convit vs timm's convit (same weights).

    python -m benchmarks.models                          # 224 px (batch 8), 32 px, 28 px micro models; CPU
    python -m benchmarks.models --groups convit --repeats 10
    python -m benchmarks.models --groups tiny small --batch 16

Groups (each a set of models timed side by side, alternately: one batch of each in turn per
repeat, after a warm-up, so load drifts hit all alike; each repeat in its own seeded order,
`_env.shuffled_rounds`, so no model always runs right after the same other one):

  convit   ls_convit_tiny vs timm's convit_tiny at 224 px, ours loading timm's state dict (same
           config, same weights: the outputs are compared), plus deit_tiny_patch16_224
  tiny     ls_{convit,gmm,refiner}_tiny and ls_tcnn_resnet18 (converted: its last stage as GPSA)
           vs deit_tiny_patch16_224, 224 px, 3 x 224 x 224, 1000 classes
  small    ls_{convit,gmm,refiner}_small and ls_tcnn_resnet50 (converted) vs deit_small_patch16_224
  px32     32 px, patch 4 (8 x 8 tokens): ls_convit_tiny vs timm's convit_tiny (same weights) vs the
           DeiT-Ti of that size (timm vit_tiny_patch16_224's blocks with img_size=32, patch_size=4)
  micro    the Fashion-MNIST CPU defaults at 28 px: ls_{convit,gmm,refiner}_micro and
           ls_tcnn_resnet10_micro_s (converted) vs ls_convit_micro with local_up_to_layer=0 (a
           DeiT of the same width and depth), batch 256

Per model: inference images/s (eval, torch.inference_mode) and training images/s (train mode,
forward + backward of a summed output, no optimizer), medians over --repeats batches; the ratio
to the group's baseline (> 1: faster); and `median_host_s`, the time until the step returns from an
idle device (on CUDA, what it takes to enqueue the batch: near the wall time, the model is
host-bound). Writes benchmarks/results/models-<device>.json.

bf16 columns (default on CUDA and on CPUs with bf16 hardware, not where bf16 is emulated;
--no-bf16 skips them, --precisions fp32 bf16 forces them): every model also runs under
`torch.autocast(device, dtype=torch.bfloat16)` (fp32 weights and input, as the trainer's
`precision: bf16`), in the same rotation as its fp32 runs (all models fp32, then all bf16, per
repeat). The fp32 numbers keep their keys (`inference`, `train`, `ours_over_timm_convit`); bf16
adds `inference_bf16` / `train_bf16` (speed_vs_baseline there: against the baseline in bf16),
`ours_over_timm_convit_bf16` (bf16 vs bf16, like for like) and
`ours_bf16_over_timm_convit_fp32` (ours in bf16 vs timm in fp32: a precision change, NOT like for
like). --precisions picks the columns (e.g. `--precisions bf16` on a GPU, where AMP is what a
trial trains in).

Each model and its input run in the memory format a trial gives them
(`trainers/_memory_format.py`): channels_last on CUDA; on the CPU channels_last for the T-CNNs
(overlapping convolutions) and NCHW for the vision transformers. On the CPU the tiny and micro
groups add "NCHW <the T-CNN>": the same architecture in NCHW, and `channels_last_gain` (as a
trial runs it over NCHW). On CUDA the default batches fill the GPU (256 at 224 px, 1024 at 32 and 28 px). `--compile PREFIX ...` adds a
`torch.compile`d copy of each model whose label starts with one of the prefixes, labelled
"<label> +compile" and timed in the same rotation (sharing the eager model's weights); it compiles
during the warm-up. `--cuda-graphs PREFIX ...` (CUDA) adds, for inference, a copy of each
eager model whose label starts with one of the prefixes, labelled "<label> +graph": its forward
captured once per precision as a CUDA graph (`trainers/_cuda_graph.py`, as a trial's throughput is
measured on a GPU) and replayed per batch, so the host's Python speed drops out. The convit and px32 groups also report `ours_over_deit`: ls_convit_tiny
against the DeiT-Ti of the group per mode and precision (and the compiled pair and the graphed
pair, where both are).
On CUDA those two groups add "unfused ls_convit_tiny": the same model (same weights) with GPSA's
fused Triton inference kernel switched off (fused SDPA + P @ V), and `fused_kernel_gain` (with
over without; only fp16/bf16 inference takes the kernel, so the other columns read about 1).
On the CPU the convit and micro groups add "fused-MHSA ls_convit_*": the same model with its plain
attention blocks on torch's fused kernel instead of the explicit core (which they take under bf16
autocast on a CPU with bf16 GEMMs, and in float32 where the float32 kernel is built,
`kernels.plain_attention_on_explicit_core`), and `explicit_core_gain` (with over without; about 1 where
neither holds). They also add "torch-ops-core ls_convit_*" (and in the micro group
"torch-ops-core ls_gmm_micro"): the same model with its attention core on torch ops instead of the
fused CPU kernels (`kernels.cpu_library`, where they are built: float32, and bf16
on bf16 hardware, GMM attention's masked core included), and `cpu_kernel_gain` (with over
without).
Where our inference runs the blocks' norms (and the residual add before norm2) on a kernel and
fuses fc1's GELU (and in bf16 the linears' bias) into oneDNN's op (`kernels.LayerNorm`, `kernels.linear`:
float32 where the float32 kernel is built, bf16 on a bf16 CPU) in a timed precision, the convit
and micro groups add "torch-inference-ops ls_convit_*": the same model with those on torch's ops
(F.linear, the GELU, the add, layer_norm and in bf16 the cast) and oneDNN's products given the
plain weights (not the kept packed ones, the `packed_weights` backend), and `inference_ops_gain` (with
over without; only the inference columns take those paths, training reads about 1).
On a CPU where our float32 linears run on oneDNN (`kernels.onednn_beats_mkl_here`: full-width
AVX-512 where MKL runs AVX2 code, AMD's Zen 4 and 5) and fp32 is timed, the convit and tiny groups add "MKL-linear
ls_convit_tiny" (the same model on torch's `F.linear`, MKL: `onednn_linear_gain`, with over
without) and "oneDNN-linear <the DeiT>" (timm's DeiT with its nn.Linear layers swapped for ours,
same weights: the architecture against the same GEMMs, `over_onednn_linear_deit`), since timm's
own models keep MKL there.
The convit and px32 groups also time the peaks of `_ceiling` in their rotation ("peak
multiply-add" on the CPU where the kernels are built, "peak matmul": `peaks`, apart from the
models) and report `ceiling` per timing column and peak: timm's ConViT's counted flops at the
peak's rate, the most any ConViT doing that arithmetic could reach over it here (`ratio`), and the
share of the peak ours runs it at.
Where bf16 inference's linears run on the bf16 kernel instead of oneDNN (`kernels.linear`: Zen 4) and bf16
is timed, the convit and micro groups add "oneDNN-bf16-linear ls_convit_*": the same model with
them on oneDNN (the `bf16_kernel_linear` backend off), and `kernel_linear_gain` (with over without;
only the bf16 inference column takes the path, the others read about 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import timm
import torch

import trainers.models  # noqa: F401  (registers the ls_* families)
from trainers import GraphedInference, capture_inference, kernels, runs_channels_last
from benchmarks._ceiling import PEAK_SIZE, MultiplyAddPeak, PeakMatmul, ceilings, counted_flops, describe
from benchmarks._env import (add_malloc_option, autocast, bf16_by_default, parse_and_set_up, shuffled_rounds, sync,
                            write_result)

IMAGENET = dict(num_classes=1000, in_chans=3)
UNFUSED = "unfused "  # label prefix: ls_convit_tiny with GPSA's CUDA inference kernel off
FUSED_MHSA = "fused-MHSA "  # label prefix: a CPU ls_convit with its plain attention on torch's fused kernel
TORCH_OPS_CORE = "torch-ops-core "  # label prefix: a CPU ls_convit/ls_gmm without the fused attention kernel
NCHW = "NCHW "  # label prefix: a CPU T-CNN in NCHW instead of the channels_last a trial runs it in
MKL_LINEAR = "MKL-linear "  # label prefix: a CPU ls_* model with its float32 linears on F.linear (MKL)
ONEDNN_LINEAR = "oneDNN-linear "  # label prefix: a timm model with its nn.Linear layers as ours (oneDNN)
ONEDNN_BF16_LINEAR = "oneDNN-bf16-linear "  # label prefix: a CPU ls_* model with bf16 inference's linears on oneDNN, not the kernel
TORCH_INFERENCE_OPS = "torch-inference-ops "  # label prefix: a CPU ls_* model with its inference norms and linears' fusions on torch's ops
# not models: the peaks of `_ceiling`, timed in the rotation of the groups with timm's ConViT
PEAKS = {"peak multiply-add": "multiply_add", "peak matmul": "matmul"}
CEILING_GROUPS = ("convit", "px32")


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _any_cpu_kernel(precisions: tuple[str, ...]) -> bool:
    """Whether the attention core has a fused CPU kernel here in a timed precision's dtype (asking
    only for those: a kernel that cannot be built warns, which an fp32-only run should not print)."""
    return any(kernels.cpu_library(PRECISION_DTYPES[p]) is not None for p in precisions)


def _converted(name: str, **kwargs) -> torch.nn.Module:
    model = timm.create_model(name, **kwargs)
    model.reparametrise()  # the T-CNN as it ends a run: its last stage recast as GPSA
    return model


def _convit_pair(img_size: int, patch_size: int) -> tuple[torch.nn.Module, torch.nn.Module, float]:
    """timm convit_tiny and ls_convit_tiny holding the same (perturbed) weights; max |logit diff|."""
    torch.manual_seed(0)
    ref = timm.create_model("convit_tiny", img_size=img_size, patch_size=patch_size)
    with torch.no_grad():  # off the init, so the gates and positions matter
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours = timm.create_model("ls_convit_tiny", img_size=img_size, patch_size=patch_size)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, img_size, img_size)
    with torch.inference_mode():
        diff = (ref.eval()(x) - ours.eval()(x)).abs().max().item()
    return ref, ours, diff


class _WithPathOff(torch.nn.Module):
    """A model run with one of its fast paths switched off (one kernel backend, or several, off
    during the forward, which picks the path its backward follows: `kernels.backends`), sharing the
    wrapped model's weights: the path's gain, timed in the same rotation."""

    def __init__(self, model: torch.nn.Module, *backends: str):
        super().__init__()
        self.model, self.off = model, dict.fromkeys(backends, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with kernels.backends(**self.off):
            return self.model(x)


def _without_fused_cuda_kernel(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "triton")


def _with_fused_mhsa(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "explicit_plain_attention")


def _with_torch_ops_core(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "libraries")


def _with_mkl_linears(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "onednn_fp32")


def _with_torch_inference_ops(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "onednn_bf16", "fused_gelu", "packed_weights", "norm_kernel")


def _with_onednn_bf16_linears(model: torch.nn.Module) -> torch.nn.Module:
    return _WithPathOff(model, "bf16_kernel_linear")


def _with_onednn_linears(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each `nn.Linear` recast as our `Linear` (same parameters; as `Mlp` does)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = kernels.Linear
    return model


def _inference_ops_timed(cuda: bool, precisions: tuple[str, ...]) -> bool:
    """Whether our inference takes, in a timed precision, paths the "torch-inference-ops" twin turns
    off: the norms on a kernel (`kernels.LayerNorm`), and with them fc1's fused GELU and the packed
    weights on oneDNN (`kernels.linear`; in bf16 its linears on oneDNN's op too)."""
    bf16 = ("bf16" in precisions and kernels.onednn_runs_bf16_here()
            and kernels.cpu_library(torch.bfloat16) is not None)
    return not cuda and (bf16 or "fp32" in precisions and kernels.cpu_library(torch.float32) is not None)


def _kernel_linears_timed(cuda: bool, precisions: tuple[str, ...]) -> bool:
    """Whether bf16 inference's linears run on the bf16 kernel here, bf16 timed (`kernels.linear`)."""
    return (not cuda and "bf16" in precisions and kernels.selected_backends().bf16_kernel_linear
            and kernels.onednn_runs_bf16_here() and kernels.kernel_bf16_linear_beats_onednn_here()
            and kernels.cpu_library(torch.bfloat16) is not None)


def _onednn_linears_timed(cuda: bool, precisions: tuple[str, ...]) -> bool:
    """Whether our models' float32 linears run on oneDNN here, in a timed precision (so timm's, on
    MKL, are not like for like): in inference at least (`onednn_inference_beats_mkl_here`; on
    Intel's AVX-512 CPUs training keeps MKL, and the twins read about 1 there)."""
    return not cuda and "fp32" in precisions and kernels.onednn_inference_beats_mkl_here()


def _group(name: str, *, cuda: bool = False, precisions: tuple[str, ...] = ("fp32", "bf16")
           ) -> tuple[dict[str, Callable[[], torch.nn.Module]], str, tuple[int, int, int], dict]:
    """name -> builders, the baseline's name, the input shape, extra facts. On CUDA the convit and
    px32 groups add ls_convit_tiny without its fused inference kernel (same weights); on the CPU the
    convit and micro groups add ls_convit with its plain attention on the fused kernel."""
    extra: dict = {}
    def cached_pair(img_size: int, patch: int) -> Callable[[], tuple]:
        """timm's ConViT and ours with the same weights, built once (both builders share it)."""
        def pair():
            if "pair" not in extra:
                ref, ours, diff = _convit_pair(img_size, patch)
                extra["pair"] = (ref, ours)
                extra["max_abs_logit_diff"] = diff
            return extra["pair"]
        return pair

    if name == "convit":
        pair = cached_pair(224, 16)
        builders = {
            "timm convit_tiny": lambda: pair()[0],
            "ls_convit_tiny": lambda: pair()[1],
            "deit_tiny_patch16_224": lambda: timm.create_model("deit_tiny_patch16_224"),
        }
        if cuda:
            builders[UNFUSED + "ls_convit_tiny"] = lambda: _without_fused_cuda_kernel(pair()[1])
        else:
            builders[FUSED_MHSA + "ls_convit_tiny"] = lambda: _with_fused_mhsa(pair()[1])
            if _any_cpu_kernel(precisions):
                builders[TORCH_OPS_CORE + "ls_convit_tiny"] = lambda: _with_torch_ops_core(pair()[1])
        if _inference_ops_timed(cuda, precisions):
            builders[TORCH_INFERENCE_OPS + "ls_convit_tiny"] = lambda: _with_torch_inference_ops(pair()[1])
        if _kernel_linears_timed(cuda, precisions):
            builders[ONEDNN_BF16_LINEAR + "ls_convit_tiny"] = lambda: _with_onednn_bf16_linears(pair()[1])
        if _onednn_linears_timed(cuda, precisions):
            builders[MKL_LINEAR + "ls_convit_tiny"] = lambda: _with_mkl_linears(pair()[1])
            builders[ONEDNN_LINEAR + "deit_tiny_patch16_224"] = lambda: _with_onednn_linears(
                timm.create_model("deit_tiny_patch16_224"))
        return builders, "timm convit_tiny", (3, 224, 224), extra
    if name in ("tiny", "small"):
        deit = f"deit_{name}_patch16_224"
        tcnn = "ls_tcnn_resnet18" if name == "tiny" else "ls_tcnn_resnet50"
        builders = {deit: lambda: timm.create_model(deit)}
        for family in ("convit", "gmm", "refiner"):
            builders[f"ls_{family}_{name}"] = (lambda f=family: timm.create_model(f"ls_{f}_{name}", **IMAGENET))
        builders[f"{tcnn} (converted)"] = lambda: _converted(tcnn, **IMAGENET)
        if not cuda:
            builders[f"{NCHW}{tcnn} (converted)"] = lambda: _converted(tcnn, **IMAGENET)
        builders[f"timm convit_{name}"] = lambda: timm.create_model(f"convit_{name}")
        if _onednn_linears_timed(cuda, precisions):
            builders[ONEDNN_LINEAR + deit] = lambda: _with_onednn_linears(timm.create_model(deit))
        return builders, deit, (3, 224, 224), extra
    if name == "px32":
        pair = cached_pair(32, 4)
        builders = {
            "deit_tiny (32 px, patch 4)": lambda: timm.create_model(
                "deit_tiny_patch16_224", img_size=32, patch_size=4),
            "ls_convit_tiny (32 px, patch 4)": lambda: pair()[1],
            "timm convit_tiny (32 px, patch 4)": lambda: pair()[0],
        }
        if cuda:
            builders[UNFUSED + "ls_convit_tiny (32 px, patch 4)"] = lambda: _without_fused_cuda_kernel(pair()[1])
        return builders, "deit_tiny (32 px, patch 4)", (3, 32, 32), extra
    if name == "micro":
        builders = {
            "deit micro (ls_convit_micro, 0 GPSA)": lambda: timm.create_model("ls_convit_micro", local_up_to_layer=0),
            "ls_convit_micro": lambda: timm.create_model("ls_convit_micro"),
            "ls_gmm_micro": lambda: timm.create_model("ls_gmm_micro"),
            "ls_refiner_micro": lambda: timm.create_model("ls_refiner_micro"),
            "ls_tcnn_resnet10_micro_s (converted)": lambda: _converted("ls_tcnn_resnet10_micro_s"),
        }
        if not cuda:  # the same weights with their attention on other paths
            builders[NCHW + "ls_tcnn_resnet10_micro_s (converted)"] = lambda: _converted("ls_tcnn_resnet10_micro_s")
            def shared(variant: str) -> Callable[[], torch.nn.Module]:
                def build() -> torch.nn.Module:
                    if variant not in extra:
                        extra[variant] = timm.create_model(variant)
                    return extra[variant]
                return build
            convit_micro, gmm_micro = shared("ls_convit_micro"), shared("ls_gmm_micro")
            builders["ls_convit_micro"], builders["ls_gmm_micro"] = convit_micro, gmm_micro
            builders[FUSED_MHSA + "ls_convit_micro"] = lambda: _with_fused_mhsa(convit_micro())
            if _inference_ops_timed(cuda, precisions):
                builders[TORCH_INFERENCE_OPS + "ls_convit_micro"] = lambda: _with_torch_inference_ops(convit_micro())
            if _kernel_linears_timed(cuda, precisions):
                builders[ONEDNN_BF16_LINEAR + "ls_convit_micro"] = lambda: _with_onednn_bf16_linears(convit_micro())
            if _any_cpu_kernel(precisions):
                builders[TORCH_OPS_CORE + "ls_convit_micro"] = lambda: _with_torch_ops_core(convit_micro())
                # GMM attention: on the kernel of its GEMMs' dtype where it is built, else its torch ops either way
                builders[TORCH_OPS_CORE + "ls_gmm_micro"] = lambda: _with_torch_ops_core(gmm_micro())
        return builders, "deit micro (ls_convit_micro, 0 GPSA)", (1, 28, 28), extra
    raise ValueError(name)


def _timing_key(mode: str, precision: str) -> str:
    """fp32 keeps the plain key (inference, train); other precisions add a suffix."""
    return mode if precision == "fp32" else f"{mode}_{precision}"


def pair_ratios(out: dict, ours: str, ref: str) -> dict[str, float]:
    """ref's median batch time over ours', for every timing column present with both (> 1: ours
    is faster; a CUDA graph copy has inference columns only)."""
    return {key: out[key]["median_batch_s"][ref] / out[key]["median_batch_s"][ours]
            for key in ("inference", "train", "inference_bf16", "train_bf16")
            if key in out and {ours, ref} <= out[key]["median_batch_s"].keys()}


def run_group(name: str, *, batch: int, repeats: int, warmup: int, device: str, train: bool,
              precisions: tuple[str, ...] = ("fp32", "bf16"), compile_matching: tuple[str, ...] = (),
              graph_matching: tuple[str, ...] = ()) -> dict:
    dev = torch.device(device)
    builders, baseline, shape, extra = _group(name, cuda=dev.type == "cuda", precisions=tuple(precisions))
    models: dict[str, torch.nn.Module] = {}
    formats: dict[str, torch.memory_format] = {}  # as train_trial puts a model and FFCV its batches
    for label, build in builders.items():
        model = build().to(dev)
        channels_last = runs_channels_last(model, dev) and not label.startswith(NCHW)
        formats[label] = torch.channels_last if channels_last else torch.contiguous_format
        models[label] = model.to(memory_format=formats[label])
    for model in models.values():  # timm < 1.0.31 keeps ConViT's rel_indices as a plain attribute
        for module in model.modules():  # (not a buffer), built on the CPU by _convit_pair's check
            if isinstance(getattr(module, "rel_indices", None), torch.Tensor):
                module.rel_indices = module.rel_indices.to(dev)
    params = {label: sum(p.numel() for p in m.parameters()) for label, m in models.items()}
    for label in [label for label in models if label.startswith(compile_matching)]:
        models[f"{label} +compile"] = torch.compile(models[label])
        params[f"{label} +compile"] = params[label]
        formats[f"{label} +compile"] = formats[label]
    graphed: dict[str, str] = {}  # "<label> +graph" -> label: its eager model, captured per precision
    if dev.type == "cuda":
        # eager models only: a compiled copy is captured by torch.compile's own cudagraph modes
        for label in [label for label in models if label.startswith(graph_matching) and not label.endswith(" +compile")]:
            graphed[f"{label} +graph"] = label
            models[f"{label} +graph"] = models[label]
            params[f"{label} +graph"] = params[label]
            formats[f"{label} +graph"] = formats[label]
    graphs: dict[tuple[str, str], GraphedInference] = {}
    peaks: dict[str, MultiplyAddPeak | PeakMatmul] = {}  # label -> peak
    if name in CEILING_GROUPS:
        multiply_add = MultiplyAddPeak(precisions if dev.type == "cpu" else [])
        if all(precision in multiply_add for precision in precisions):
            peaks["peak multiply-add"] = multiply_add
        peaks["peak matmul"] = PeakMatmul(PEAK_SIZE[dev.type], dev)
    torch.manual_seed(1)
    x = torch.randn(batch, *shape, device=dev)
    inputs = {label: x.contiguous(memory_format=fmt) for label, fmt in formats.items()}  # the same values
    precisions = list(precisions)

    def infer(label: str, precision: str) -> tuple[float, float]:
        """(wall, host) seconds for one batch: host = until the forward returns (on CUDA, the
        time to enqueue it; where that nears the wall time, the batch is host-bound)."""
        if label in peaks:
            return timed_peak(label, precision)
        model = models[label]
        model.eval()
        if label in graphed:  # captured at its first call (in the warm-up), replayed after
            if (label, precision) not in graphs:
                graphs[label, precision] = capture_inference(
                    model, inputs[label], autocast_dtype=None if precision == "fp32" else PRECISION_DTYPES[precision])
            graph = graphs[label, precision]
            sync(dev)
            start = time.perf_counter()
            graph(graph.static_input)
            host = time.perf_counter() - start
            sync(dev)
            return time.perf_counter() - start, host
        sync(dev)
        start = time.perf_counter()
        with torch.inference_mode(), autocast(dev, precision):
            model(inputs[label])
        host = time.perf_counter() - start
        sync(dev)
        return time.perf_counter() - start, host

    def train_step(label: str, precision: str) -> tuple[float, float]:
        if label in peaks:  # the same work: a matmul's backward would understate its rate
            return timed_peak(label, precision)
        model = models[label]
        model.train()
        model.zero_grad(set_to_none=True)
        sync(dev)
        start = time.perf_counter()
        with autocast(dev, precision):
            y = model(inputs[label])
        y.float().sum().backward()
        host = time.perf_counter() - start
        sync(dev)
        return time.perf_counter() - start, host

    def timed_peak(label: str, precision: str) -> tuple[float, float]:
        sync(dev)
        start = time.perf_counter()
        peaks[label](precision)
        host = time.perf_counter() - start
        sync(dev)
        return time.perf_counter() - start, host

    modes = {"inference": infer, **({"train": train_step} if train else {})}
    out: dict = {"config": dict(group=name, batch=batch, input_shape=list(shape), repeats=repeats, warmup=warmup,
                                device=str(dev), dtype="float32", precisions=precisions,
                                channels_last=[label for label, fmt in formats.items() if fmt is torch.channels_last],
                                compiled=[label for label in models if label.endswith(" +compile")],
                                cuda_graphs=list(graphed)),
                 "baseline": baseline, "params": params}
    if "max_abs_logit_diff" in extra:
        out["max_abs_logit_diff"] = extra["max_abs_logit_diff"]
        if "bf16" in precisions:
            ref, ours = extra["pair"]
            with torch.inference_mode(), autocast(dev, "bf16"):
                xs = x[:2]
                out["max_abs_logit_diff_bf16"] = (ref.eval()(xs).float() - ours.eval()(xs).float()).abs().max().item()
    for mode, fn in modes.items():
        labels = [label for label in models if mode == "inference" or label not in graphed]  # graphs: inference only
        labels += list(peaks)
        for _ in range(warmup):
            for precision in precisions:
                for label in labels:
                    fn(label, precision)
        times: dict[str, dict[str, list[float]]] = {p: {label: [] for label in labels} for p in precisions}
        host_times: dict[str, dict[str, list[float]]] = {p: {label: [] for label in labels} for p in precisions}
        for order in shuffled_rounds(labels, repeats):
            # each repeat in its own order, so no model always follows the same other: on an H200,
            # ls_convit_tiny, always right after timm's ConViT, read 1.4-2.1 ms more host time a
            # batch than its own twins (same weights, same kernel) in two runs, cause not established
            for precision in precisions:
                for label in order:
                    wall, host = fn(label, precision)
                    times[precision][label].append(wall)
                    host_times[precision][label].append(host)
        for precision in precisions:
            median = {label: statistics.median(ts) for label, ts in times[precision].items()}
            for label, peak in peaks.items():  # kept apart from the models'
                out.setdefault("peaks", {}).setdefault(PEAKS[label], {})[_timing_key(mode, precision)] = {
                    "flops": peak.flops[precision], "median_s": median.pop(label)}
                host_times[precision].pop(label)
            out[_timing_key(mode, precision)] = {
                "median_batch_s": median,
                "images_per_s": {label: batch / m for label, m in median.items()},
                "speed_vs_baseline": {label: median[baseline] / m for label, m in median.items()},
                "median_host_s": {label: statistics.median(ts) for label, ts in host_times[precision].items()},
            }
    if name in ("convit", "px32"):
        ours = next(label for label in models if label.startswith("ls_convit_tiny"))
        ref = next(label for label in models if label.startswith("timm convit_tiny"))
        deit = next(label for label in models if label.startswith("deit_tiny"))
        by_precision = {precision: {mode: pair_ratios(out, ours, ref)[_timing_key(mode, precision)] for mode in modes}
                        for precision in precisions}
        if "fp32" in by_precision:
            out["ours_over_timm_convit"] = by_precision["fp32"]
        if "bf16" in by_precision:
            out["ours_over_timm_convit_bf16"] = by_precision["bf16"]
        if "fp32" in by_precision and "bf16" in by_precision:
            out["ours_bf16_over_timm_convit_fp32"] = {
                mode: out[mode]["median_batch_s"][ref] / out[f"{mode}_bf16"]["median_batch_s"][ours] for mode in modes}
        out["ours_over_deit"] = {f"{ours} / {deit}": pair_ratios(out, ours, deit)}
        out["ceiling"] = {  # timm's ConViT's arithmetic at the peaks: the most any ConViT reaches over it
            key: ceilings(baseline_flops=counted_flops(lambda: modes[mode](ref, precision)),
                          baseline_s=out[key]["median_batch_s"][ref], ours_s=out[key]["median_batch_s"][ours],
                          peaks={kind: (timed[key]["flops"], timed[key]["median_s"]) for kind, timed in out["peaks"].items()})
            for mode in modes for precision in precisions for key in [_timing_key(mode, precision)]}
        unfused = next((label for label in models if label.startswith(UNFUSED)), None)
        if unfused is not None:
            out["ours_over_deit"][f"{unfused} / {deit}"] = pair_ratios(out, unfused, deit)
            out["fused_kernel_gain"] = pair_ratios(out, ours, unfused)
        for suffix in (" +compile", " +graph"):
            if f"{ours}{suffix}" in models and f"{deit}{suffix}" in models:
                out["ours_over_deit"][f"{ours}{suffix} / {deit}{suffix}"] = pair_ratios(
                    out, f"{ours}{suffix}", f"{deit}{suffix}")
    for label in models:
        for prefix, key in ((FUSED_MHSA, "explicit_core_gain"), (TORCH_OPS_CORE, "cpu_kernel_gain"),
                            (NCHW, "channels_last_gain"), (MKL_LINEAR, "onednn_linear_gain"),
                            (TORCH_INFERENCE_OPS, "inference_ops_gain"), (ONEDNN_BF16_LINEAR, "kernel_linear_gain")):
            if label.startswith(prefix):
                out.setdefault(key, {})[label[len(prefix):]] = pair_ratios(out, label[len(prefix):], label)
        if label.startswith(ONEDNN_LINEAR + "deit"):  # our families against the DeiT on the same GEMMs
            out["over_onednn_linear_deit"] = {f"{ours} / {label}": pair_ratios(out, ours, label)
                                              for ours in models if ours.startswith("ls_")}
    return out


DEFAULT_BATCH = {"convit": 8, "tiny": 8, "small": 8, "px32": 64, "micro": 256}
DEFAULT_BATCH_CUDA = {"convit": 256, "tiny": 256, "small": 256, "px32": 1024, "micro": 1024}


def _print_group(group: str, batch: int, r: dict) -> None:
    print(f"[{group}] batch {batch}, input {tuple(r['config']['input_shape'])}, threads {torch.get_num_threads()}, "
          f"baseline {r['baseline']}")
    for label in r["params"]:
        for precision in r["config"]["precisions"]:
            infer, train = _timing_key("inference", precision), _timing_key("train", precision)
            name = f"{label:<44} {r['params'][label] / 1e6:6.2f}M" if precision == r["config"]["precisions"][0] \
                else f"{'':<44} {'':7}"
            line = f"  {name} {precision:<4}  infer {r[infer]['images_per_s'][label]:9.1f} img/s " \
                   f"({r[infer]['speed_vs_baseline'][label]:.2f}x)"
            if train in r and label in r[train]["images_per_s"]:
                line += f"   train {r[train]['images_per_s'][label]:8.1f} img/s ({r[train]['speed_vs_baseline'][label]:.2f}x)"
            print(line)

    def show(key: str, what: str) -> None:
        if key in r:
            print(f"  {what}: " + ", ".join(f"{mode} {v:.2f}x" for mode, v in r[key].items()))

    if "max_abs_logit_diff" in r:
        print(f"  same weights: max |logit diff| {r['max_abs_logit_diff']:.1e}"
              + (f" (bf16: {r['max_abs_logit_diff_bf16']:.1e})" if "max_abs_logit_diff_bf16" in r else ""))
    show("ours_over_timm_convit", "ls_convit_tiny / timm convit_tiny, fp32 vs fp32")
    show("ours_over_timm_convit_bf16", "ls_convit_tiny / timm convit_tiny, bf16 vs bf16 (like for like)")
    show("ours_bf16_over_timm_convit_fp32", "ls_convit_tiny bf16 / timm convit_tiny fp32 (precision change, NOT like for like)")
    for key, ceiling in r.get("ceiling", {}).items():
        mode, _, precision = key.partition("_")
        print("  " + describe(ceiling, baseline="timm convit_tiny", what="ConViT",
                              column=f"{mode} {precision or 'fp32'}, a batch"))
    for pair, ratios in r.get("ours_over_deit", {}).items():
        print(f"  {pair}: " + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    if "fused_kernel_gain" in r:
        print("  GPSA's fused CUDA kernel, ls_convit_tiny with / without it: "
              + ", ".join(f"{key} {v:.2f}x" for key, v in r["fused_kernel_gain"].items()))
    for label, ratios in r.get("explicit_core_gain", {}).items():
        print(f"  {label}, plain attention on the explicit core / on the fused kernel: "
              + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for label, ratios in r.get("cpu_kernel_gain", {}).items():
        print(f"  {label}, the attention core on the fused kernel / on torch ops: "
              + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for label, ratios in r.get("channels_last_gain", {}).items():
        print(f"  {label}, channels_last / NCHW: " + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for label, ratios in r.get("inference_ops_gain", {}).items():
        print(f"  {label}, inference norms and linears' fusions on / on torch's ops: "
              + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for label, ratios in r.get("kernel_linear_gain", {}).items():
        print(f"  {label}, bf16 inference linears on the bf16 kernel / on oneDNN: "
              + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for label, ratios in r.get("onednn_linear_gain", {}).items():
        print(f"  {label}, float32 linears on oneDNN / on MKL: " + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))
    for pair, ratios in r.get("over_onednn_linear_deit", {}).items():
        print(f"  {pair}: " + ", ".join(f"{key} {v:.2f}x" for key, v in ratios.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", default=["convit", "tiny", "small", "px32", "micro"],
                        choices=["convit", "tiny", "small", "px32", "micro"])
    parser.add_argument("--batch", type=int, help="one batch size for every group (default on the CPU: 8 at 224 px, 64 at 32 px, 256 at 28 px; "
                             "on CUDA: 256 at 224 px, 1024 at 32 and 28 px)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-train", action="store_true", help="inference only")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-bf16", action="store_true",
                        help="fp32 only (default: every model also under bf16 autocast, same rotation)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"],
                        help="the precision columns to time (default: fp32 bf16 where bf16 is native, else fp32; "
                             "--no-bf16: fp32)")
    parser.add_argument("--compile", nargs="+", default=[], metavar="PREFIX",
                        help="also time a torch.compile'd copy of each model whose label starts with one of these")
    parser.add_argument("--cuda-graphs", nargs="+", default=[], metavar="PREFIX",
                        help="CUDA: also time each model whose label starts with one of these as replays of its "
                             "inference forward captured as a CUDA graph (inference only)")
    parser.add_argument("--result-name", default="models",
                        help="the JSON's name: benchmarks/results/<name>-<device>.json (default: models)")
    add_malloc_option(parser)
    args = parse_and_set_up(parser, argv)
    if args.precisions and args.no_bf16:
        parser.error("--no-bf16 and --precisions: give one of them")
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    bf16, why_not = (False, "") if args.no_bf16 else bf16_by_default(args.device)
    if why_not and not args.precisions:
        print(f"no bf16 columns: {why_not} (--precisions fp32 bf16 times them anyway)")
    precisions = tuple(dict.fromkeys(args.precisions or (["fp32", "bf16"] if bf16 else ["fp32"])))
    default_batch = DEFAULT_BATCH_CUDA if args.device == "cuda" else DEFAULT_BATCH
    results = {}
    for group in args.groups:
        batch = args.batch or default_batch[group]
        r = run_group(group, batch=batch, repeats=args.repeats, warmup=args.warmup, device=args.device,
                      train=not args.no_train, precisions=precisions, compile_matching=tuple(args.compile),
                      graph_matching=tuple(args.cuda_graphs))
        results[group] = r
        _print_group(group, batch, r)
    path = write_result(args.result_name, {"groups": results}, device=args.device)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
