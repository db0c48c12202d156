// LayerNorm of float32 tokens in float32, for float32 inference: torch's layer_norm, optionally
// after adding a residual branch's output to the tokens (the block's `x + branch`), in one pass over
// each row, where torch runs the add and then layer_norm, each a pass over the whole tensor.
// attention_core_fp32.cpp includes this after its vector helpers (vec, load_part, store_part, splat,
// reduce_add): kLanes wide, 16 with AVX-512, 8 with AVX2. The op, `layer_norm`, is layer_norm_op.h's.
//
// Per row of C floats: s = x (+ r), mean = sum(s) / C, var = sum((s - mean)^2) / C (two passes
// over the row, in L1: as accurate as torch's Welford; the result differs from torch's in the last
// bits), out = (s - mean) / sqrt(var + eps) * w + b.
#pragma once

#include <type_traits>

namespace {

// v's lanes from n on set to zero (0 <= n < kLanes): the squares past the end of a row's last vector
inline vec zero_from(vec v, int64_t n) { return lane_index() < static_cast<int32_t>(n) ? v : vec{}; }

// Residual: void (none) or float
template <typename Residual>
void layer_norm_rows(const float* x, const Residual* residual, float* sum, float* out, const float* weight,
                     const float* bias, int64_t first, int64_t last, int64_t C, float eps) {
  static_assert(std::is_void_v<Residual> || std::is_same_v<Residual, float>, "a float32 residual or none");
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t i = first; i < last; ++i) {
    const float* s = x + i * C;  // the tokens to normalise: x, or x + residual (written to sum)
    vec acc = vec{};
    if constexpr (std::is_void_v<Residual>) {
      for (int64_t j = 0; j < C; j += kLanes) acc += load_part(s, j, C);
    } else {
      float* sr = sum + i * C;
      for (int64_t j = 0; j < C; j += kLanes) {
        const vec v = load_part(s, j, C) + load_part(residual + i * C, j, C);  // 0 past C
        store_part(sr + j, v, C - j);
        acc += v;
      }
      s = sr;
    }
    const float mean = reduce_add(acc) * inv_c;
    vec squares = vec{};
    for (int64_t j = 0; j < C; j += kLanes) {
      const vec d = load_part(s, j, C) - splat(mean);
      squares += j + kLanes <= C ? d * d : zero_from(d * d, C - j);
    }
    const vec rstd = splat(1.f / std::sqrt(reduce_add(squares) * inv_c + eps));
    float* o = out + i * C;
    for (int64_t j = 0; j < C; j += kLanes)
      store_part(o + j, (load_part(s, j, C) - splat(mean)) * rstd * load_part(weight, j, C) + load_part(bias, j, C), C - j);
  }
}

using NormOut = float;
constexpr bool kNormResidualBf16 = false;  // float32 inference's branches are float32

}  // namespace

#include "layer_norm_op.h"
