// The strided views both kernels read and write through (attention_core.cpp in bf16,
// attention_core_fp32.cpp in float32), over the kernel's element type T. Each includes it first and
// names its instances Rows and Heads, which attention_ops.h uses.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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

}  // namespace
