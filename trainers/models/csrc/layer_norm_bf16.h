// LayerNorm of float32 tokens written straight to bf16, for bf16 inference: what torch runs as
// layer_norm (float32 out, under autocast) and then the cast to bf16 at the linear that follows,
// in one pass over each row, optionally after adding a residual branch's output to the tokens
// (the block's `x + branch`, whose float32 sum it also writes). attention_core.cpp includes this
// after its helpers (tail_mask, store_bf16); `PreNorm` and `add_and_norm` (trainers/models/_common.py)
// call it.
//
// Per row of C floats: s = x (+ r), mean = sum(s) / C, var = sum((s - mean)^2) / C (two passes
// over the row, in L1, as accurate as torch's Welford), out = bf16((s - mean) / sqrt(var + eps) * w + b).
#pragma once

#include <type_traits>

namespace {

inline __m512 load_bf16_as_float(const bf16* p, __mmask16 m) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Residual: void (none), float or bf16
template <typename Residual>
void layer_norm_rows(const float* x, const Residual* residual, float* sum, bf16* out, const float* weight,
                     const float* bias, int64_t first, int64_t last, int64_t C, float eps) {
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t i = first; i < last; ++i) {
    const float* xr = x + i * C;
    const float* s = xr;  // the tokens to normalise: x, or x + residual (written to sum)
    __m512 acc = _mm512_setzero_ps();
    if constexpr (std::is_void_v<Residual>) {
      for (int64_t j = 0; j < C; j += kLanes) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(tail_mask(j, C), xr + j));
    } else {
      float* sr = sum + i * C;
      const Residual* rr = residual + i * C;
      for (int64_t j = 0; j < C; j += kLanes) {
        const __mmask16 m = tail_mask(j, C);
        __m512 v = _mm512_maskz_loadu_ps(m, xr + j);
        if constexpr (std::is_same_v<Residual, bf16>) v = _mm512_add_ps(v, load_bf16_as_float(rr + j, m));
        else v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, rr + j));
        _mm512_mask_storeu_ps(sr + j, m, v);
        acc = _mm512_add_ps(acc, v);
      }
      s = sr;
    }
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) * inv_c);
    __m512 squares = _mm512_setzero_ps();
    for (int64_t j = 0; j < C; j += kLanes) {
      const __mmask16 m = tail_mask(j, C);
      const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, s + j), mean);  // 0 in the tail
      squares = _mm512_fmadd_ps(d, d, squares);
    }
    const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) * inv_c + eps));
    bf16* o = out + i * C;
    for (int64_t j = 0; j < C; j += kLanes) {
      const __mmask16 m = tail_mask(j, C);
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mean), rstd);
      store_bf16(o + j, _mm512_fmadd_ps(d, _mm512_maskz_loadu_ps(m, weight + j), _mm512_maskz_loadu_ps(m, bias + j)), m);
    }
  }
}

void check_norm_input(const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == sizes, what,
              ": a contiguous CPU ", dtype, " tensor of size ", sizes, ", got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// x (..., C) float32; residual (..., C) float32 or bf16, or none; weight, bias (C) float32.
// -> [LayerNorm(x (+ residual)) in bf16] or, with a residual, [that, x + residual in float32]
std::vector<at::Tensor> layer_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                        const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.dim() >= 1, "layer_norm_bf16: x (..., C), got a 0-d tensor");
  check_norm_input(x, x.sizes(), at::kFloat, "x");
  const int64_t C = x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
  check_norm_input(weight, {C}, at::kFloat, "weight");
  check_norm_input(bias, {C}, at::kFloat, "bias");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1));  // rows per task: ~32 KB
  const auto* w = weight.data_ptr<float>();
  const auto* b = bias.data_ptr<float>();
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  if (!residual.has_value()) {
    at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
      layer_norm_rows<void>(x.data_ptr<float>(), nullptr, nullptr, o, w, b, first, last, C, e);
    });
    return {out};
  }
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.scalar_type() == at::kFloat || r.scalar_type() == at::kBFloat16,
              "residual: float32 or bfloat16, got ", r.scalar_type());
  check_norm_input(r, x.sizes(), r.scalar_type(), "residual");
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    if (r.scalar_type() == at::kBFloat16)
      layer_norm_rows<bf16>(x.data_ptr<float>(), reinterpret_cast<const bf16*>(r.data_ptr()), sum.data_ptr<float>(),
                            o, w, b, first, last, C, e);
    else
      layer_norm_rows<float>(x.data_ptr<float>(), r.data_ptr<float>(), sum.data_ptr<float>(), o, w, b, first, last,
                             C, e);
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(locality_search, m) {
  m.def("layer_norm_bf16(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(locality_search, CPU, m) { m.impl("layer_norm_bf16", &layer_norm_bf16); }
