// LayerNorm of float32 tokens written straight to bf16, for bf16 inference: what torch runs as
// layer_norm (float32 out, under autocast) and then the cast to bf16 at the linear that follows,
// in one pass over each row, optionally after adding a residual branch's output (float32 or bf16)
// to the tokens. attention_core.cpp includes this after its helpers (tail_mask, store_bf16,
// load_bf16_as_float); the op, `layer_norm`, is layer_norm_op.h's.
//
// Per row of C floats: s = x (+ r), mean = sum(s) / C, var = sum((s - mean)^2) / C (two passes
// over the row, in L1, as accurate as torch's Welford), out = bf16((s - mean) / sqrt(var + eps) * w + b).
#pragma once

#include <type_traits>

namespace {

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

using NormOut = bf16;
constexpr bool kNormResidualBf16 = true;  // the attention's projection, in bf16, as the residual branch

}  // namespace

#include "layer_norm_op.h"
