// A linear layer's forward in bf16 for bf16 inference, for trainers/kernels/_linear.py: y = x W^T + b,
// optionally then the exact GELU (the MLP's fc1), on the kernel's dot-product tiles (gemm_stored),
// the bias and the GELU applied to each tile's float32 sums in registers before they are rounded to
// bf16, as oneDNN's fused linear does. attention_core.cpp includes it after its GEMM and registers
// its op in that library.
//
//     linear_bf16(x (M, K) bf16, packed (K / 2, N) int32, bias (N) bf16 or None, gelu) -> (M, N) bf16
//
// `packed` is W (N, K) as the GEMM's B operand: word (p, n) holds W[n][2p] and W[n][2p + 1], i.e. W's
// rows read as K / 2 words each, transposed (_linear.py packs it once per weight). Each thread takes
// blocks of kLinearBlockRows rows and runs every column of a block before the next, so the block's
// rows stay in L1/L2 while the weight's columns pass.
#pragma once

namespace {

// 96: ls_convit_tiny's bf16 inference gained most with it, of 48, 96 and 192 (benchmarks/models.py)
constexpr int64_t kLinearBlockRows = 96;

// 0.5 x (1 + erf(x / sqrt 2)), the exact GELU: erf as Eigen's rational approximation on [-4, 4]
// (outside, erf is +-1 in float32), within 4.2e-7 of erf (checked against math.erf on [-6, 6]),
// far below the bf16 rounding that follows
inline __m512 gelu_erf(__m512 x) {
  const __m512 z = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)), _mm512_set1_ps(4.f)),
                                 _mm512_set1_ps(-4.f));
  const __m512 z2 = _mm512_mul_ps(z, z);
  __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(2.77068142495902e-08f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-2.10102402082508e-06f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-5.69250639462346e-05f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-7.34990630326855e-04f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-2.95459980854025e-03f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-1.60960333262415e-02f));
  __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-2.13374055278905e-04f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-1.68282697438203e-03f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-7.37332916720468e-03f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-1.42647390514189e-02f));
  const __m512 erf = _mm512_div_ps(_mm512_mul_ps(z, p), q);
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  return _mm512_fmadd_ps(half_x, erf, half_x);
}

template <bool kGelu>
void linear_rows(const uint32_t* x, const uint32_t* w, const bf16* bias, bf16* y, int64_t first, int64_t last,
                 int64_t pairs, int64_t N) {
  for (int64_t r0 = first; r0 < last; r0 += kLinearBlockRows) {
    bf16* block = y + r0 * N;
    gemm_stored(std::min(kLinearBlockRows, last - r0), N / kLanes, x + r0 * pairs, pairs, 1, w, N, pairs,
                [block, bias, N](int64_t row, int64_t column, __m512 sums) {
                  if (bias != nullptr) sums = _mm512_add_ps(sums, load_bf16_as_float(bias + column, 0xFFFF));
                  if constexpr (kGelu) sums = gelu_erf(sums);
                  store_bf16(block + row * N + column, sums, 0xFFFF);
                });
  }
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 2 == 0,
              "linear_bf16: x contiguous bf16 (M, K) with K even, got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), pairs = x.size(1) / 2;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.size(0) == pairs && packed.size(1) % kLanes == 0,
              "linear_bf16: packed contiguous int32 (K / 2, N) with N a multiple of ", kLanes, ", got ",
              packed.scalar_type(), " ", packed.sizes(), " for K ", x.size(1));
  const int64_t N = packed.size(1);
  const bf16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "linear_bf16: bias contiguous bf16 (", N, "), got ", bias->scalar_type(), " ", bias->sizes());
    b = bias->data_ptr<bf16>();
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0, "linear_bf16: x at an even offset");
  at::Tensor y = at::empty({M, N}, x.options());
  const uint32_t* px = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  bf16* py = y.data_ptr<bf16>();
  at::parallel_for(0, M, kLinearBlockRows, [&](int64_t first, int64_t last) {
    if (gelu) linear_rows<true>(px, pw, b, py, first, last, pairs, N);
    else linear_rows<false>(px, pw, b, py, first, last, pairs, N);
  });
  return y;
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define LINEAR_BF16_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LINEAR_BF16_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LINEAR_BF16_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, bool gelu) -> Tensor");
}

LINEAR_BF16_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
