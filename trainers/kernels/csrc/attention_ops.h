// The two ops around a kernel's per-(batch, head) functions: argument checks, the threading, the
// gate's sums per thread chunk, and their registration with torch. Shared by attention_core.cpp
// (bf16) and attention_core_fp32.cpp (float32), each of which includes it last, having defined in
// its anonymous namespace: Element and kElement (its element type), kLanes, kMaxTokens, kScoreMask
// (whether it multiplies the scores by a mask: GMM attention), kKeepsMaps (whether its forward can
// keep the softmax maps for its backward), kKeyMajorMaps (whether its maps are transposed, a key
// per row: then it reads pos and mask, and returns the sums, transposed per head), Dims, Rows and Heads
// (attention_views.h's views over Element), Buffers, forward_map, backward_map, check_layout (what
// it needs of a view beyond unit stride along d) and check_dims (of the sizes); and
// ATTENTION_LIBRARY, the ops' namespace.
#pragma once

namespace {

// ---- the ops ------------------------------------------------------------------------------------

// qkv-like (3, B, H, N, d) or out-like (B, H, N, d) in the kernel's dtype with unit stride along d
void check_view(const at::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.dim() == dims && t.scalar_type() == kElement, what, ": a ", dims, "-d ",
              kElement == at::kBFloat16 ? "bfloat16" : "float32",
              " tensor, got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.stride(dims - 1) == 1, what, ": unit stride along d, got strides ", t.strides());
  check_layout(t, dims, what);
}

Dims dims_of(const at::Tensor& qkv) {
  check_view(qkv, 5, "qkv");
  TORCH_CHECK(qkv.size(0) == 3, "qkv: (3, B, H, N, d), got ", qkv.sizes());
  const Dims D(qkv.size(1), qkv.size(2), qkv.size(3), qkv.size(4));
  TORCH_CHECK(D.tokens >= 1 && D.tokens <= kMaxTokens, "qkv: 1 <= N <= ", kMaxTokens, ", got ", D.tokens);
  check_dims(D);
  return D;
}

void check_out(const at::Tensor& t, const Dims& D, const char* what) {
  check_view(t, 4, what);
  TORCH_CHECK(t.sizes() == at::IntArrayRef({D.batch, D.heads, D.tokens, D.dim}), what, ": (B, H, N, d) = (",
              D.batch, ", ", D.heads, ", ", D.tokens, ", ", D.dim, "), got ", t.sizes());
}

void check_floats(const at::Tensor& t, at::IntArrayRef sizes, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == sizes,
              what, ": float32, contiguous, of size ", sizes, ", got ", t.scalar_type(), " ", t.sizes());
}

// GPSA's gate (H) and positional attention (H, N, N), or GMM's score mask (H, N, N), or none
void check_mix(const c10::optional<at::Tensor>& gate, const c10::optional<at::Tensor>& pos,
               const c10::optional<at::Tensor>& mask, const Dims& D) {
  TORCH_CHECK(gate.has_value() == pos.has_value(), "attention: gate and pos come together");
  if (pos.has_value()) {
    check_floats(*gate, {D.heads}, "gate");
    check_floats(*pos, {D.heads, D.tokens, D.tokens}, "pos");
  }
  if (mask.has_value()) {
    TORCH_CHECK(kScoreMask, "attention: this kernel (", kElement == at::kBFloat16 ? "bfloat16" : "float32",
                ") has no score mask");
    TORCH_CHECK(!pos.has_value(), "attention: a score mask or a gate and pos, not both");
    check_floats(*mask, {D.heads, D.tokens, D.tokens}, "mask");
  }
}

// An (H, N, N) map (pos, mask, a sum) in the kernel's layout: as it is; or where the kernel's maps
// are key-major, each head transposed, its rows tokens_pad floats apart (zero past N) for whole,
// aligned vector loads
int64_t map_row(const Dims& D) { return kKeyMajorMaps ? D.tokens_pad : D.tokens; }
at::Tensor map_layout(const at::Tensor& t, const Dims& D) {
  if (!kKeyMajorMaps) return t;
  at::Tensor padded = at::zeros({D.heads, D.tokens, map_row(D)}, t.options());
  padded.narrow(2, 0, D.tokens).copy_(t.transpose(1, 2));
  return padded;
}
c10::optional<at::Tensor> map_layout(const c10::optional<at::Tensor>& t, const Dims& D) {
  return t.has_value() ? c10::optional<at::Tensor>(map_layout(*t, D)) : c10::nullopt;
}
// and back: (H, N, map_row) floats in the kernel's layout as an (H, N, N) map
at::Tensor from_map_layout(const at::Tensor& t, const Dims& D) {
  const at::Tensor rows = t.view({D.heads, D.tokens, map_row(D)}).narrow(2, 0, D.tokens);
  return kKeyMajorMaps ? rows.transpose(1, 2).contiguous() : rows;
}

const float* floats_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// softmax maps as a forward keeps them: (B*H*N, tokens_pad) float32, rows zero past N
int64_t kept_floats(const Dims& D) { return D.batch * D.heads * D.tokens * D.tokens_pad; }

// Writes out (B, H, N, d), any strides as check_view; returns each row's max and 1 / sum
// ((B*H*N,) float32 each, batch-major), or empty tensors without `keep_stats` (inference); and
// with `keep_maps` the softmax maps for the backward (kept_floats), else an empty tensor
std::vector<at::Tensor> attention_forward(const at::Tensor& qkv, const c10::optional<at::Tensor>& gate,
                                          const c10::optional<at::Tensor>& pos, const c10::optional<at::Tensor>& mask,
                                          double scale, const at::Tensor& out, bool keep_stats, bool keep_maps) {
  const Dims D = dims_of(qkv);
  check_out(out, D, "out");
  check_mix(gate, pos, mask, D);
  TORCH_CHECK(!keep_maps || kKeepsMaps, "attention: this kernel (", kElement == at::kBFloat16 ? "bfloat16" : "float32",
              ") recomputes its maps; keep_maps must be false");
  const int64_t rows = D.batch * D.heads * D.tokens;
  const at::TensorOptions floats = qkv.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({keep_stats ? rows : 0}, floats);
  at::Tensor row_inv = at::empty({keep_stats ? rows : 0}, floats);
  at::Tensor maps = at::empty({keep_maps ? kept_floats(D) : 0}, floats);
  float* kept = keep_maps ? maps.data_ptr<float>() : nullptr;
  const Heads heads{qkv.data_ptr<Element>(), qkv.strides()};
  const c10::optional<at::Tensor> pos_k = map_layout(pos, D), mask_k = map_layout(mask, D);
  const float *g = floats_or_null(gate), *p = floats_or_null(pos_k), *mk = floats_or_null(mask_k);
  float* mx = keep_stats ? row_max.data_ptr<float>() : nullptr;
  float* inv = keep_stats ? row_inv.data_ptr<float>() : nullptr;
  Element* o = out.data_ptr<Element>();
  at::parallel_for(0, D.batch * D.heads, 4, [&](int64_t begin, int64_t end) {
    Buffers buf(D, mk != nullptr);
    for (int64_t m = begin; m < end; ++m) {
      const int64_t b = m / D.heads, h = m % D.heads;
      const Rows out_rows{o + b * out.stride(0) + h * out.stride(1), out.stride(2)};
      forward_map(D, heads, b, h, static_cast<float>(scale), g, p, mk, out_rows, buf,
                  keep_stats ? mx + m * D.tokens : nullptr, keep_stats ? inv + m * D.tokens : nullptr,
                  keep_maps ? kept + m * D.tokens * D.tokens_pad : nullptr);
    }
    if (keep_maps) _mm_sfence();  // the maps may be streamed past the caches: stored before the op returns
  });
  return {row_max, row_inv, maps};
}

// Writes d_qkv (strides as qkv's may be, its own); returns sum_b dA (H, N, N) and sum <dA, soft> per
// head (H), float32, or empty tensors without `sums`; with a mask, the mask's gradient (H, N, N)
// in place of sum_b dA. soft_maps: as the forward kept them, or empty (recomputed from the rows' stats)
std::vector<at::Tensor> attention_backward(const at::Tensor& d_out, const at::Tensor& qkv,
                                           const c10::optional<at::Tensor>& gate, const c10::optional<at::Tensor>& pos,
                                           const c10::optional<at::Tensor>& mask, const at::Tensor& row_max,
                                           const at::Tensor& row_inv, const at::Tensor& soft_maps, const at::Tensor& coef,
                                           double scale, const at::Tensor& d_qkv, bool sums) {
  const Dims D = dims_of(qkv);
  check_out(d_out, D, "d_out");
  check_view(d_qkv, 5, "d_qkv");
  TORCH_CHECK(d_qkv.sizes() == qkv.sizes(), "d_qkv: qkv's size ", qkv.sizes(), ", got ", d_qkv.sizes());
  check_mix(gate, pos, mask, D);
  const int64_t H = D.heads, N = D.tokens, maps = D.batch * H;
  check_floats(row_max, {maps * N}, "row_max");
  check_floats(row_inv, {maps * N}, "row_inv");
  const bool kept = soft_maps.numel() > 0;
  TORCH_CHECK(!kept || kKeepsMaps, "attention: this kernel recomputes its maps; pass an empty maps tensor");
  if (kept) check_floats(soft_maps, {kept_floats(D)}, "maps");
  check_floats(coef, {H}, "coef");
  const Heads heads{qkv.data_ptr<Element>(), qkv.strides()}, d_heads{d_qkv.data_ptr<Element>(), d_qkv.strides()};
  const c10::optional<at::Tensor> pos_k = map_layout(pos, D), mask_k = map_layout(mask, D);
  const float *g = floats_or_null(gate), *p = floats_or_null(pos_k), *mk = floats_or_null(mask_k);
  const float* mx = row_max.data_ptr<float>();
  const float* inv = row_inv.data_ptr<float>();
  const float* c = coef.data_ptr<float>();
  const float* kept_maps = kept ? soft_maps.data_ptr<float>() : nullptr;
  Element* dout = d_out.data_ptr<Element>();
  // the maps in one contiguous chunk per thread, each chunk with its own sums (added afterwards): no
  // two tasks add into the same memory, and the sums do not depend on scheduling
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), maps));
  // one chunk's; padded for the whole-vector stores of a kernel whose rows are N apart
  const int64_t sum_size = H * N * map_row(D) + kLanes;
  at::Tensor dA_sums = at::zeros({sums ? chunks : 0, sum_size}, row_max.options());
  at::Tensor dots = at::zeros({sums ? chunks : 0, H}, row_max.options());
  // map m's dO rows: (b, h) = (m / H, m % H)
  const auto d_out_rows = [&](int64_t m) {
    return Rows{dout + m / H * d_out.stride(0) + m % H * d_out.stride(1), d_out.stride(2)};
  };
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    Buffers buf(D, mk != nullptr);
    std::vector<double> head_dots(H, 0.);  // kept here: the chunks' rows of `dots` share cache lines
    for (int64_t chunk = first; chunk < last; ++chunk) {
      std::fill(head_dots.begin(), head_dots.end(), 0.);
      float* sum_rows = sums ? dA_sums.data_ptr<float>() + chunk * sum_size : nullptr;
      for (int64_t m = maps * chunk / chunks; m < maps * (chunk + 1) / chunks; ++m) {
        const int64_t b = m / H, h = m % H;
        const Rows d_out_next = m + 1 < maps ? d_out_rows(m + 1) : Rows{nullptr, 0};
        if (kept && m + 1 < maps) {  // the next map's kept soft into cache while this one runs (a
          // contiguous stream the hardware prefetcher leaves late)
          const char* next = reinterpret_cast<const char*>(kept_maps + (m + 1) * N * D.tokens_pad);
          for (int64_t byte = 0; byte < N * D.tokens_pad * 4; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T1);
        }
        backward_map(D, heads, d_heads, d_out_rows(m), d_out_next, b, h, static_cast<float>(scale), g, p, mk, mx + m * N, inv + m * N,
                     kept ? kept_maps + m * N * D.tokens_pad : nullptr, c[h], buf, sum_rows,
                     sums ? &head_dots[h] : nullptr);
      }
      if (sums)
        for (int64_t h = 0; h < H; ++h) dots.data_ptr<float>()[chunk * H + h] = static_cast<float>(head_dots[h]);
    }
  });
  if (!sums) return {dA_sums, dots};
  return {from_map_layout(dA_sums.sum(0).narrow(0, 0, H * N * map_row(D)), D), dots.sum(0)};
}

}  // namespace

// TORCH_LIBRARY pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define ATTENTION_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define ATTENTION_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

ATTENTION_TORCH_LIBRARY(ATTENTION_LIBRARY, m) {
  m.def("attention_forward(Tensor qkv, Tensor? gate, Tensor? pos, Tensor? mask, float scale, Tensor(a!) out, "
        "bool keep_stats, bool keep_maps) -> Tensor[]");
  m.def("attention_backward(Tensor d_out, Tensor qkv, Tensor? gate, Tensor? pos, Tensor? mask, Tensor row_max, "
        "Tensor row_inv, Tensor maps, Tensor coef, float scale, Tensor(a!) d_qkv, bool sums) -> Tensor[]");
}

ATTENTION_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}
