"""`Linear` and `linear`: float32 CPU linear layers on oneDNN's GEMM where MKL's is the slower one.

torch runs a float32 `F.linear` (and its backward's two matmuls) on MKL. MKL picks its AVX-512
code by CPU vendor, not by the CPU's flags: on an AMD CPU with AVX-512 (Zen 4, Zen 5) it runs its
AVX2 code, at half of Zen 5's full-width AVX-512 peak. oneDNN, which torch also ships (it runs the
bf16 linears under autocast already), dispatches on the flags. On a 2-core Zen 5 EPYC, at ls_convit_tiny's shapes (1,576 tokens: 224 px,
batch 8; 192 -> 576, 768 and back), oneDNN's float32 products measured (side by side):
  forward    1.9-2.3x MKL's (475 vs 217 GFLOP/s at 192 -> 768)
  grad_input 2.3-2.5x
  grad_weight 1.4-1.9x where a weight dim is at least 192 (96 -> 288 at 12,544 rows: 2.25 vs
             3.64 ms), computed with the larger of the two weight dims as oneDNN's output features
             (the other way round it ran 0.6-0.9x at 12,800 rows); MKL's where both are smaller
and below about 2M multiply-adds oneDNN's fixed cost per call (~10 us) loses (0.3-0.8x), so those
stay on MKL. Results differ from MKL's by float32 rounding only (another summation order).

The weight gradient (grad^T input) runs best on neither library: oneDNN first copies one operand
into its transpose, MKL runs AVX2 code. Where the float32 attention kernel is built
(`_library`), it runs on that library's `linear_weight_grad` (`csrc/linear_fp32.h`: the
kernel's broadcast-FMA GEMM, which reads the transposed operand through its strides, over a fixed
split of the rows), where out_features or in_features is a multiple of 16. Side by side with the
rule above on the 2-core Zen 5 EPYC: 12,544 rows 96 -> 288 1.62 vs 2.43 ms, 96 -> 96 0.48 vs 1.18
(MKL), 384 -> 96 2.49 vs 2.82; 1,576 rows 192 -> 768 0.94 vs 1.21, 192 -> 192 0.24 vs 0.54 (MKL);
at larger widths 1.14-1.21x (ViT-B's 768 -> 3072 at 12,608 rows: 216 vs 245 ms), the one shape not
ahead 12,544 rows 768 -> 192 (11.0 vs 10.9 ms). `_USE_WEIGHT_GRAD_KERNEL = False` turns it off.

On Zen 4, whose 512-bit FMAs run as two 256-bit halves (so AVX2 code could reach the same peak),
oneDNN still wins: on a 2-core Zen 4 EPYC (2026-11-27, whole models, the two paths alternating in one
process, 10-30 repeats) float32 inference / training ls_convit_micro (batch 256) 1.13x / 1.13x,
ls_gmm_micro 1.25x / 1.15x, ls_refiner_micro 1.20x / 1.11x, ls_convit_tiny (224 px, batch 8)
1.07-1.08x / 1.03x, the outputs the same up to float32 rounding (8e-7).
Where MKL's AVX-512 code runs (Intel) and where neither library has AVX-512, torch's path is kept:
those were not measured to gain; except float32 inference on Intel's AVX-512 CPUs, where the packed
weights and the fused GELU below gain a little (`onednn_inference_beats_mkl_here`). Under CPU autocast `F.linear` runs in bf16 on oneDNN already, so
this rule is for float32 only. `_USE_ONEDNN_FP32 = False` turns it off (the benchmarks' side-by-side
rows). The trials' `flops` count the oneDNN op as the `F.linear` it replaces.

bf16 inference (CPU autocast to bf16, or bf16 tensors, with autograd not recording) runs on
oneDNN's linear op directly, with the bias added inside the GEMM: `F.linear` there goes through
`addmm`, which first copies the bias into every output row and then accumulates onto it. Same
casts, same result bit for bit. `linear(..., gelu=True)` also fuses the exact GELU (the MLP's fc1),
applied to the float32 sums before they are rounded to bf16, not after. On the 2-core Zen 5 EPYC at
ls_convit_tiny's fc1 (1,576 x 192 -> 768): F.linear + in-place GELU 642 us, fused bias 516 -> 492
(without the GELU), fused bias and GELU 592 us; ls_convit_tiny's bf16 inference at 224 px, batch 8,
35.3 -> 34.5 ms (bias) -> 34.0 ms (and GELU), 15 alternating repeats. `_USE_ONEDNN_BF16 = False`
turns it off (and with it the bf16 kernel's linear below). With autograd recording (training), `F.linear` runs as before.

On Zen 4 (AMD family 25 with AVX512-BF16 and no AMX), bf16 inference runs on the bf16 attention
kernel's linear instead (`csrc/linear_bf16.h`: its dot-product tiles, the bias and the exact GELU
applied to the float32 sums in registers before the one rounding to bf16), with the weight kept as
the tiles read it (`_kernel_weight`). Same operands, same single rounding, another summation order
than oneDNN's (so not bit for bit: within one bf16 step of the float64 product, tested). On the
2-core Zen 4 EPYC, side by side: at ls_convit_tiny's shapes (1,568 rows) 192 -> 576 762 vs 807 us,
192 -> 192 253 vs 282, 768 -> 192 1,006 vs 1,060, fc1 with its GELU 1,194 vs 1,293 us (oneDNN's
fused GELU costs 240 us, the kernel's 185). Not measured elsewhere, so other CPUs keep oneDNN (on
AMX it runs tiles these dot products cannot match). `_USE_BF16_KERNEL_LINEAR = False` turns it off.

float32 inference on oneDNN (the rule above) fuses fc1's GELU into the product too: oneDNN's
float32 GELU is the one torch's own F.gelu runs on a contiguous float32 tensor, so the output is
bit for bit the same (tested). On the 2-core Zen 5 EPYC at ls_convit_micro's fc1 (12,800 x 96 ->
384) 2.33 vs 2.68 ms alone; inside the model (profiled) 2.86 vs 2.31 + 0.81 ms, with the fc2 after
it 0.1-0.2 ms slower, so the model gains about 1% at most. `_FUSE_GELU = False` applies the GELU
after the product instead, in either precision.

Both inference paths hand oneDNN the weight already in its blocked layout (and, under autocast,
already cast to bf16), kept per weight until the weight changes (`_packed_weight`). Given a plain
(N, K) weight, oneDNN's product re-lays it out inside every call. Same product, bit for bit
(tested). On the 2-core Zen 5 EPYC, alternating in-process, 11-30 repeats, in several processes:
ls_convit_tiny inference (224 px, batch 8) 1.03-1.15x in float32 and in bf16; ls_convit_micro
(batch 256) 1.01-1.17x and 1.01-1.10x; GMM and Refiner micro 1.09-1.12x and 1.08x. The gain is
bimodal: about 1.02-1.03x in some processes and 1.14-1.15x in others, where the plain weights' product
ran slow (ls_convit_tiny bf16 31 vs 38 ms) and the packed one much less so. Packing on every call
loses (a reorder per call, 130 us at 192 -> 768), so training, whose weights change every step,
keeps the plain weights. `_PACK_WEIGHTS = False` turns it off.
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
from timm.models._features_fx import register_notrace_function

from trainers._cpu import cpu_family, cpuinfo_field
from trainers.kernels import _library
from trainers.kernels._kept import parameters_key
from trainers.kernels._switch import enabled

__all__ = ["Linear", "linear", "cpu_autocast_to_bf16", "kernel_bf16_linear_beats_onednn_here",
           "onednn_beats_mkl_here", "onednn_inference_beats_mkl_here", "onednn_runs_bf16_here", "records_autograd"]

_USE_ONEDNN_FP32 = True
_USE_ONEDNN_BF16 = True
# False: linear(..., gelu=True) applies the GELU after oneDNN's product, not inside it (the benchmarks' side-by-side rows)
_FUSE_GELU = True
# False: the inference paths hand oneDNN the plain weight on every call (see _packed_weight)
_PACK_WEIGHTS = True
_USE_WEIGHT_GRAD_KERNEL = True
# False: bf16 inference runs on oneDNN where the bf16 kernel's linear would (see the module doc)
_USE_BF16_KERNEL_LINEAR = True
# the float32 kernel's lanes where this module's path runs (AVX-512: onednn_beats_mkl_here asks for it)
_KERNEL_LANES = 16
_BF16_KERNEL_COLUMNS = 16  # the bf16 kernel's linear: its tiles' columns, N a multiple of them (csrc/linear_bf16.h)
MIN_MULTIPLY_ADDS = 1 << 21  # below: MKL (oneDNN's ~10 us per call loses at M 100, 96 -> 96: 0.68x)
# grad_weight (both operands transposed, which oneDNN copies first) stays on MKL where both weight
# dims are under this, as quick there (96 x 96: 1.20 vs 1.21 ms at 12,544 rows, 0.17 vs 0.25 ms at 1,576)
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
    dispatch sees it) on a vendor other than Intel (AMD's Zen 4 and Zen 5), with oneDNN present and
    not capped below AVX-512."""
    vendor, _ = _cpu_vendor_and_family()
    return _onednn_runs_avx512_here() and vendor not in ("", "GenuineIntel")


@functools.lru_cache(maxsize=None)
def kernel_bf16_linear_beats_onednn_here() -> bool:
    """Whether bf16 inference's linears run on the bf16 kernel here rather than on oneDNN: AMD
    family 25 (Zen 4; Zen 3 has no bf16 kernel) without AMX tiles, where it was measured to win."""
    vendor, family = _cpu_vendor_and_family()
    has_amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return vendor == "AuthenticAMD" and family == 25 and not has_amx


@functools.lru_cache(maxsize=None)
def onednn_inference_beats_mkl_here() -> bool:
    """Whether float32 inference (autograd not recording) runs on oneDNN here: where
    `onednn_beats_mkl_here`, and on Intel's AVX-512 CPUs, where MKL runs its own AVX-512 code but
    oneDNN's product on the weights kept in its layout, with fc1's GELU inside, still wins a little
    (ls_convit_tiny at 224 px, batch 8, on a 2-core Sapphire Rapids Xeon: 1.03-1.04x; its training
    step on oneDNN read 0.94x, so training keeps MKL there)."""
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
    if _PACK_WEIGHTS:
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
    if _USE_WEIGHT_GRAD_KERNEL and (out_features % _KERNEL_LANES == 0 or in_features % _KERNEL_LANES == 0):
        kernel = _library.kernels(torch.float32)
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
    return (bf16 and enabled() and _USE_ONEDNN_BF16 and x.device.type == "cpu" and weight.device.type == "cpu"
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
    if (_USE_BF16_KERNEL_LINEAR and out_features % _BF16_KERNEL_COLUMNS == 0 and in_features % 2 == 0
            and kernel_bf16_linear_beats_onednn_here()):
        kernel = _library.kernels(bf16)
        packed = None if kernel is None else _kernel_weight(weight)
        if packed is not None:
            if not (rows.is_contiguous() and rows.data_ptr() % 4 == 0):  # the kernel reads bf16 pairs as words
                rows = rows.clone(memory_format=torch.contiguous_format)
            return kernel.linear_bf16(rows, packed, bias_bf16, gelu).view(*x.shape[:-1], out_features)
    out = _onednn(rows, _packed_weight(weight, bf16, rows.shape[0]), bias_bf16, gelu=gelu)
    return out.view(*x.shape[:-1], out_features)


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return (enabled() and _USE_ONEDNN_FP32 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() >= 2 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and (onednn_beats_mkl_here()
                 or onednn_inference_beats_mkl_here() and not records_autograd(x, weight, bias))
            and x.numel() * weight.shape[0] >= MIN_MULTIPLY_ADDS)


@register_notrace_function  # reason: branches on dtype and device (timm's FX feature extraction)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           gelu: bool = False) -> torch.Tensor:
    """`F.linear` (then the exact `F.gelu` if `gelu`): bf16 inference on oneDNN's linear op (on Zen
    4 the bf16 kernel's), float32 on oneDNN's where it beats MKL (see the module doc), else
    `F.linear` itself. Without autograd recording, the GELU runs inside the product where the
    product runs on oneDNN or the kernel (unless _FUSE_GELU is off), else in place on the product."""
    fused_gelu = gelu and _FUSE_GELU
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
