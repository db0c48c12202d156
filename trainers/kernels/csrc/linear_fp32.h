// A linear layer's weight gradient in float32, grad^T input, for trainers/kernels/_linear.py: the
// product both BLAS libraries run poorly at a linear's shapes on the CPUs where _linear puts the
// float32 linears on oneDNN (oneDNN first copies one operand into its transpose, MKL runs AVX2
// code). attention_core_fp32.cpp includes it after its GEMM (gemm: broadcast-FMA tiles with A read
// through any strides, so neither operand is transposed in memory) and registers its op in that
// library.
//
//     linear_weight_grad(grad (M, N), input (M, K)) = grad^T input  (N, K)
//
// The products run with the lanes along the wider of N and K (a multiple of kLanes), the rows along
// the other, over the M rows split into `parts` fixed by M alone, each part in blocks of rows; the
// parts' sums are added in order, so the result depends neither on the thread count nor on scheduling.
#pragma once

namespace {

constexpr int64_t kWeightGradRowsPerPart = 384;  // at least this many rows a part (fewer parts: fewer partial sums)
constexpr int64_t kWeightGradMaxParts = 8;
// a part's rows taken this many at a time (the tiles adding into the part's sums): B's rows for one
// column block then stay in L1 while every row tile passes over them. 128 rows: less time for GPSA's
// qkv and proj weight gradients than the whole part at once; 64 and 256 rows were in between
constexpr int64_t kWeightGradDepthBlock = 128;

// (N, K) float32; a (K, N) buffer's transposed view where the lanes run along N
at::Tensor linear_weight_grad(const at::Tensor& grad, const at::Tensor& input) {
  TORCH_CHECK(grad.dim() == 2 && input.dim() == 2 && grad.size(0) == input.size(0),
              "linear_weight_grad: grad (M, N) and input (M, K), got ", grad.sizes(), " and ", input.sizes());
  TORCH_CHECK(grad.scalar_type() == at::kFloat && input.scalar_type() == at::kFloat && grad.is_contiguous() &&
                  input.is_contiguous(),
              "linear_weight_grad: contiguous float32 grad and input");
  const int64_t M = grad.size(0), N = grad.size(1), K = input.size(1);
  // lanes along the wider dim that fills whole vectors: out (rows, lanes) = A^T B over the M rows
  const bool lanes_k = K % kLanes == 0 && (K >= N || N % kLanes != 0);
  TORCH_CHECK(lanes_k || N % kLanes == 0, "linear_weight_grad: N or K a multiple of ", kLanes, ", got N ", N,
              " and K ", K);
  const at::Tensor& a = lanes_k ? grad : input;  // broadcast, one row of the result per column
  const at::Tensor& b = lanes_k ? input : grad;  // in lanes
  const int64_t rows = a.size(1), lanes = b.size(1);
  const int64_t parts = std::clamp<int64_t>(M / kWeightGradRowsPerPart, 1, kWeightGradMaxParts);
  at::Tensor partial = at::empty({parts, rows, lanes}, grad.options());
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t part = first; part < last; ++part) {
      const int64_t m0 = M * part / parts, m1 = M * (part + 1) / parts;
      for (int64_t d0 = m0; d0 < m1; d0 += kWeightGradDepthBlock)
        gemm(rows, lanes / kLanes, pa + d0 * rows, 1, rows, pb + d0 * lanes, lanes, std::min(kWeightGradDepthBlock, m1 - d0),
             pp + part * rows * lanes, lanes, 1.f, -1, d0 > m0);
    }
  });
  at::Tensor out = parts == 1 ? partial[0] : at::empty({rows, lanes}, grad.options());
  if (parts > 1) {
    float* po = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r)
        for (int64_t j = 0; j < lanes; j += kLanes) {
          vec sum = load(pp + r * lanes + j);
          for (int64_t part = 1; part < parts; ++part) sum += load(pp + (part * rows + r) * lanes + j);
          store(po + r * lanes + j, sum);
        }
    });
  }
  return lanes_k ? out : out.t();
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define LINEAR_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LINEAR_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LINEAR_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) { m.def("linear_weight_grad(Tensor grad, Tensor input) -> Tensor"); }

LINEAR_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) { m.impl("linear_weight_grad", &linear_weight_grad); }
