// The CPU's multiply-add peak in the library's arithmetic, for benchmarks/_ceiling.py: every one of
// torch's threads runs independent chains of the one instruction the library's GEMMs are made of,
// with nothing else in the loop, so no code doing that arithmetic on these cores runs faster.
//   float32 library: a vector FMA (acc = acc * m + c), kLanes floats, 2 flops a lane
//   bf16 library:    vdpbf16ps (acc += a0 b0 + a1 b1 per float32 lane), 16 lanes, 4 flops a lane
// peak.cpp includes it after the float32 library's definitions (kLanes, vec, splat), or with
// MULTIPLY_ADD_PEAK_BF16 defined for the bf16 one.
//
//     multiply_add_peak(iterations) -> the flops done: threads x iterations x chains x flops an instruction
//
// 16 chains (12 with AVX2's 16 registers): each chain waits on its own last result, so the chains
// must cover the instruction's latency times the pipes issuing it (FMA on Zen 4: 4 cycles x 2
// pipes of 256 bits; vdpbf16ps: 6 x 2 at most).
#pragma once

namespace {

#if defined(MULTIPLY_ADD_PEAK_BF16)
constexpr int kPeakChains = 16;
constexpr int64_t kPeakFlopsPerInstruction = 16 * 4;
#else
constexpr int kPeakChains = kRegisters >= 32 ? 16 : 12;
constexpr int64_t kPeakFlopsPerInstruction = kLanes * 2;
#endif

int64_t multiply_add_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "multiply_add_peak: a positive iteration count, got ", iterations);
  const int64_t threads = at::get_num_threads();
  std::vector<float> sums(threads, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
#if defined(MULTIPLY_ADD_PEAK_BF16)
      __m512 acc[kPeakChains];
      for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
      // small operands: the sums grow by 2^-19 a step and stay normal and finite
      const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10f), _mm512_set1_ps(0x1p-10f));
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10f), _mm512_set1_ps(0x1p-10f));
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
      }
      __m512 total = acc[0];
      for (int c = 1; c < kPeakChains; ++c) total = _mm512_add_ps(total, acc[c]);
      sums[t] = _mm512_reduce_add_ps(total);
#else
      vec acc[kPeakChains];
      for (int c = 0; c < kPeakChains; ++c) acc[c] = splat(static_cast<float>(c));
      // a contraction towards a fixed point: the sums stay normal and finite however long it runs
      const vec m = splat(0.9999f), k = splat(1e-4f);
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < kPeakChains; ++c) acc[c] = acc[c] * m + k;
      }
      vec total = acc[0];
      for (int c = 1; c < kPeakChains; ++c) total += acc[c];
      for (int l = 0; l < kLanes; ++l) sums[t] += total[l];
#endif
    }
  });
  // the sums are used, so the loops are not optimised away
  volatile float sink = 0.f;
  for (float s : sums) sink = sink + s;
  return threads * iterations * kPeakChains * kPeakFlopsPerInstruction;
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first.
// No tensor argument to dispatch on: a catch-all kernel
#define PEAK_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

PEAK_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) { m.def("multiply_add_peak(int iterations) -> int", &multiply_add_peak); }
