// The CPU attention core in bf16 as one fused kernel per direction: for each (batch, head) its
// N x N maps are formed, used and dropped in the core's cache-sized buffers, the GEMMs run on
// AVX512-BF16 dot products, and q, k, v, the output and the gradients are read and written in
// whatever strides the caller has (the projection's (B, N, 3, H, d) output, permuted), so there is
// no layout copy either. trainers/kernels/_library.py builds and loads this file.
//
// Forward, per (batch b, head h), with q, k, v (N x d, bf16):
//     S = scale q k^T                             (float32, from bf16 products)
//       or S = (scale q k^T) * M[h] elementwise with a score mask (GMM attention; M float32)
//     soft = softmax(S) per row                   (float32; each row's max and 1 / sum kept)
//     A = (1 - s_h) soft + s_h P[h]  (GPSA) or A = soft, rounded to bf16
//     out = A v                                   (rounded to bf16)
// Backward, from dO and the same inputs, recomputing S, soft and A bit for bit from the rows' max
// and 1 / sum rather than keeping B x H x N x N maps from the forward:
//     dA = dO v^T,  dV = A^T dO
//     dS = c_h soft (dA - <dA, soft>) with c_h = (1 - s_h) scale (plain attention: scale),
//          times M[h] elementwise with a mask
//     dQ = dS k,  dK = dS^T q
//     and, for the gate and P's gradients, sum_b dA (H x N x N) and sum_{b, i} <dA_i, soft_i> per head;
//     with a mask instead, for its gradient, sum_b (soft (dA - <dA, soft>)) * (scale q k^T) (H x N x N).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_views.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512BF16__)
#error "attention_core.cpp needs AVX-512 (F, BW, VL, BF16); _library.py builds it only where the CPU has them"
#endif

namespace {

using bf16 = at::BFloat16;

constexpr int64_t kMaxTokens = 1024;
constexpr int64_t kLanes = 16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline __mmask16 tail_mask(int64_t j, int64_t n) {
  const int64_t left = n - j;
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

inline void store_bf16(bf16* p, __m512 v, __mmask16 m) {  // round to nearest even, as torch casts
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

inline __m512 load_bf16_as_float(const bf16* p, __mmask16 m) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// exp(x) for x <= 0 (scores minus their row's max), within 2e-7 of it relative (a few ulp): x = n ln 2
// + r with n = round(x / ln 2), |r| <= ln 2 / 2; exp(r) as 1 + r + r^2 q(r), q a cubic fitted to it
// there (least squares on Chebyshev nodes, relative); 2^n put straight into the exponent bits of the
// float that rounded x / ln 2 (its low mantissa bits hold n + 127 after adding 1.5 * 2^23 + 127).
// 12 floating-point operations a vector, where Cephes' degree-7 polynomial with a round and a scalef
// took 14: the bf16 forward's softmax passes are bound by them
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // NaN in, NaN out (max returns its second operand)
  const __m512 shifter = _mm512_set1_ps(12583039.f);  // 1.5 * 2^23 + 127
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter);
  const __m512 n = _mm512_sub_ps(t, shifter);  // round(x / ln 2), in [-126, 0]
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(0.008333838f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.04189858f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.16666886f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.49999142f));
  const __m512 e = _mm512_fmadd_ps(_mm512_mul_ps(q, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i two_n = _mm512_slli_epi32(_mm512_castps_si512(t), 23);  // (n + 127) << 23: 2^n
  return _mm512_mul_ps(e, _mm512_castsi512_ps(two_n));
}

// ---- GEMMs on bf16 pairs --------------------------------------------------------------------
// Operands are 32-bit words holding two bf16 along the reduction: C[r][col] = sum_p <A(r, p), B[p][col]>
// with A(r, p) = a[r * am + p * ap] (any strides: a row-major matrix, or a transposed one) and B's
// rows `ldb` words apart, columns in vector lanes (`vnni` layout). Columns are padded to 16. Each
// tile hands its float32 sums to `store(row, column, sums)` (16 columns from `column`), which writes
// them: scaled into a float32 matrix (gemm), or with a bias and a GELU into bf16 (linear_bf16.h).

template <int MR, int NV, typename Store>
inline void gemm_tile(const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b, int64_t ldb, int64_t pairs,
                      int64_t row, int64_t column, Store& store) {
  __m512 acc[MR][NV];
  UNROLLED
  for (int r = 0; r < MR; ++r)
    UNROLLED
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
    UNROLLED
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + v * kLanes);
    UNROLLED
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * am + p * ap]));
      UNROLLED
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  UNROLLED
  for (int r = 0; r < MR; ++r)
    UNROLLED
    for (int v = 0; v < NV; ++v) store(row + r, column + v * kLanes, acc[r][v]);
}

template <int NV>
constexpr int kTileRows = NV == 4 ? 6 : NV == 3 ? 8 : 12;  // MR x NV accumulators + NV + 1 of 32 registers

template <int NV, int MR = 1, typename Store>
inline void gemm_tail(int64_t rows, const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b, int64_t ldb,
                      int64_t pairs, int64_t row, int64_t column, Store& store) {
  if constexpr (MR < kTileRows<NV>) {
    if (rows == MR) return gemm_tile<MR, NV>(a, am, ap, b, ldb, pairs, row, column, store);
    gemm_tail<NV, MR + 1>(rows, a, am, ap, b, ldb, pairs, row, column, store);
  }
}

template <int NV, typename Store>
void gemm_columns(int64_t m, const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b, int64_t ldb,
                  int64_t pairs, int64_t column, Store& store) {
  constexpr int MR = kTileRows<NV>;
  int64_t r = 0;
  for (; r + MR <= m; r += MR) gemm_tile<MR, NV>(a + r * am, am, ap, b, ldb, pairs, r, column, store);
  if (r < m) gemm_tail<NV>(m - r, a + r * am, am, ap, b, ldb, pairs, r, column, store);
}

// A B (m rows, 16 * vectors columns) in tiles, each tile's sums handed to store (rows from 0)
template <typename Store>
void gemm_stored(int64_t m, int64_t vectors, const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b,
                 int64_t ldb, int64_t pairs, Store&& store) {
  for (int64_t v = 0; v < vectors; v += 4) {
    const uint32_t* bv = b + v * kLanes;
    const int64_t column = v * kLanes;
    switch (std::min<int64_t>(4, vectors - v)) {
      case 4: gemm_columns<4>(m, a, am, ap, bv, ldb, pairs, column, store); break;
      case 3: gemm_columns<3>(m, a, am, ap, bv, ldb, pairs, column, store); break;
      case 2: gemm_columns<2>(m, a, am, ap, bv, ldb, pairs, column, store); break;
      default: gemm_columns<1>(m, a, am, ap, bv, ldb, pairs, column, store); break;
    }
  }
}

// C (m rows, ldc floats apart; 16 * vectors columns) = alpha * A B
void gemm(int64_t m, int64_t vectors, const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b, int64_t ldb,
          int64_t pairs, float* c, int64_t ldc, float alpha = 1.f) {
  const __m512 va = _mm512_set1_ps(alpha);
  gemm_stored(m, vectors, a, am, ap, b, ldb, pairs, [c, ldc, va](int64_t row, int64_t column, __m512 sums) {
    _mm512_storeu_ps(c + row * ldc + column, _mm512_mul_ps(sums, va));
  });
}

inline const uint32_t* words(const bf16* p) { return reinterpret_cast<const uint32_t*>(p); }

// dst[p][c] = (x[2p][c], x[2p+1][c]) for p < ceil(n / 2) and c < cols rounded up to 16; zero past n
// rows and cols. x's rows are `stride` elements apart. Makes x the B operand of x^T-free products
// (A x), and its words at [p][j] the A operand of x^T products (x^T B) read with am = 1, ap = ld.
void interleave_rows(const bf16* x, int64_t stride, int64_t n, int64_t cols, uint32_t* dst, int64_t ld) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  for (int64_t p = 0; 2 * p < n; ++p) {
    const bf16* r0 = x + 2 * p * stride;
    const bf16* r1 = 2 * p + 1 < n ? r0 + stride : nullptr;
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 k = tail_mask(c, cols);
      const __m256i lo = _mm256_maskz_loadu_epi16(k, r0 + c);
      const __m256i hi = r1 == nullptr ? _mm256_setzero_si256() : _mm256_maskz_loadu_epi16(k, r1 + c);
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(dst + p * ld + c, _mm512_permutexvar_epi16(idx, both));
    }
  }
}

// r[0..15] (16 rows of 16 words) transposed in registers: 32- then 64-bit unpacks transpose the 4 x 4
// blocks inside each 128-bit lane, two rounds of 128-bit lane shuffles the 4 x 4 blocks of lanes
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i s[4][4];  // s[a][b], lane l: word 4l + b of rows 4a..4a+3
  for (int a = 0; a < 4; ++a) {
    s[a][0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    s[a][1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    s[a][2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    s[a][3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int b = 0; b < 4; ++b) {  // word 4l + b of all rows: lane a from s[a][b]'s lane l
    const __m512i lo01 = _mm512_shuffle_i32x4(s[0][b], s[1][b], 0x44), hi01 = _mm512_shuffle_i32x4(s[0][b], s[1][b], 0xEE);
    const __m512i lo23 = _mm512_shuffle_i32x4(s[2][b], s[3][b], 0x44), hi23 = _mm512_shuffle_i32x4(s[2][b], s[3][b], 0xEE);
    r[b] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    r[4 + b] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
    r[8 + b] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    r[12 + b] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
  }
}

// dst[p][j] = (x[j][2p], x[j][2p+1]) for p < pairs and j < n rounded up to 16 (zero past n): x^T as the
// B operand of x^T products (S = q k^T, dA = dO v^T). In 16 x 16 register blocks (gathers, one per
// word, measured slower)
void transpose_words(const bf16* x, int64_t stride, int64_t n, int64_t pairs, uint32_t* dst, int64_t ld) {
  const int* base = reinterpret_cast<const int*>(x);
  const int64_t row_words = stride / 2;
  for (int64_t j = 0; j < n; j += kLanes)
    for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
      const __mmask16 k = tail_mask(p0, pairs);
      __m512i r[16];
      for (int64_t i = 0; i < kLanes; ++i)
        r[i] = j + i < n ? _mm512_maskz_loadu_epi32(k, base + (j + i) * row_words + p0) : _mm512_setzero_si512();
      transpose_16x16(r);
      for (int64_t c = 0; c < std::min<int64_t>(kLanes, pairs - p0); ++c) _mm512_storeu_si512(dst + (p0 + c) * ld + j, r[c]);
    }
}

// ---- one (batch, head) -------------------------------------------------------------------------

struct Dims {
  int64_t batch, heads, tokens, dim;
  int64_t tokens_pad, dim_pad, pairs;  // N and d rounded up to 16; ceil(N / 2) pairs of tokens
  Dims(int64_t B, int64_t H, int64_t N, int64_t d)
      : batch(B), heads(H), tokens(N), dim(d), tokens_pad(round_up(N, kLanes)), dim_pad(round_up(d, kLanes)),
        pairs((N + 1) / 2) {}
};

using Rows = StridedRows<bf16>;  // attention_views.h
using Heads = QkvHeads<bf16>;

// One thread's buffers, N x N maps with rows tokens_pad apart
struct Buffers {
  std::vector<float> scores, d_attn, out;  // S then soft; dA; an N x d product before its rounding
  std::vector<float> raw;                  // scale q k^T before a mask
  std::vector<bf16> attn, d_scores;        // A; dS (rows zero past N up to tokens_pad)
  std::vector<uint32_t> keys_t, values_t, rows_i, maps_i;
  alignas(64) float e[kMaxTokens + kLanes];
  Buffers(const Dims& D, bool masked)
      : scores(D.tokens * D.tokens_pad), d_attn(D.tokens * D.tokens_pad), out(D.tokens * D.dim_pad),
        raw(masked ? D.tokens * D.tokens_pad : 0),
        attn(D.tokens * D.tokens_pad), d_scores(D.tokens * D.tokens_pad), keys_t(D.dim / 2 * D.tokens_pad),
        values_t(D.dim / 2 * D.tokens_pad), rows_i(D.pairs * D.dim_pad), maps_i(D.pairs * D.tokens_pad) {}
};

// rows x d of buf.out, rounded to bf16, into a strided matrix
void store_rows(const Dims& D, const float* src, Rows dst) {
  for (int64_t i = 0; i < D.tokens; ++i)
    for (int64_t c = 0; c < D.dim; c += kLanes)
      store_bf16(dst.base + i * dst.stride + c, _mm512_loadu_ps(src + i * D.dim_pad + c), tail_mask(c, D.dim));
}

// x (N x d) @ y where y's B operand is `b` (pairs x dim_pad words), rounded into dst
void product_into(const Dims& D, const uint32_t* a, int64_t am, int64_t ap, const uint32_t* b, Buffers& buf,
                  Rows dst) {
  gemm(D.tokens, D.dim_pad / kLanes, a, am, ap, b, D.dim_pad, D.pairs, buf.out.data(), D.dim_pad);
  store_rows(D, buf.out.data(), dst);
}

// S = scale q k^T (with a mask: that product kept in buf.raw, S = it times the mask), then row by
// row soft and A into buf.attn (bf16, zero past N). Forward (recompute false): each row's max and
// 1 / sum into row_max and row_inv when they are given.
// Backward (recompute true): soft from them, bit for bit as the forward had it, left in buf.scores.
void form_maps(const Dims& D, Rows q, Rows k, float scale, const float* gate, const float* pos, const float* mask,
               int64_t h, Buffers& buf, float* row_max, float* row_inv, bool recompute) {
  const int64_t N = D.tokens, ld = D.tokens_pad, n_even = round_up(N, 2);
  float* product = mask == nullptr ? buf.scores.data() : buf.raw.data();
  transpose_words(k.base, k.stride, N, D.dim / 2, buf.keys_t.data(), ld);
  gemm(N, ld / kLanes, words(q.base), q.stride / 2, 1, buf.keys_t.data(), ld, D.dim / 2, product, ld, scale);
  float* e = buf.e;
  const float g = pos == nullptr ? 0.f : gate[h];
  const __m512 vg = _mm512_set1_ps(g), vc = _mm512_set1_ps(1.f - g);
  for (int64_t i = 0; i < N; ++i) {
    float* s = buf.scores.data() + i * ld;
    if (mask != nullptr) {  // (lanes past N are read masked below)
      const float* m = mask + (h * N + i) * N;
      for (int64_t j = 0; j < N; j += kLanes) {
        const __mmask16 k = tail_mask(j, N);
        _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(product + i * ld + j), _mm512_maskz_loadu_ps(k, m + j)));
      }
    }
    __m512 vmax;
    if (recompute) {
      vmax = _mm512_set1_ps(row_max[i]);
    } else {
      __m512 m = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < N; j += kLanes) {
        const __mmask16 k = tail_mask(j, N);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + j));
      }
      vmax = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < N; j += kLanes) {  // e = exp(S - max), zero past N
      const __mmask16 k = tail_mask(j, N);
      const __m512 ej = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vmax)));
      sum = _mm512_add_ps(sum, ej);
      _mm512_store_ps(e + j, ej);
    }
    float inv;
    if (recompute) {
      inv = row_inv[i];
    } else {
      inv = 1.f / _mm512_reduce_add_ps(sum);
      if (row_max != nullptr) {
        row_max[i] = _mm512_cvtss_f32(vmax);
        row_inv[i] = inv;
      }
    }
    const __m512 vinv = _mm512_set1_ps(inv);
    const float* p = pos == nullptr ? nullptr : pos + (h * N + i) * N;
    bf16* a = buf.attn.data() + i * ld;
    for (int64_t j = 0; j < n_even; j += kLanes) {  // through N rounded up to even: A's last pair is whole
      const __m512 soft = _mm512_mul_ps(_mm512_load_ps(e + j), vinv);
      if (recompute) _mm512_storeu_ps(s + j, soft);
      const __m512 mixed =
          p == nullptr ? soft : _mm512_fmadd_ps(vc, soft, _mm512_mul_ps(vg, _mm512_maskz_loadu_ps(tail_mask(j, N), p + j)));
      store_bf16(a + j, mixed, tail_mask(j, n_even));
    }
  }
}

// kept: always null here (kKeepsMaps: the ops refuse it for this kernel)
void forward_map(const Dims& D, const Heads& qkv, int64_t b, int64_t h, float scale, const float* gate,
                 const float* pos, const float* mask, Rows out, Buffers& buf, float* row_max, float* row_inv,
                 float* /*kept*/) {
  const Rows v = qkv.at(2, b, h);
  prefetch_next_map(D, qkv, b, h);
  form_maps(D, qkv.at(0, b, h), qkv.at(1, b, h), scale, gate, pos, mask, h, buf, row_max, row_inv, false);
  interleave_rows(v.base, v.stride, D.tokens, D.dim, buf.rows_i.data(), D.dim_pad);
  product_into(D, words(buf.attn.data()), D.tokens_pad / 2, 1, buf.rows_i.data(), buf, out);  // A v
}

// sum_rows: this thread's sum_b dA, or with a mask sum_b soft (dA - <dA, soft>) * buf.raw (H x N x N,
// or null); head_dot: its sum <dA, soft> for head h; d_out_next: the next map's dO rows (base null
// after the last)
void backward_map(const Dims& D, const Heads& qkv, const Heads& d_qkv, Rows d_out, Rows d_out_next, int64_t b,
                  int64_t h, float scale, const float* gate, const float* pos, const float* mask, const float* row_max,
                  const float* row_inv, const float* /*kept*/, float coef, Buffers& buf, float* sum_rows,
                  double* head_dot) {
  const int64_t N = D.tokens, ld = D.tokens_pad, n_even = round_up(N, 2);
  const Rows q = qkv.at(0, b, h), k = qkv.at(1, b, h), v = qkv.at(2, b, h);
  prefetch_next_map(D, qkv, b, h, d_out_next);
  form_maps(D, q, k, scale, gate, pos, mask, h, buf, const_cast<float*>(row_max), const_cast<float*>(row_inv), true);
  // dA = dO v^T (N x N, float32)
  transpose_words(v.base, v.stride, N, D.dim / 2, buf.values_t.data(), ld);
  gemm(N, ld / kLanes, words(d_out.base), d_out.stride / 2, 1, buf.values_t.data(), ld, D.dim / 2,
       buf.d_attn.data(), ld);
  // dS = coef soft (dA - <dA, soft>) row by row, times the mask, in bf16 (zero past N); the sums
  const __m512 vc = _mm512_set1_ps(coef);
  for (int64_t i = 0; i < N; ++i) {
    const float* s = buf.scores.data() + i * ld;
    const float* da = buf.d_attn.data() + i * ld;
    float* acc = sum_rows == nullptr ? nullptr : sum_rows + (h * N + i) * N;
    __m512 vdot = _mm512_setzero_ps();
    for (int64_t j = 0; j < N; j += kLanes) {
      const __mmask16 k = tail_mask(j, N);
      const __m512 dv = _mm512_maskz_loadu_ps(k, da + j);
      vdot = _mm512_fmadd_ps(dv, _mm512_maskz_loadu_ps(k, s + j), vdot);
      // unmasked: past N the lanes add 0 to the next row (the accumulator ends in kLanes of padding)
      if (acc != nullptr && mask == nullptr) _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), dv));
    }
    const float dot = _mm512_reduce_add_ps(vdot);
    if (head_dot != nullptr) *head_dot += dot;
    const __m512 vd = _mm512_set1_ps(dot);
    bf16* ds = buf.d_scores.data() + i * ld;
    const float* m = mask == nullptr ? nullptr : mask + (h * N + i) * N;
    const float* product = mask == nullptr ? nullptr : buf.raw.data() + i * ld;
    for (int64_t j = 0; j < n_even; j += kLanes) {
      const __mmask16 k = tail_mask(j, N);
      // d(loss)/d(S), S masked or not: zero past N
      const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), _mm512_sub_ps(_mm512_maskz_loadu_ps(k, da + j), vd));
      if (m == nullptr) {
        store_bf16(ds + j, _mm512_mul_ps(vc, g), tail_mask(j, n_even));
        continue;
      }
      if (acc != nullptr)
        _mm512_mask_storeu_ps(acc + j, k, _mm512_fmadd_ps(g, _mm512_loadu_ps(product + j), _mm512_maskz_loadu_ps(k, acc + j)));
      store_bf16(ds + j, _mm512_mul_ps(_mm512_mul_ps(vc, g), _mm512_maskz_loadu_ps(k, m + j)), tail_mask(j, n_even));
    }
  }
  // dV = A^T dO
  interleave_rows(buf.attn.data(), ld, N, N, buf.maps_i.data(), ld);
  interleave_rows(d_out.base, d_out.stride, N, D.dim, buf.rows_i.data(), D.dim_pad);
  product_into(D, buf.maps_i.data(), 1, ld, buf.rows_i.data(), buf, d_qkv.at(2, b, h));
  // dQ = dS k
  interleave_rows(k.base, k.stride, N, D.dim, buf.rows_i.data(), D.dim_pad);
  product_into(D, words(buf.d_scores.data()), ld / 2, 1, buf.rows_i.data(), buf, d_qkv.at(0, b, h));
  // dK = dS^T q
  interleave_rows(buf.d_scores.data(), ld, N, N, buf.maps_i.data(), ld);
  interleave_rows(q.base, q.stride, N, D.dim, buf.rows_i.data(), D.dim_pad);
  product_into(D, buf.maps_i.data(), 1, ld, buf.rows_i.data(), buf, d_qkv.at(1, b, h));
}

// ---- what the ops (attention_ops.h) need besides ---------------------------------------------

using Element = bf16;
constexpr at::ScalarType kElement = at::kBFloat16;
constexpr bool kScoreMask = true;
constexpr bool kKeepsMaps = false;  // the ops refuse keep_maps: the backward recomputes
constexpr bool kKeyMajorMaps = false;  // a query per row

// 32-bit aligned rows: the kernel reads bf16 pairs as words
void check_layout(const at::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, what, ": rows at even offsets");
  for (int64_t i = 0; i + 1 < dims; ++i) TORCH_CHECK(t.stride(i) % 2 == 0, what, ": even strides, got ", t.strides());
}

void check_dims(const Dims& D) { TORCH_CHECK(D.dim >= 2 && D.dim % 2 == 0, "qkv: an even head dim, got ", D.dim); }

}  // namespace

#define ATTENTION_LIBRARY locality_search
#include "attention_ops.h"
#include "layer_norm_bf16.h"
#include "linear_bf16.h"
