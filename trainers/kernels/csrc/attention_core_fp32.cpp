// The CPU attention core in float32 as one fused kernel per direction: the float32 sibling of
// attention_core.cpp (bf16, AVX512-BF16), same algorithm, same ops, for any x86-64 CPU with AVX2
// and FMA. Written with GCC vector extensions, W lanes wide: 16 where the build has AVX-512F, else
// 8. trainers/kernels/_build.py builds and loads this file. It also holds the Refiner's map
// refinement (refiner_fp32.h), a linear layer's weight gradient (linear_fp32.h) and GPSA's whole layer
// (gpsa_layer_fp32.h), included at the end.
//
// Forward, per (batch b, head h), with q, k, v (N x d, float32):
//     S = scale q k^T,  or S = (scale q k^T) * M[h] elementwise with a score mask (GMM attention)
//     soft = softmax(S) per row                   (each row's max and 1 / sum kept)
//     A = (1 - s_h) soft + s_h P[h]  (GPSA) or A = soft
//     out = A v
// Backward, from dO and the same inputs, with soft as the forward kept it (B x H x N x N, when the
// caller asks: saves the recomputation, `ratio_kept_maps_gain` in benchmarks/gpsa_layer.py), else
// recomputing S and soft bit for bit from the rows' max and 1 / sum; A from soft:
//     dA = dO v^T,  dV = A^T dO
//     dS = c_h soft (dA - <dA, soft>) with c_h = (1 - s_h) scale (plain attention: scale),
//          times M[h] elementwise with a mask
//     dQ = dS k,  dK = dS^T q
//     and, for the gate and P's gradients, sum_b dA (H x N x N) and sum_{b, i} <dA_i, soft_i> per head;
//     with a mask instead, for its gradient, sum_b (soft (dA - <dA, soft>)) * (scale q k^T) (H x N x N).
// The kernel holds every N x N map transposed, key-major (form_maps): S^T = scale k q^T, soft^T, A^T,
// dA^T = v dO^T, dS^T, and the kept maps; it reads P[h] and M[h] transposed and returns the sums
// transposed back, each with its rows tokens_pad floats apart, zero past N (attention_ops.h,
// kKeyMajorMaps, map_layout): whole aligned vectors, no masked loads (quicker than unpadded rows).
// Where a product reads q, k, v or dO a whole vector at a time they are copied per (batch, head)
// into padded buffers (N x d: small next to the N x N x d products; read in place instead, masked,
// the kernel ran slower); where it reads them one float at a time (k in S^T,
// v in dA^T), in place. With AVX-512 the products' N x d results go straight to their strided rows,
// the last vector of each stored masked: quicker than copying all four every time and going
// through a buffer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_views.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "attention_core_fp32.cpp needs AVX2 and FMA; _library.py builds it only where the CPU has them"
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
#endif
typedef float vec __attribute__((vector_size(kLanes * 4), aligned(4)));  // unaligned loads and stores
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));

constexpr int64_t kMaxTokens = 1024;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
// row[j + l] for the lanes with j + l < n, zero past: an unpadded row of N floats (row_max, row_inv).
// A masked load (no fault past n): a lane-by-lane loop here compiled to a memcpy call onto the stack
// and a vector load of it on every row's last vector
#if defined(__AVX512F__)
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }  // 0 <= n < kLanes
#else
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif
inline vec load_part(const float* row, int64_t j, int64_t n) {
  if (j + kLanes <= n) return load(row + j);
  const int64_t left = std::max<int64_t>(n - j, 0);  // 0 <= left < kLanes
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_maskz_loadu_ps(first_lanes(left), row + j));
#else
  return reinterpret_cast<vec>(_mm256_maskload_ps(row + j, first_lanes(left)));
#endif
}
inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }
// p[l] = v[l] for the lanes l < n (n >= 1), p past them untouched: a masked store
inline void store_part(float* p, vec v, int64_t n) {
  if (n >= kLanes) return store(p, v);
#if defined(__AVX512F__)
  _mm512_mask_storeu_ps(p, first_lanes(n), reinterpret_cast<__m512>(v));
#else
  _mm256_maskstore_ps(p, first_lanes(n), reinterpret_cast<__m256>(v));
#endif
}
// a store past the caches (p aligned to a vector) for the kept maps, which only the backward reads,
// long after: saves reading their lines in first.
// The thread that streams them fences before its part of the op ends (attention_ops.h)
inline void stream(float* p, vec v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
#else
  _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
#endif
}
inline vec splat(float x) {  // one vbroadcastss (GCC builds `vec{} + x` with an add, a loop with inserts)
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_set1_ps(x));
#else
  return reinterpret_cast<vec>(_mm256_set1_ps(x));
#endif
}

// n floats (memcpy: an inline loop, a vector load and store at a time, measured slower on the
// whole kernel)
inline void copy_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline ivec lane_index() {
  ivec v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// a vector's lanes summed pairwise, halves then quarters..., not one after another (GCC builds the
// plain loop as a chain of kLanes dependent scalar adds)
inline float reduce_add(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  const __m256 w = reinterpret_cast<__m256>(v);
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ps(quarter, _mm_movehdup_ps(quarter)));
#endif
}

// exp(x) for x <= 0 (scores minus their query's max), within 2 ulp of expf: Cephes' polynomial on
// x - n ln 2 (n rounded to nearest by the 1.5 * 2^23 trick), then scaled by 2^n through the exponent
inline vec exp_nonpositive(vec x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;  // NaN fails the comparison: NaN in, NaN out
  const vec shifter = splat(12582912.f);
  const vec t = x * splat(1.44269504088896341f) + shifter;
  const vec n = t - shifter;
  vec r = x - n * splat(0.693359375f);
  r = r + n * splat(2.12194440e-4f);
  vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = (p * r) * r + (r + splat(1.f));
  // 2^n from n's bits in t (a bit cast: a reinterpret_cast here breaks strict aliasing under -O3)
  const ivec bits = (__builtin_bit_cast(ivec, t) - 0x4B400000 + 127) << 23;
  return p * __builtin_bit_cast(vec, bits);
}

// ---- GEMMs ----------------------------------------------------------------------------------
// C[r][col] = alpha sum_p A(r, p) B[p][col] with A(r, p) = a[r * am + p * ap] (any strides: a
// row-major matrix, or a transposed one) and B's rows `ldb` floats apart, its columns in lanes.

// `last`: the lanes of C's last vector column to store (kLanes: all; fewer only with AVX-512);
// `add`: C += alpha A B (C's lanes all stored) instead of C = alpha A B
template <int MR, int NV>
inline void gemm_tile(const float* a, int64_t am, int64_t ap, const float* b, int64_t ldb, int64_t depth, float* c,
                      int64_t ldc, float alpha, int last, bool add) {
  vec acc[MR][NV];
  UNROLLED
  for (int r = 0; r < MR; ++r)
    UNROLLED
    for (int v = 0; v < NV; ++v) acc[r][v] = vec{};
  for (int64_t p = 0; p < depth; ++p) {
    vec bv[NV];
    UNROLLED
    for (int v = 0; v < NV; ++v) bv[v] = load(b + p * ldb + v * kLanes);
    UNROLLED
    for (int r = 0; r < MR; ++r) {
      const vec av = splat(a[r * am + p * ap]);
      UNROLLED
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
#if defined(__AVX512F__)
  if (last < kLanes) {
    UNROLLED
    for (int r = 0; r < MR; ++r) {
      UNROLLED
      for (int v = 0; v < NV - 1; ++v) store(c + r * ldc + v * kLanes, acc[r][v] * alpha);
      store_part(c + r * ldc + (NV - 1) * kLanes, acc[r][NV - 1] * alpha, last);
    }
    return;
  }
#endif
  if (add) {
    UNROLLED
    for (int r = 0; r < MR; ++r)
      UNROLLED
      for (int v = 0; v < NV; ++v) store(c + r * ldc + v * kLanes, load(c + r * ldc + v * kLanes) + acc[r][v] * alpha);
    return;
  }
  UNROLLED
  for (int r = 0; r < MR; ++r)
    UNROLLED
    for (int v = 0; v < NV; ++v) store(c + r * ldc + v * kLanes, acc[r][v] * alpha);
}

constexpr int kMaxVectors = kRegisters == 32 ? 4 : 3;

template <int NV>
constexpr int kTileRows = (kRegisters - NV - 1) / NV > 12 ? 12 : (kRegisters - NV - 1) / NV;

template <int NV, int MR = 1>
inline void gemm_tail(int64_t rows, const float* a, int64_t am, int64_t ap, const float* b, int64_t ldb,
                      int64_t depth, float* c, int64_t ldc, float alpha, int last, bool add) {
  if constexpr (MR < kTileRows<NV>) {
    if (rows == MR) return gemm_tile<MR, NV>(a, am, ap, b, ldb, depth, c, ldc, alpha, last, add);
    gemm_tail<NV, MR + 1>(rows, a, am, ap, b, ldb, depth, c, ldc, alpha, last, add);
  }
}

template <int NV>
void gemm_columns(int64_t m, const float* a, int64_t am, int64_t ap, const float* b, int64_t ldb, int64_t depth,
                  float* c, int64_t ldc, float alpha, int last, bool add) {
  constexpr int MR = kTileRows<NV>;
  int64_t r = 0;
  for (; r + MR <= m; r += MR) gemm_tile<MR, NV>(a + r * am, am, ap, b, ldb, depth, c + r * ldc, ldc, alpha, last, add);
  if (r < m) gemm_tail<NV>(m - r, a + r * am, am, ap, b, ldb, depth, c + r * ldc, ldc, alpha, last, add);
}

// C (m rows, ldc floats apart; kLanes * vectors columns) = alpha * A B, depth terms per element.
// `columns` (AVX-512 only): store C's first `columns` only, leaving the rest of its rows untouched.
// `add`: C += alpha A B instead (with all columns)
void gemm(int64_t m, int64_t vectors, const float* a, int64_t am, int64_t ap, const float* b, int64_t ldb,
          int64_t depth, float* c, int64_t ldc, float alpha = 1.f, int64_t columns = -1, bool add = false) {
  if (columns < 0) columns = vectors * kLanes;
  for (int64_t v = 0; v < vectors; v += kMaxVectors) {
    const float* bv = b + v * kLanes;
    float* cv = c + v * kLanes;
    const int64_t nv = std::min<int64_t>(kMaxVectors, vectors - v);
    const int last = static_cast<int>(std::clamp<int64_t>(columns - (v + nv - 1) * kLanes, 1, kLanes));
    switch (nv) {
#if defined(__AVX512F__)
      case 4: gemm_columns<4>(m, a, am, ap, bv, ldb, depth, cv, ldc, alpha, last, add); break;
#endif
      case 3: gemm_columns<3>(m, a, am, ap, bv, ldb, depth, cv, ldc, alpha, last, add); break;
      case 2: gemm_columns<2>(m, a, am, ap, bv, ldb, depth, cv, ldc, alpha, last, add); break;
      default: gemm_columns<1>(m, a, am, ap, bv, ldb, depth, cv, ldc, alpha, last, add); break;
    }
  }
}

// ---- one (batch, head) -------------------------------------------------------------------------

struct Dims {
  int64_t batch, heads, tokens, dim;
  int64_t tokens_pad, dim_pad;  // N and d rounded up to kLanes
  Dims(int64_t B, int64_t H, int64_t N, int64_t d)
      : batch(B), heads(H), tokens(N), dim(d), tokens_pad(round_up(N, kLanes)), dim_pad(round_up(d, kLanes)) {}
};

using Rows = StridedRows<float>;  // attention_views.h
using Heads = QkvHeads<float>;

// One thread's buffers: the N x N maps key-major (form_maps), rows tokens_pad apart; N x d matrices
// dim_pad apart (zero padded); d x N transposes tokens_pad apart (zero past N)
struct Buffers {
  std::vector<float> scores, attn, d_attn, d_scores;  // S^T, then e^T, then soft^T; A^T; dA^T; dS^T
  std::vector<float> raw;                             // scale k q^T before a mask
  std::vector<float> q, k, v, d_out, out, queries_t, d_out_t;  // q, k, v, d_out: zero past d from here on
  vec per_query[kMaxTokens / kLanes];  // a vector of queries' values (1 / sum, <dA, soft>) per lane block
  Buffers(const Dims& D, bool masked)
      : scores(D.tokens * D.tokens_pad), attn(D.tokens * D.tokens_pad), d_attn(D.tokens * D.tokens_pad),
        d_scores(D.tokens * D.tokens_pad), raw(masked ? D.tokens * D.tokens_pad : 0), q(D.tokens * D.dim_pad),
        k(D.tokens * D.dim_pad), v(D.tokens * D.dim_pad), d_out(D.tokens * D.dim_pad), out(D.tokens * D.dim_pad),
        queries_t(D.dim * D.tokens_pad), d_out_t(D.dim * D.tokens_pad) {}
};

// src's rows 0..7 (those past `rows` read as zero), 8 columns, transposed into dst_t's rows 0..7
// (ld floats apart), in registers: unpack, shuffle, then swap 128-bit halves
inline void transpose_8x8(const float* src, int64_t stride, int64_t rows, float* dst_t, int64_t ld) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = k < rows ? _mm256_loadu_ps(src + k * stride) : _mm256_setzero_ps();
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst_t + k * ld, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst_t + (k + 4) * ld, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}

// src (N x d, strided) into dst (N x dim_pad, zero past d); and its transpose into dst_t (zero past
// N) when given: in 8 x 8 blocks when d is a multiple of 8 (quicker than the scalar loop; merging
// the row copies into the blocks was slower)
void gather(const Dims& D, Rows src, float* dst, float* dst_t = nullptr) {
  if (dst != nullptr)  // its padding columns stay zero from the buffer's construction: nothing else writes them
    for (int64_t i = 0; i < D.tokens; ++i) copy_row(dst + i * D.dim_pad, src.base + i * src.stride, D.dim);
  if (dst_t == nullptr) return;
  if (D.dim % 8 == 0) {
    for (int64_t i = 0; i < D.tokens_pad; i += 8)  // tokens_pad is a multiple of 8
      for (int64_t c = 0; c < D.dim; c += 8) {
        const float* block = i < D.tokens ? src.base + i * src.stride + c : nullptr;  // null: all rows zero
        transpose_8x8(block, src.stride, D.tokens - i, dst_t + c * D.tokens_pad + i, D.tokens_pad);
      }
    return;
  }
  for (int64_t c = 0; c < D.dim; ++c) {
    for (int64_t i = 0; i < D.tokens; ++i) dst_t[c * D.tokens_pad + i] = src.base[i * src.stride + c];
    std::fill(dst_t + c * D.tokens_pad + D.tokens, dst_t + (c + 1) * D.tokens_pad, 0.f);
  }
}

// src's N rows of d floats (each line they touch) into L1, for a matrix that a product reads in
// place one float at a time, issued before the copies that come first. In the GPSA layer, where the
// projection has just written q, k, v, the product read them cold without it (and copying k as
// well was slower)
inline __attribute__((always_inline)) void prefetch(const Dims& D, Rows src) { prefetch_rows(src, D.tokens, D.dim); }

// N x d of buf.out into a strided matrix (AVX2 builds: AVX-512 ones store masked instead)
void scatter(const Dims& D, const float* src, Rows dst) {
  for (int64_t i = 0; i < D.tokens; ++i) copy_row(dst.base + i * dst.stride, src + i * D.dim_pad, D.dim);
}

// (N x N map, am / ap strides) @ (N x dim_pad) into dst: with AVX-512 straight into it, the last
// vector masked; else straight into it when d fills whole vectors (quicker
// on AVX2), or through buf.out, keeping the zero padding out of dst
void product_into(const Dims& D, const float* a, int64_t am, int64_t ap, const float* b, Buffers& buf, Rows dst) {
#if defined(__AVX512F__)
  (void)buf;  // straight into dst, the last vector stored masked
  gemm(D.tokens, D.dim_pad / kLanes, a, am, ap, b, D.dim_pad, D.tokens, dst.base, dst.stride, 1.f, D.dim);
#else
  if (D.dim == D.dim_pad) {
    gemm(D.tokens, D.dim_pad / kLanes, a, am, ap, b, D.dim_pad, D.tokens, dst.base, dst.stride);
    return;
  }
  gemm(D.tokens, D.dim_pad / kLanes, a, am, ap, b, D.dim_pad, D.tokens, buf.out.data(), D.dim_pad);
  scatter(D, buf.out.data(), dst);
#endif
}

// scale k q^T, key-major (row j: key j's scores against every query), from k's rows where they lie
// (read one float at a time: no copy needed) and buf.queries_t into `product` (N x tokens_pad)
void scores_into(const Dims& D, float scale, Rows k, Buffers& buf, float* product) {
  gemm(D.tokens, D.tokens_pad / kLanes, k.base, k.stride, 1, buf.queries_t.data(), D.tokens_pad, D.dim, product,
       D.tokens_pad, scale);
}

// A^T's row j from soft^T's (zero past N): (1 - s_h) soft + s_h P[h] with P (GPSA), else soft
struct Mix {
  const float* pos_t;  // P[h]^T (N rows tokens_pad apart, zero past N), or null
  int64_t ld;
  vec gate, rest;  // s_h and 1 - s_h
  Mix(const Dims& D, const float* gate, const float* pos_t, int64_t h)
      : pos_t(pos_t == nullptr ? nullptr : pos_t + h * D.tokens * D.tokens_pad), ld(D.tokens_pad),
        gate(splat(pos_t == nullptr ? 0.f : gate[h])), rest(splat(pos_t == nullptr ? 1.f : 1.f - gate[h])) {}
  vec at(int64_t j, int64_t i, vec soft) const {
    return pos_t == nullptr ? soft : rest * soft + gate * load(pos_t + j * ld + i);
  }
};

// The maps key-major: row j of S^T = scale k q^T holds key j's scores, a query per lane, so each
// query's softmax runs down its lane: max, exp and sum as whole vectors, with no lane sums, no
// division per row and no masking of padded keys. Against query-major rows the forward takes less
// time, the backward about the same or a little more, the GPSA layer's step less. The queries past
// N, in the padding lanes,
// come out zero.
// With a mask: the product kept in buf.raw, S^T = it times M[h]^T (mask_t: the masks transposed,
// rows tokens_pad apart).
// Then soft^T and A^T into buf.scores and buf.attn (rows tokens_pad apart, zero past N).
// Forward (recompute false): each query's max and 1 / sum into row_max and row_inv when they are
// given, soft^T into `kept` (N rows tokens_pad apart) when it is.
// Backward (recompute true): soft^T from them, bit for bit as the forward had it.
void form_maps(const Dims& D, Rows k, float scale, const float* gate, const float* pos_t, const float* mask_t,
               int64_t h, Buffers& buf, float* row_max, float* row_inv, bool recompute, float* kept = nullptr) {
  const int64_t N = D.tokens, ld = D.tokens_pad;
  float* s = buf.scores.data();
  float* product = mask_t == nullptr ? s : buf.raw.data();
  scores_into(D, scale, k, buf, product);
  if (mask_t != nullptr)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t i = 0; i < ld; i += kLanes)
        store(s + j * ld + i, load(product + j * ld + i) * load(mask_t + (h * N + j) * ld + i));
  const ivec lanes = lane_index();
  for (int64_t i = 0; i < ld; i += kLanes) {  // kLanes queries at a time, down the keys
    float* column = s + i;
    vec mx;
    if (recompute) {
      mx = load_part(row_max, i, N);
    } else {
      mx = splat(-INFINITY);
      for (int64_t j = 0; j < N; ++j) {
        const vec sj = load(column + j * ld);
        mx = sj > mx ? sj : mx;  // NaN scores left out here, NaN through exp below
      }
    }
    vec sum = vec{};
    for (int64_t j = 0; j < N; ++j) {  // e = exp(S - max) in place
      const vec e = exp_nonpositive(load(column + j * ld) - mx);
      sum += e;
      store(column + j * ld, e);
    }
    vec inv;
    if (recompute) {
      inv = load_part(row_inv, i, N);  // zero past N
    } else {
      inv = lanes + static_cast<int>(i) < static_cast<int>(N) ? splat(1.f) / sum : vec{};
      if (row_max != nullptr) {
        store_part(row_max + i, mx, N - i);
        store_part(row_inv + i, inv, N - i);
      }
    }
    buf.per_query[i / kLanes] = inv;
  }
  const Mix mix(D, gate, pos_t, h);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t i = 0; i < ld; i += kLanes) {
      const vec soft = load(s + j * ld + i) * buf.per_query[i / kLanes];  // zero past N
      if (recompute) store(s + j * ld + i, soft);
      else if (kept != nullptr) stream(kept + j * ld + i, soft);
      store(buf.attn.data() + j * ld + i, mix.at(j, i, soft));
    }
}

// kept: this map's soft^T (N rows tokens_pad apart) to write, or null
void forward_map(const Dims& D, const Heads& qkv, int64_t b, int64_t h, float scale, const float* gate,
                 const float* pos_t, const float* mask_t, Rows out, Buffers& buf, float* row_max, float* row_inv,
                 float* kept) {
  prefetch(D, qkv.at(1, b, h));  // k read in place
  prefetch_next_map(D, qkv, b, h);
  gather(D, qkv.at(0, b, h), nullptr, buf.queries_t.data());  // q only as q^T
  gather(D, qkv.at(2, b, h), buf.v.data());
  form_maps(D, qkv.at(1, b, h), scale, gate, pos_t, mask_t, h, buf, row_max, row_inv, false, kept);
  product_into(D, buf.attn.data(), 1, D.tokens_pad, buf.v.data(), buf, out);  // A v, A(i, j) from A^T
}

// The maps key-major as in form_maps; sum_rows and the mask's gradient likewise, transposed per head.
// sum_rows: this thread's sum_b dA^T, or with a mask sum_b (soft (dA - <dA, soft>) * scale q k^T)^T
// (H x N x N, or null); head_dot: its sum <dA, soft> for head h; kept: soft^T as the forward kept it,
// or null (recomputed from row_max and row_inv); d_out_next: the next map's dO rows (base null after the last)
void backward_map(const Dims& D, const Heads& qkv, const Heads& d_qkv, Rows d_out, Rows d_out_next, int64_t b, int64_t h,
                  float scale, const float* gate, const float* pos_t, const float* mask_t, const float* row_max,
                  const float* row_inv, const float* kept, float coef, Buffers& buf, float* sum_rows,
                  double* head_dot) {
  const int64_t N = D.tokens, ld = D.tokens_pad;
  // the scores' product: to recompute soft, or for the mask's gradient
  const bool scores = kept == nullptr || (mask_t != nullptr && sum_rows != nullptr);
  const Rows v = qkv.at(2, b, h);  // read in place below, one float at a time
  prefetch(D, v);
  prefetch_next_map(D, qkv, b, h, d_out_next);
  gather(D, qkv.at(0, b, h), buf.q.data(), scores ? buf.queries_t.data() : nullptr);
  gather(D, qkv.at(1, b, h), buf.k.data());
  gather(D, d_out, buf.d_out.data(), buf.d_out_t.data());
  const float* soft = kept;
  if (kept == nullptr) {
    form_maps(D, qkv.at(1, b, h), scale, gate, pos_t, mask_t, h, buf, const_cast<float*>(row_max),
              const_cast<float*>(row_inv), true);
    soft = buf.scores.data();
  } else {
    if (scores) scores_into(D, scale, qkv.at(1, b, h), buf, buf.raw.data());
    const Mix mix(D, gate, pos_t, h);
    for (int64_t j = 0; j < N; ++j)
      for (int64_t i = 0; i < ld; i += kLanes) store(buf.attn.data() + j * ld + i, mix.at(j, i, load(kept + j * ld + i)));
  }
  // dA^T = v dO^T (N x N; zero past N: dO^T is)
  gemm(N, ld / kLanes, v.base, v.stride, 1, buf.d_out_t.data(), ld, D.dim, buf.d_attn.data(), ld);
  // each query's <dA_i, soft_i> down its lane, two partial sums for a shorter chain
  for (int64_t i = 0; i < ld; i += kLanes) {
    vec even = vec{}, odd = vec{};
    int64_t j = 0;
    for (; j + 1 < N; j += 2) {
      even += load(buf.d_attn.data() + j * ld + i) * load(soft + j * ld + i);
      odd += load(buf.d_attn.data() + (j + 1) * ld + i) * load(soft + (j + 1) * ld + i);
    }
    if (j < N) even += load(buf.d_attn.data() + j * ld + i) * load(soft + j * ld + i);
    const vec dot = even + odd;  // zero past N: soft is
    if (head_dot != nullptr) *head_dot += reduce_add(dot);
    buf.per_query[i / kLanes] = dot;
  }
  // dS^T = coef soft^T (dA^T - <dA, soft>) row by row, times the mask; the sums
  const vec vc = splat(coef);
  for (int64_t j = 0; j < N; ++j) {
    const float* sj = soft + j * ld;
    const float* da = buf.d_attn.data() + j * ld;
    float* ds = buf.d_scores.data() + j * ld;
    float* acc = sum_rows == nullptr ? nullptr : sum_rows + (h * N + j) * ld;
    if (mask_t == nullptr) {
      // whole vectors: the accumulator's rows are tokens_pad apart, and dA^T is zero past N
      if (acc != nullptr)
        for (int64_t i = 0; i < ld; i += kLanes) store(acc + i, load(acc + i) + load(da + i));
      for (int64_t i = 0; i < ld; i += kLanes)
        store(ds + i, vc * (load(sj + i) * (load(da + i) - buf.per_query[i / kLanes])));
      continue;
    }
    const float* m = mask_t + (h * N + j) * ld;
    const float* product = buf.raw.data() + j * ld;
    for (int64_t i = 0; i < ld; i += kLanes) {
      // d(loss)/d(masked scores)^T, zero past N (soft^T is), as the accumulator's padding
      const vec d_masked = load(sj + i) * (load(da + i) - buf.per_query[i / kLanes]);
      if (acc != nullptr) store(acc + i, load(acc + i) + d_masked * load(product + i));
      store(ds + i, vc * d_masked * load(m + i));
    }
  }
  product_into(D, buf.attn.data(), ld, 1, buf.d_out.data(), buf, d_qkv.at(2, b, h));      // dV = A^T dO
  product_into(D, buf.d_scores.data(), 1, ld, buf.k.data(), buf, d_qkv.at(0, b, h));      // dQ = dS k
  product_into(D, buf.d_scores.data(), ld, 1, buf.q.data(), buf, d_qkv.at(1, b, h));      // dK = dS^T q
}

// ---- what the ops (attention_ops.h) need besides ---------------------------------------------

using Element = float;
constexpr at::ScalarType kElement = at::kFloat;
constexpr bool kScoreMask = true;
constexpr bool kKeepsMaps = true;
constexpr bool kKeyMajorMaps = true;  // pos, mask and the sums transposed per head (form_maps)

void check_layout(const at::Tensor&, int64_t, const char*) {}  // any strides

void check_dims(const Dims& D) { TORCH_CHECK(D.dim >= 1, "qkv: a head dim of at least 1, got ", D.dim); }

}  // namespace

#ifndef ATTENTION_LIBRARY  // the tests also build an 8-lane copy on AVX-512 CPUs, under another name
#define ATTENTION_LIBRARY locality_search_fp32
#endif
#include "attention_ops.h"
#include "refiner_fp32.h"
#include "linear_fp32.h"
#include "layer_norm_fp32.h"
#include "gpsa_layer_fp32.h"
