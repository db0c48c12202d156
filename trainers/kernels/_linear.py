"""`Linear` and `linear`: CPU linear layers on the GEMM library that is the quicker one here.
benchmarks/models.py (`onednn_linear_gain`, `inference_ops_gain`, `kernel_linear_gain`) and
benchmarks/gpsa_layer.py (`ratio_onednn_linear_gain`, `ratio_weight_grad_kernel_gain`) measure
each rule below against torch's own path, side by side (each rule a backend `kernels.backends`
turns off: onednn_fp32, onednn_bf16, bf16_kernel_linear, weight_grad_kernel, fused_gelu,
packed_weights).

float32: torch runs `F.linear` and its backward on MKL, which picks its AVX-512 code by CPU vendor,
not by the CPU's flags, so on a non-Intel CPU with AVX-512 it runs AVX2 code. There (and for
float32 inference also on Intel's AVX-512 CPUs: `onednn_inference_beats_mkl_here`) the products run
on oneDNN, which dispatches on the flags: above MIN_MULTIPLY_ADDS (below, oneDNN's fixed cost per
call loses), the weight gradient with the larger weight dim as oneDNN's output features and on MKL
where both dims are under GRAD_WEIGHT_MIN_WIDTH. Where the float32 library is built the weight
gradient runs on its `linear_weight_grad` instead (`csrc/linear_fp32.h`: broadcast-FMA tiles that
read the transposed operand through its strides, a fixed split of the rows), for out_features or
in_features a multiple of 16. Results differ from MKL's by float32 rounding only.

bf16 inference (CPU autocast to bf16, or bf16 tensors, autograd not recording): oneDNN's linear op
directly, the bias added inside the GEMM (`F.linear` goes through `addmm`, which first copies the
bias into every row); same casts, same result bit for bit. On AMD family 25 with AVX512-BF16 and no
AMX (`kernel_bf16_linear_beats_onednn_here`) on the bf16 library's linear (`csrc/linear_bf16.h`),
the weight kept as its tiles read it; one rounding to bf16, another summation order than oneDNN's.

Without autograd, `linear(..., gelu=True)` fuses the exact GELU (the MLP's fc1) into the product on
oneDNN or the bf16 library, applied to the float32 sums (in float32 bit for bit torch's F.gelu).
Both inference paths hand oneDNN the weight in its blocked layout (and cast), kept per weight until
it changes (`_packed_weight`); training, whose weights change every step, keeps the plain weights.
The trials' `flops` count the oneDNN op as the `F.linear` it replaces.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from torch.utils.flop_counter import flop_registry, register_flop_formula
from timm.models import register_notrace_function

from trainers._cpu import cpu_family, cpuinfo_field
from trainers.kernels import _library
from trainers.kernels._kept import parameters_key
from trainers.kernels._switch import enabled, selected_backends

__all__ = ["Linear", "linear", "cpu_autocast_to_bf16", "kernel_bf16_linear_beats_onednn_here",
           "onednn_beats_mkl_here", "onednn_inference_beats_mkl_here", "onednn_runs_bf16_here", "records_autograd"]

# the float32 kernel's lanes where this module's path runs (AVX-512: onednn_beats_mkl_here asks for it)
_KERNEL_LANES = 16
_BF16_KERNEL_COLUMNS = 16  # the bf16 kernel's linear: its tiles' columns, N a multiple of them (csrc/linear_bf16.h)
MIN_MULTIPLY_ADDS = 1 << 21  # below: MKL (oneDNN's fixed cost per call loses)
# grad_weight (both operands transposed, which oneDNN copies first) stays on MKL where both weight
# dims are under this, as quick there
GRAD_WEIGHT_MIN_WIDTH = 192
# F.linear's own rule for bf16 products on oneDNN (torch's mkldnn_gemm_min_size): smaller ones stay there
BF16_MIN_MULTIPLY_ADDS = 16 * 16 * 16
_LINEAR_DTYPES = (torch.float32, torch.bfloat16)
# ONEDNN_MAX_CPU_ISA levels below AVX-512 (oneDNN would run AVX2 code, not measured to beat MKL's)
_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")


def _cpu_vendor_and_family() -> tuple[str, int | None]:
    return cpuinfo_field("vendor_id") or "", cpu_family()


@functools.lru_cache(maxsize=None)
def onednn_beats_mkl_here() -> bool:
    """Whether this CPU is one where MKL runs AVX2 code and oneDNN AVX-512: AVX-512 (as torch's
    dispatch sees it) on a vendor other than Intel, with oneDNN present and
    not capped below AVX-512."""
    vendor, _ = _cpu_vendor_and_family()
    return _onednn_runs_avx512_here() and vendor not in ("", "GenuineIntel")


@functools.lru_cache(maxsize=None)
def kernel_bf16_linear_beats_onednn_here() -> bool:
    """Whether bf16 inference's linears run on the bf16 kernel here rather than on oneDNN: AMD
    family 25 with AVX512-BF16 and without AMX tiles, where it was measured to win."""
    vendor, family = _cpu_vendor_and_family()
    has_amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return vendor == "AuthenticAMD" and family == 25 and not has_amx


@functools.lru_cache(maxsize=None)
def onednn_inference_beats_mkl_here() -> bool:
    """Whether float32 inference (autograd not recording) runs on oneDNN here: where
    `onednn_beats_mkl_here`, and on Intel's AVX-512 CPUs, where MKL runs its own AVX-512 code but
    oneDNN's product on the weights kept in its layout, with fc1's GELU inside, still wins a little
    (benchmarks/models.py; training on oneDNN read slower there, so training keeps MKL)."""
    return onednn_beats_mkl_here() or (_cpu_vendor_and_family()[0] == "GenuineIntel" and _onednn_runs_avx512_here())


def _onednn_runs_avx512_here() -> bool:
    """oneDNN's linear op present, AVX-512 as torch's dispatch sees it, oneDNN not capped below it."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.backends.cpu.get_cpu_capability() == "AVX512" and cap not in _BELOW_AVX512)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, gelu: bool = False) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias (N,), then the exact GELU if asked -> (M, N) on oneDNN; x
    and weight may be strided."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu" if gelu else "none", [], "none" if gelu else "")


# weight -> {kind: (what it was derived from, the derived weight)}: oneDNN's packs per dtype
# (_packed_weight) and the bf16 kernel's layout (_kernel_weight); see _kept_derived
_derived_weights = WeakIdKeyDictionary()


def _kept_derived(weight: torch.Tensor, kind: object, derive) -> Optional[torch.Tensor]:
    """`derive(weight)` kept per `kind` and reused until the weight may have changed
    (`_kept.parameters_key`: its storage, version counter, or an optimizer step); None where that
    cannot be tracked: inference tensors (no version counter, so an in-place change would go unseen)
    and views (a new object on every call, e.g. `w.t()`). Kept while the weight lives, one per kind
    (a model timed in float32 and bf16 in turn does not derive again at every switch)."""
    if weight.is_inference() or weight._is_view():
        return None
    key = parameters_key(weight)
    by_kind = _derived_weights.setdefault(weight, {})
    kept = by_kind.get(kind)
    if kept is not None and kept[0] == key:
        return kept[1]
    derived = derive(weight.detach())
    by_kind[kind] = (key, derived)
    return derived


def _packed_weight(weight: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """`weight` (N, K) cast to `dtype` for oneDNN's linear op: in oneDNN's blocked layout, kept
    (`_kept_derived`) where it can be tracked; else the plain cast. Inference only (the callers').
    `rows` is oneDNN's hint for the layout."""
    packed = None
    if selected_backends().packed_weights:
        packed = _kept_derived(weight, dtype, lambda w: torch.ops.mkldnn._reorder_linear_weight(
            w.to(dtype).contiguous(), rows))
    return weight.to(dtype) if packed is None else packed


_KERNEL_BF16 = "bf16 kernel"  # _derived_weights' kind for the weights the bf16 kernel's linear reads


def _kernel_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` (N, K) as the bf16 kernel's linear reads it, (K / 2, N) int32: each row's bf16 pairs
    as words, transposed (`csrc/linear_bf16.h`); kept (`_kept_derived`), else None (oneDNN then)."""
    return _kept_derived(weight, _KERNEL_BF16,
                         lambda w: w.to(torch.bfloat16).contiguous().view(torch.int32).t().contiguous())


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        ctx.save_for_backward(rows, weight)
        ctx.input_shape = x.shape
        return _onednn(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])  # (..., N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors  # (M, K), (N, K)
        grad = grad.reshape(-1, weight.shape[0])  # (M, N)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None).view(ctx.input_shape)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(grad, rows)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _weight_grad(grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """grad^T (N, M) @ rows (M, K) -> (N, K): on the float32 kernel where it is built and N or K fills
    whole vectors, else on oneDNN or MKL (see the module doc)."""
    out_features, in_features = grad.shape[1], rows.shape[1]
    if (selected_backends().weight_grad_kernel
            and (out_features % _KERNEL_LANES == 0 or in_features % _KERNEL_LANES == 0)):
        kernel = _library.cpu_library(torch.float32)
        if kernel is not None:
            return kernel.linear_weight_grad(grad.contiguous(), rows.contiguous())
    if max(out_features, in_features) < GRAD_WEIGHT_MIN_WIDTH:
        return grad.t().mm(rows)  # MKL
    if in_features > out_features:  # the larger dim as oneDNN's output features
        return _onednn(grad.t(), rows.t(), None)  # (N, K)
    return _onednn(rows.t(), grad.t(), None).t()  # (K, N) -> (N, K) view


def records_autograd(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records an op on these tensors (None: absent, e.g. no bias)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.lru_cache(maxsize=None)
def onednn_runs_bf16_here() -> bool:
    """Whether torch runs bf16 products on oneDNN on this CPU (as autocast's F.linear does)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_autocast_to_bf16() -> bool:
    """Whether CPU autocast is on and casts to bf16."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _takes_onednn_bf16(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """A bf16 product F.linear would run on oneDNN, outside autograd (see the module doc)."""
    if torch.is_autocast_enabled("cpu"):
        bf16 = cpu_autocast_to_bf16() and x.dtype in _LINEAR_DTYPES and weight.dtype in _LINEAR_DTYPES
    else:
        bf16 = x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    return (bf16 and enabled() and selected_backends().onednn_bf16
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dim() >= 2 and not records_autograd(x, weight, bias)
            and not torch.compiler.is_compiling() and torch.backends.mkldnn.enabled and onednn_runs_bf16_here()
            and x.numel() * weight.shape[0] >= BF16_MIN_MULTIPLY_ADDS)


def _bf16_inference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, gelu: bool) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T + bias, then the exact GELU if asked, all cast to bf16 (as
    autocast casts them), with the bias and GELU applied to the float32 sums: (..., N) bf16. On the
    bf16 kernel's linear where it beats oneDNN here and takes the shapes, else on oneDNN."""
    bf16 = torch.bfloat16
    rows = x.reshape(-1, x.shape[-1]).to(bf16)  # (M, K)
    bias_bf16 = None if bias is None else bias.to(bf16)
    out_features, in_features = weight.shape
    if (selected_backends().bf16_kernel_linear and out_features % _BF16_KERNEL_COLUMNS == 0 and in_features % 2 == 0
            and kernel_bf16_linear_beats_onednn_here()):
        kernel = _library.cpu_library(bf16)
        packed = None if kernel is None else _kernel_weight(weight)
        if packed is not None:
            if not (rows.is_contiguous() and rows.data_ptr() % 4 == 0):  # the kernel reads bf16 pairs as words
                rows = rows.clone(memory_format=torch.contiguous_format)
            return kernel.linear_bf16(rows, packed, bias_bf16, gelu).view(*x.shape[:-1], out_features)
    out = _onednn(rows, _packed_weight(weight, bf16, rows.shape[0]), bias_bf16, gelu=gelu)
    return out.view(*x.shape[:-1], out_features)


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return (enabled() and selected_backends().onednn_fp32 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() >= 2 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and (onednn_beats_mkl_here()
                 or onednn_inference_beats_mkl_here() and not records_autograd(x, weight, bias))
            and x.numel() * weight.shape[0] >= MIN_MULTIPLY_ADDS)


@register_notrace_function  # reason: branches on dtype and device (timm's FX feature extraction)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           gelu: bool = False) -> torch.Tensor:
    """`F.linear` (then the exact `F.gelu` if `gelu`): bf16 inference on oneDNN's linear op (on AMD
    family 25 the bf16 kernel's), float32 on oneDNN's where it beats MKL (see the module doc), else
    `F.linear` itself. Without autograd recording, the GELU runs inside the product where the
    product runs on oneDNN or the kernel (unless the `fused_gelu` backend is off), else in place on
    the product."""
    fused_gelu = gelu and selected_backends().fused_gelu
    if _takes_onednn_bf16(x, weight, bias):
        out = _bf16_inference(x, weight, bias, gelu=fused_gelu)
    elif not _takes_onednn(x, weight, bias):
        out = F.linear(x, weight, bias)
        fused_gelu = False
    elif records_autograd(x, weight, bias):
        out = _OneDNNLinear.apply(x, weight, bias)
        fused_gelu = False
    else:  # float32 inference: the GELU inside the product is torch's own float32 GELU (on oneDNN) bit for bit
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        out = _onednn(rows, _packed_weight(weight, torch.float32, rows.shape[0]), bias, gelu=fused_gelu)
        out = out.view(*x.shape[:-1], weight.shape[0])
    if not gelu or fused_gelu:
        return out
    # a fresh product nothing else holds: overwriting it is safe where autograd does not need it
    return F.gelu(out) if out.requires_grad else torch.ops.aten.gelu_(out)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, init and state dict) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _register_flop_formula() -> None:
    """Count oneDNN's linear as FlopCounterMode counts `F.linear` (2 per multiply-add), so a trial's
    `flops` does not depend on which library ran it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or op in flop_registry:
        return

    @register_flop_formula(op)
    def _linear(x_shape, w_shape, *args, **kwargs) -> int:
        rows = 1
        for size in x_shape[:-1]:
            rows *= size
        return 2 * rows * x_shape[-1] * w_shape[0]


_register_flop_formula()
