// The attention core's passes over its B x H x N x N maps, fused: one pass per direction, a row at a
// time, in AVX-512 registers (trainers/models/_attention_maps.py builds and loads this file).
//
// Forward, from the scores S (the batched GEMM's output, float32 or bfloat16):
//     soft = softmax(S) per row (in float32), then A = (1 - s_h) soft + s_h P[h] (GPSA) or A = soft,
//     A written in S's dtype, plus each row's max and 1 / sum: the backward recomputes soft from S
//     and them, bit for bit, instead of keeping a float32 copy of the maps.
// Backward, from dA (the GEMM's output) and the same S and row statistics:
//     dS = c_h soft (dA - <dA, soft>) with c_h = (1 - s_h) scale (plain: scale), written in S's dtype;
//     optionally, for the gate and P's gradients, sum_b dA (H x N x N) and sum <dA, soft> per head.
// Rows are (batch, head, query) or (head, batch, query) ordered (`heads_first`); N <= 1024.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "attention_maps.cpp needs AVX-512 (F, BW, VL); _attention_maps.py builds it only where the CPU has them"
#endif

namespace {

constexpr int64_t kMaxTokens = 1024;
constexpr int64_t kLanes = 16;

inline __mmask16 tail_mask(int64_t j, int64_t n) {
  const int64_t left = n - j;
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const at::BFloat16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(at::BFloat16* p, __m512 v, __mmask16 m) {  // round to nearest even, as torch casts
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512i nan = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));  // NaN stays a (quiet) NaN
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_mov_epi32(rounded, is_nan, nan);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
#endif
}

// exp(x) for x <= 0 (scores minus their row's max), within 2 ulp of expf: Cephes' polynomial on
// x - n ln 2, then scaled by 2^n
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // NaN in, NaN out (max returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

struct Layout {
  int64_t heads, batch, tokens;
  bool heads_first;  // rows (head, batch, query) rather than (batch, head, query)
};

// A row's head h and query i, advanced row by row without a division per row
struct RowCursor {
  const Layout& L;
  int64_t map, h, i;  // map: the row's (batch, head) or (head, batch) index
  RowCursor(const Layout& layout, int64_t row) : L(layout), map(row / layout.tokens), h(0), i(row % layout.tokens) {
    set_head();
  }
  void set_head() { h = L.heads_first ? map / L.batch : map % L.heads; }
  void next() {
    if (++i == L.tokens) {
      i = 0;
      ++map;
      set_head();
    }
  }
};

// exp(S - max) into `e` (zero past n), the row's max and 1 / sum into row_max and row_inv
template <typename T>
inline void softmax_row(const T* s, int64_t n, float* e, float& row_max, float& row_inv) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 k = tail_mask(j, n);
    m = _mm512_mask_max_ps(m, k, m, load(s + j, k));
  }
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 vmax = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 k = tail_mask(j, n);
    const __m512 ej = _mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(load(s + j, k), vmax)));
    sum = _mm512_add_ps(sum, ej);
    _mm512_store_ps(e + j, ej);
  }
  row_max = mx;
  row_inv = 1.f / _mm512_reduce_add_ps(sum);
}

// f.template operator()<T>() with T the C++ type of `dtype` (float32 or bfloat16)
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f.template operator()<float>();
  } else {
    f.template operator()<at::BFloat16>();
  }
}

template <typename T>
void forward_rows(const T* scores, const float* gate, const float* pos, T* attn, float* row_max, float* row_inv,
                  const Layout& L, int64_t begin, int64_t end) {
  alignas(64) float e[kMaxTokens + kLanes];
  const int64_t n = L.tokens;
  RowCursor at(L, begin);
  for (int64_t r = begin; r < end; ++r, at.next()) {
    float mx, inv;
    softmax_row(scores + r * n, n, e, mx, inv);
    if (row_max != nullptr) { row_max[r] = mx; row_inv[r] = inv; }
    T* a = attn + r * n;
    if (pos == nullptr) {  // A = soft
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t j = 0; j < n; j += kLanes)
        store(a + j, _mm512_mul_ps(_mm512_load_ps(e + j), vinv), tail_mask(j, n));
    } else {  // A = (1 - s) soft + s P[h, i]
      const float g = gate[at.h];
      const float* p = pos + (at.h * n + at.i) * n;
      const __m512 vinv = _mm512_set1_ps(inv), vg = _mm512_set1_ps(g), vc = _mm512_set1_ps(1.f - g);
      for (int64_t j = 0; j < n; j += kLanes) {
        const __mmask16 k = tail_mask(j, n);
        const __m512 soft = _mm512_mul_ps(_mm512_load_ps(e + j), vinv);
        store(a + j, _mm512_fmadd_ps(vc, soft, _mm512_mul_ps(vg, load(p + j, k))), k);
      }
    }
  }
}

template <typename T>
void backward_rows(const T* d_attn, const T* scores, const float* row_max, const float* row_inv,
                   const float* coef, T* d_scores, float* d_attn_sum, float* dots, const Layout& L,
                   int64_t begin, int64_t end) {
  alignas(64) float soft[kMaxTokens + kLanes];
  alignas(64) float da[kMaxTokens + kLanes];
  const int64_t n = L.tokens;
  // the per-head sums kept here and written once: the chunks' `dots` share cache lines
  std::vector<double> head_dots(dots == nullptr ? 0 : L.heads, 0.);
  RowCursor at(L, begin);
  for (int64_t r = begin; r < end; ++r, at.next()) {
    // soft as the forward computed it, bit for bit: exp(S - max) * (1 / sum)
    const __m512 vmax = _mm512_set1_ps(row_max[r]), vinv = _mm512_set1_ps(row_inv[r]);
    const T* sr = scores + r * n;
    const T* dar = d_attn + r * n;
    float* acc = d_attn_sum == nullptr ? nullptr : d_attn_sum + (at.h * n + at.i) * n;
    __m512 vdot = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 k = tail_mask(j, n);
      const __m512 s = _mm512_maskz_mul_ps(k, exp_nonpositive(_mm512_sub_ps(load(sr + j, k), vmax)), vinv);
      const __m512 d = load(dar + j, k);
      vdot = _mm512_fmadd_ps(d, s, vdot);
      _mm512_store_ps(soft + j, s);
      _mm512_store_ps(da + j, d);
      // unmasked: past n the lanes add 0 to the next row (the accumulators end in kLanes of padding)
      if (acc != nullptr) _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), d));
    }
    const float dot = _mm512_reduce_add_ps(vdot);
    if (dots != nullptr) head_dots[at.h] += dot;
    const __m512 vd = _mm512_set1_ps(dot), vc = _mm512_set1_ps(coef[at.h]);
    T* ds = d_scores + r * n;
    for (int64_t j = 0; j < n; j += kLanes) {
      const __m512 s = _mm512_load_ps(soft + j);
      store(ds + j, _mm512_mul_ps(vc, _mm512_mul_ps(s, _mm512_sub_ps(_mm512_load_ps(da + j), vd))),
            tail_mask(j, n));
    }
  }
  for (size_t h = 0; h < head_dots.size(); ++h) dots[h] = static_cast<float>(head_dots[h]);
}

Layout layout_of(const at::Tensor& maps, int64_t heads, bool heads_first) {
  TORCH_CHECK(maps.dim() == 3 && maps.is_contiguous() && maps.size(1) == maps.size(2),
              "attention maps: (B*H, N, N) contiguous, got ", maps.sizes());
  const int64_t tokens = maps.size(1);
  TORCH_CHECK(tokens >= 1 && tokens <= kMaxTokens, "attention maps: N <= ", kMaxTokens, ", got ", tokens);
  TORCH_CHECK(heads >= 1 && maps.size(0) % heads == 0, "attention maps: B*H rows not divisible by ", heads, " heads");
  TORCH_CHECK(maps.scalar_type() == at::kFloat || maps.scalar_type() == at::kBFloat16,
              "attention maps: float32 or bfloat16, got ", maps.scalar_type());
  return Layout{heads, maps.size(0) / heads, tokens, heads_first};
}

void check_floats(const at::Tensor& t, at::IntArrayRef sizes, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == sizes,
              what, ": float32, contiguous, of size ", sizes, ", got ", t.scalar_type(), " ", t.sizes());
}

constexpr int64_t kGrain = 64;  // rows per task

// (A, row max, row 1 / sum); with `keep_stats` false the statistics are empty (size 0) and A may be
// `scores` itself (`in_place`, inference)
std::vector<at::Tensor> maps_forward(const at::Tensor& scores, const c10::optional<at::Tensor>& gate,
                                     const c10::optional<at::Tensor>& pos, int64_t heads, bool heads_first,
                                     bool keep_stats, bool in_place) {
  const Layout L = layout_of(scores, heads, heads_first);
  TORCH_CHECK(gate.has_value() == pos.has_value(), "maps_forward: gate and pos come together");
  if (pos.has_value()) {
    check_floats(*gate, {heads}, "gate");
    check_floats(*pos, {heads, L.tokens, L.tokens}, "pos");
  }
  TORCH_CHECK(!(in_place && keep_stats), "maps_forward: in place only without statistics (inference)");
  const int64_t rows = scores.size(0) * L.tokens;
  at::Tensor attn = in_place ? scores : at::empty_like(scores);
  const at::TensorOptions floats = scores.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({keep_stats ? rows : 0}, floats);
  at::Tensor row_inv = at::empty({keep_stats ? rows : 0}, floats);
  const float* g = pos.has_value() ? gate->data_ptr<float>() : nullptr;
  const float* p = pos.has_value() ? pos->data_ptr<float>() : nullptr;
  float* mx = keep_stats ? row_max.data_ptr<float>() : nullptr;
  float* inv = keep_stats ? row_inv.data_ptr<float>() : nullptr;
  dispatch(scores.scalar_type(), [&]<typename T>() {
    const T* s = scores.data_ptr<T>();
    T* a = attn.data_ptr<T>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      forward_rows<T>(s, g, p, a, mx, inv, L, begin, end);
    });
  });
  return {attn, row_max, row_inv};
}

// (dS, sum_b dA (H, N, N), sum <dA, soft> per head (H)); the last two empty (size 0) without `sums`
std::vector<at::Tensor> maps_backward(const at::Tensor& d_attn, const at::Tensor& scores, const at::Tensor& row_max,
                                      const at::Tensor& row_inv, const at::Tensor& coef, int64_t heads,
                                      bool heads_first, bool sums) {
  const Layout L = layout_of(scores, heads, heads_first);
  TORCH_CHECK(d_attn.sizes() == scores.sizes() && d_attn.scalar_type() == scores.scalar_type() &&
              d_attn.is_contiguous(), "maps_backward: dA contiguous, of the scores' size and dtype");
  const int64_t rows = scores.size(0) * L.tokens;
  check_floats(row_max, {rows}, "row_max");
  check_floats(row_inv, {rows}, "row_inv");
  check_floats(coef, {heads}, "coef");
  at::Tensor d_scores = at::empty_like(scores);
  // the rows in one contiguous chunk per thread, each chunk with its own accumulators (summed
  // afterwards): no two tasks add into the same memory, and the sums do not depend on scheduling
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / kGrain));
  const int64_t maps = heads * L.tokens * L.tokens;
  const int64_t acc_size = heads * L.tokens * L.tokens + kLanes;  // one chunk's, padded for unmasked stores
  at::Tensor acc = at::zeros({sums ? chunks : 0, acc_size}, row_max.options());
  at::Tensor dots = at::zeros({sums ? chunks : 0, heads}, row_max.options());
  dispatch(scores.scalar_type(), [&]<typename T>() {
    const T* da = d_attn.data_ptr<T>();
    const T* s = scores.data_ptr<T>();
    T* ds = d_scores.data_ptr<T>();
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        backward_rows<T>(da, s, row_max.data_ptr<float>(), row_inv.data_ptr<float>(), coef.data_ptr<float>(), ds,
                         sums ? acc.data_ptr<float>() + c * acc_size : nullptr,
                         sums ? dots.data_ptr<float>() + c * heads : nullptr, L,
                         rows * c / chunks, rows * (c + 1) / chunks);
      }
    });
  });
  if (!sums) return {d_scores, acc, dots};
  return {d_scores, acc.sum(0).narrow(0, 0, maps).view({heads, L.tokens, L.tokens}), dots.sum(0)};
}

}  // namespace

TORCH_LIBRARY(locality_search, m) {
  m.def("maps_forward(Tensor scores, Tensor? gate, Tensor? pos, int heads, bool heads_first, bool keep_stats, "
        "bool in_place) -> Tensor[]");
  m.def("maps_backward(Tensor d_attn, Tensor scores, Tensor row_max, Tensor row_inv, Tensor coef, int heads, "
        "bool heads_first, bool sums) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(locality_search, CPU, m) {
  m.impl("maps_forward", &maps_forward);
  m.impl("maps_backward", &maps_backward);
}
