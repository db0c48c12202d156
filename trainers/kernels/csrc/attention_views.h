// The strided views both kernels read and write through (attention_core.cpp in bf16,
// attention_core_fp32.cpp in float32), over the kernel's element type T. Each includes it first and
// names its instances Rows and Heads, which attention_ops.h uses; and the prefetching of their rows.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

// Before a loop over a GEMM tile's rows or vectors: unrolled whole, so its accumulators, indexed by
// constants only, stay in registers. Where one of those loops stayed a loop, GCC kept the whole
// accumulator array on the stack, zeroing it before the product and storing it after (seen in both
// kernels' disassembly). Unrolled, the GPSA layer's step runs faster in both precisions, bit for
// bit the same.
#define UNROLLED _Pragma("GCC unroll 64")

namespace {

// A strided matrix: row i at base + i * stride
template <typename T>
struct StridedRows {
  T* base;
  int64_t stride;
};

// A (batch, head)'s q, k, v in a (3, B, H, N, d) view with unit stride along d
template <typename T>
struct QkvHeads {
  T* base;
  at::IntArrayRef strides;
  StridedRows<T> at(int64_t which, int64_t b, int64_t h) const {
    return {base + which * strides[0] + b * strides[1] + h * strides[2], strides[3]};
  }
};

// ---- prefetching ---------------------------------------------------------------------------------
// Both always inlined: GCC took a function that only prefetches for one without side effects and
// dropped its calls (seen: prefetch_next_map compiled to nothing).

// `rows` rows of `cols` elements from src, each cache line they touch, into L1
template <typename T>
inline __attribute__((always_inline)) void prefetch_rows(StridedRows<T> src, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = reinterpret_cast<const char*>(src.base + i * src.stride);
    const char* end = row + cols * sizeof(T);
    for (const char* line = row - reinterpret_cast<uintptr_t>(row) % 64; line < end; line += 64)
      _mm_prefetch(line, _MM_HINT_T0);
  }
}

// The next map's q, k and v rows (and its dO rows, given) into cache while map (b, h) runs, issued
// after this map's own prefetches: the GPSA layer's inputs come cold from the projection (the
// forward) or from long before (the backward), and each map's copies and in-place reads stalled on
// them; with these prefetches both directions take less time, in both precisions.
template <typename T, typename Dims>
inline __attribute__((always_inline)) void prefetch_next_map(const Dims& D, const QkvHeads<T>& qkv, int64_t b,
                                                             int64_t h, StridedRows<T> d_out_next = {nullptr, 0}) {
  if (h + 1 == D.heads && b + 1 == D.batch) return;
  const int64_t nb = h + 1 < D.heads ? b : b + 1, nh = h + 1 < D.heads ? h + 1 : 0;
  for (int which = 0; which < 3; ++which) prefetch_rows(qkv.at(which, nb, nh), D.tokens, D.dim);
  if (d_out_next.base != nullptr) prefetch_rows(d_out_next, D.tokens, D.dim);
}

}  // namespace
