// The CPU's multiply-add peak (multiply_add_peak.h) as its own small library, for
// benchmarks/_ceiling.py: built by benchmarks/peak/__init__.py with the flags of the attention
// kernel library of the same precision (trainers.kernels.build_cpu_library), so it runs that library's
// instruction. MULTIPLY_ADD_PEAK_BF16: the bf16 library's vdpbf16ps; else the float32 library's
// vector FMA, 16 lanes with AVX-512F, 8 with AVX2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

#if !defined(MULTIPLY_ADD_PEAK_BF16)
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
#endif
typedef float vec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vec splat(float x) {  // as the float32 library's: one vbroadcastss
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_set1_ps(x));
#else
  return reinterpret_cast<vec>(_mm256_set1_ps(x));
#endif
}
#endif

}  // namespace

#include "multiply_add_peak.h"
