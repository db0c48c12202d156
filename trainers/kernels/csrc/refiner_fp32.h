// The Refiner's map refinement (ls_refiner.py, `Refiner`) in float32 as one fused pass per query
// row, forward and backward. attention_core_fp32.cpp includes it after its vector helpers (vec,
// ivec, load, store, splat, kLanes) and its ops, and it registers two more ops in that library.
//
// Per row m of heads-first maps (H, M, N), N = P prefix keys + an h x w grid of patch keys, with
// E (rH, H), C (rH, k, k), R (H, rH), c = k / 2:
//     x[e] = sum_i E[e, i] a[i]                       (expand, every key)
//     y[e][p] = sum_(dy, dx) C[e][dy + c][dx + c] x[e][p + (dy, dx)]   (patch keys, zero outside
//               the grid; the prefix keys pass: y[e][j] = x[e][j])
//     out[o] = sum_e R[o, e] y[e]                     (reduce)
// Backward, from g = d(loss)/d(out), recomputing x and y: dy[e] = sum_o R[o, e] g[o],
// dx[e] = the conv's adjoint of dy[e] (offsets and masks mirrored), da[i] = sum_e E[e, i] dx[e];
// dR[o, e] = <g[o], y[e]>, dC[e][t] = <dy[e], x[e] shifted by tap t>, dE[e, i] = <dx[e], a[i]>,
// summed over rows. The torch paths form the conv as banded N x N matrices or as the composed
// (H N) x (H N) operator, GEMMs over mostly zeros (3 x 3 taps of a 7 x 7 grid: 9 of 49 per row);
// here it is k^2 FMAs per key, on vectors of kLanes consecutive patch keys (a tap (dy, dx) is a
// load at p + dy w + dx from a zero-padded row; a column mask per dx zeroes the keys whose
// neighbour would wrap to another grid row).
//
// The weights' gradients are summed per chunk of rows (kRefinerChunks, fixed: the sums do not
// depend on the thread count), then over the chunks in order, in double.
#pragma once

namespace {

constexpr int64_t kRefinerChunks = 64;

inline vec masked(vec x, ivec mask) { return __builtin_bit_cast(vec, __builtin_bit_cast(ivec, x) & mask); }

// Sizes, tap offsets and column masks of one call
struct RefinerPlan {
  int64_t heads, expanded, rows, tokens, prefix, grid_w, k;
  int64_t patches;  // h * w
  int64_t vectors;  // whole vectors over the patch keys
  int64_t padded;   // patch keys rounded up to whole vectors
  int64_t pad;      // zeros before and after a padded row: the farthest tap, c w + c
  int64_t ld;       // pad + padded + pad
  // masks[dxi * vectors + v]: lanes of keys p = v kLanes + l with p < h w whose column plus
  // dx = dxi - c stays in the grid, all bits set; others 0
  std::vector<ivec> masks;

  RefinerPlan(const at::Tensor& maps, const at::Tensor& kernel, int64_t grid_h, int64_t grid_w_) {
    heads = maps.size(0), rows = maps.size(1), tokens = maps.size(2);
    expanded = kernel.size(0), k = kernel.size(1), grid_w = grid_w_;
    patches = grid_h * grid_w, prefix = tokens - patches;
    vectors = (patches + kLanes - 1) / kLanes, padded = vectors * kLanes;
    const int64_t c = k / 2;
    pad = c * grid_w + c, ld = pad + padded + pad;
    masks.assign(k * vectors, ivec{});
    for (int64_t dxi = 0; dxi < k; ++dxi)
      for (int64_t p = 0; p < padded; ++p) {
        const int64_t column = p % grid_w + dxi - c;
        masks[dxi * vectors + p / kLanes][p % kLanes] = p < patches && column >= 0 && column < grid_w ? -1 : 0;
      }
  }
  int64_t offset(int64_t dyi, int64_t dxi) const { return (dyi - k / 2) * grid_w + (dxi - k / 2); }
};

// Vector v (keys v kLanes ...) of the conv of padded row x (ld floats, its keys at x + pad) with
// taps w (k x k); zero past h w. kMirrored: the adjoint (taps at -(dy, dx), the masks of -dx).
template <bool kMirrored>
inline vec conv_at(const RefinerPlan& plan, const float* x, const float* w, int64_t v) {
  const int64_t k = plan.k;
  const float* at = x + plan.pad + v * kLanes;
  vec sum = vec{};
  for (int64_t dxi = 0; dxi < k; ++dxi) {
    vec column = vec{};
    for (int64_t dyi = 0; dyi < k; ++dyi) {
      const int64_t o = plan.offset(dyi, dxi);
      column += splat(w[dyi * k + dxi]) * load(at + (kMirrored ? -o : o));
    }
    sum += masked(column, plan.masks[(kMirrored ? k - 1 - dxi : dxi) * plan.vectors + v]);
  }
  return sum;
}

// The whole row: y[v] for every vector v, into y (padded floats). K: k known at compile time (0: plan.k),
// so the taps stay in registers across the row.
template <int K, bool kMirrored>
inline void conv_row(const RefinerPlan& plan, const float* x, const float* w, float* y) {
  if constexpr (K == 0) {
    for (int64_t v = 0; v < plan.vectors; ++v) store(y + v * kLanes, conv_at<kMirrored>(plan, x, w, v));
  } else {
    vec taps[K * K];
    int64_t offsets[K * K];
    for (int dyi = 0; dyi < K; ++dyi)
      for (int dxi = 0; dxi < K; ++dxi) {
        taps[dyi * K + dxi] = splat(w[dyi * K + dxi]);
        const int64_t o = plan.offset(dyi, dxi);
        offsets[dyi * K + dxi] = kMirrored ? -o : o;
      }
    const ivec* masks = plan.masks.data();
    for (int64_t v = 0; v < plan.vectors; ++v) {
      const float* at = x + plan.pad + v * kLanes;
      vec sum = vec{};
      for (int dxi = 0; dxi < K; ++dxi) {
        vec column = vec{};
        for (int dyi = 0; dyi < K; ++dyi) column += taps[dyi * K + dxi] * load(at + offsets[dyi * K + dxi]);
        sum += masked(column, masks[(kMirrored ? K - 1 - dxi : dxi) * plan.vectors + v]);
      }
      store(y + v * kLanes, sum);
    }
  }
}

// sum (kLanes floats) += a * b over `vectors` whole vectors, lane by lane (one register across the row)
inline void add_dot(float* sum, const float* a, const float* b, int64_t vectors) {
  vec acc = load(sum);
  for (int64_t v = 0; v < vectors; ++v) acc += load(a + v * kLanes) * load(b + v * kLanes);
  store(sum, acc);
}

constexpr int64_t kMaxRefinerHeads = 64;  // heads and expanded heads: the per-vector stack arrays

// Per-thread row buffers; x and dy are eh padded rows (ld floats, zero pads)
struct RefinerBuffers {
  std::vector<float> a, g, x, dy, y, out;
  explicit RefinerBuffers(const RefinerPlan& p)
      : a(p.heads * p.padded), g(p.heads * p.padded), x(p.expanded * p.ld), dy(p.expanded * p.ld),
        y(p.expanded * p.padded), out(p.heads * p.padded) {}
};

// The H patch rows of row m into buf (padded, zero past h w)
inline void gather_rows(const RefinerPlan& p, const float* maps, int64_t m, float* buf) {
  for (int64_t i = 0; i < p.heads; ++i)
    std::memcpy(buf + i * p.padded, maps + (i * p.rows + m) * p.tokens + p.prefix, p.patches * sizeof(float));
}

// buf's H padded rows back into row m's patch keys
inline void scatter_rows(const RefinerPlan& p, const float* buf, int64_t m, float* maps) {
  for (int64_t i = 0; i < p.heads; ++i)
    std::memcpy(maps + (i * p.rows + m) * p.tokens + p.prefix, buf + i * p.padded, p.patches * sizeof(float));
}

// x[e] = sum_i E[e, i] a[i] over the patch keys, every e
inline void expand_rows(const RefinerPlan& p, const float* a, const float* expand, float* x) {
  vec av[kMaxRefinerHeads];
  for (int64_t v = 0; v < p.vectors; ++v) {
    for (int64_t i = 0; i < p.heads; ++i) av[i] = load(a + i * p.padded + v * kLanes);
    for (int64_t e = 0; e < p.expanded; ++e) {
      vec sum = vec{};
      for (int64_t i = 0; i < p.heads; ++i) sum += splat(expand[e * p.heads + i]) * av[i];
      store(x + e * p.ld + p.pad + v * kLanes, sum);
    }
  }
}

void check_refiner_args(const at::Tensor& maps, const at::Tensor& expand, const at::Tensor& kernel,
                        const at::Tensor& reduce, int64_t grid_h, int64_t grid_w) {
  TORCH_CHECK(maps.dim() == 3 && maps.scalar_type() == at::kFloat && maps.is_contiguous(),
              "maps: a contiguous (H, M, N) float32 tensor, got ", maps.scalar_type(), " ", maps.sizes());
  const int64_t H = maps.size(0);
  TORCH_CHECK(kernel.dim() == 3 && kernel.size(1) == kernel.size(2) && kernel.size(1) % 2 == 1,
              "kernel: (rH, k, k) with k odd, got ", kernel.sizes());
  const int64_t eh = kernel.size(0);
  TORCH_CHECK(expand.sizes() == at::IntArrayRef({eh, H}), "expand: (rH, H) = (", eh, ", ", H, "), got ", expand.sizes());
  TORCH_CHECK(reduce.sizes() == at::IntArrayRef({H, eh}), "reduce: (H, rH) = (", H, ", ", eh, "), got ", reduce.sizes());
  TORCH_CHECK(H <= kMaxRefinerHeads && eh <= kMaxRefinerHeads, "the refiner kernel: at most ", kMaxRefinerHeads,
              " heads and expanded heads, got ", H, " and ", eh);
  for (const at::Tensor* t : {&expand, &kernel, &reduce})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "the refiner's weights: contiguous float32");
  TORCH_CHECK(grid_h >= 1 && grid_w >= 1 && grid_h * grid_w <= maps.size(2),
              "grid: h * w <= N = ", maps.size(2), ", got ", grid_h, " x ", grid_w);
}

// K: the kernel size at compile time (3, the models' default), or 0 (any odd k, slower)
template <int K>
at::Tensor refine_forward_k(const RefinerPlan& p, const at::Tensor& maps, const at::Tensor& expand,
                            const at::Tensor& kernel, const at::Tensor& reduce) {
  at::Tensor out = at::empty_like(maps);
  const float* a_all = maps.data_ptr<float>();
  const float *E = expand.data_ptr<float>(), *C = kernel.data_ptr<float>(), *R = reduce.data_ptr<float>();
  float* out_all = out.data_ptr<float>();
  const int64_t H = p.heads, eh = p.expanded, P = p.prefix, kk = p.k * p.k;
  at::parallel_for(0, p.rows, 16, [&](int64_t begin, int64_t end) {
    RefinerBuffers buf(p);
    vec yv[kMaxRefinerHeads];
    for (int64_t m = begin; m < end; ++m) {
      gather_rows(p, a_all, m, buf.a.data());
      expand_rows(p, buf.a.data(), E, buf.x.data());
      for (int64_t e = 0; e < eh; ++e) conv_row<K, false>(p, buf.x.data() + e * p.ld, C + e * kk, buf.y.data() + e * p.padded);
      for (int64_t v = 0; v < p.vectors; ++v) {
        for (int64_t e = 0; e < eh; ++e) yv[e] = load(buf.y.data() + e * p.padded + v * kLanes);
        for (int64_t o = 0; o < H; ++o) {  // out[o] = sum_e R[o, e] y[e]
          vec sum = vec{};
          for (int64_t e = 0; e < eh; ++e) sum += splat(R[o * eh + e]) * yv[e];
          store(buf.out.data() + o * p.padded + v * kLanes, sum);
        }
      }
      scatter_rows(p, buf.out.data(), m, out_all);
      for (int64_t o = 0; o < H; ++o)
        for (int64_t j = 0; j < P; ++j) {  // prefix keys: mixed by R E, not convolved
          float sum = 0.f;
          for (int64_t e = 0; e < eh; ++e) {
            float x = 0.f;
            for (int64_t i = 0; i < H; ++i) x += E[e * H + i] * a_all[(i * p.rows + m) * p.tokens + j];
            sum += R[o * eh + e] * x;
          }
          out_all[(o * p.rows + m) * p.tokens + j] = sum;
        }
    }
  });
  return out;
}

at::Tensor refine_forward(const at::Tensor& maps, const at::Tensor& expand, const at::Tensor& kernel,
                          const at::Tensor& reduce, int64_t grid_h, int64_t grid_w) {
  check_refiner_args(maps, expand, kernel, reduce, grid_h, grid_w);
  const RefinerPlan p(maps, kernel, grid_h, grid_w);
  return p.k == 3 ? refine_forward_k<3>(p, maps, expand, kernel, reduce) : refine_forward_k<0>(p, maps, expand, kernel, reduce);
}

using RefinerGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // d_maps, d_expand, d_kernel, d_reduce

template <int K>
RefinerGrads refine_backward_k(const RefinerPlan& p, const at::Tensor& d_out, const at::Tensor& maps,
                               const at::Tensor& expand, const at::Tensor& kernel, const at::Tensor& reduce) {
  const int64_t H = p.heads, eh = p.expanded, P = p.prefix, k = K > 0 ? K : p.k, kk = k * k;
  at::Tensor d_maps = at::empty_like(maps);
  const float *a_all = maps.data_ptr<float>(), *g_all = d_out.data_ptr<float>();
  const float *E = expand.data_ptr<float>(), *C = kernel.data_ptr<float>(), *R = reduce.data_ptr<float>();
  float* da_all = d_maps.data_ptr<float>();
  // per chunk: dE (eh x H), dC (eh x kk), dR (H x eh), in that order
  const int64_t n_weights = eh * H + eh * kk + H * eh;
  const int64_t chunks = std::min(kRefinerChunks, std::max<int64_t>(p.rows, 1));
  std::vector<double> partial(chunks * n_weights, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    RefinerBuffers buf(p);
    // vector sums, kLanes floats each (a std::vector<vec> would drop vec's unaligned attribute)
    std::vector<float> sums_e(eh * H * kLanes), sums_c(eh * kk * kLanes), sums_r(H * eh * kLanes);
    auto acc_e = [&](int64_t t) -> float* { return sums_e.data() + t * kLanes; };
    auto acc_c = [&](int64_t t) -> float* { return sums_c.data() + t * kLanes; };
    auto acc_r = [&](int64_t t) -> float* { return sums_r.data() + t * kLanes; };
    std::vector<float> dy_prefix(eh);
    vec gv[kMaxRefinerHeads], dxv[kMaxRefinerHeads];
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      for (auto* sums : {&sums_e, &sums_c, &sums_r}) std::fill(sums->begin(), sums->end(), 0.f);
      double* out_weights = partial.data() + chunk * n_weights;  // the prefix keys' scalar sums go here directly
      for (int64_t m = chunk * p.rows / chunks; m < (chunk + 1) * p.rows / chunks; ++m) {
        gather_rows(p, a_all, m, buf.a.data());
        gather_rows(p, g_all, m, buf.g.data());
        expand_rows(p, buf.a.data(), E, buf.x.data());
        for (int64_t e = 0; e < eh; ++e) conv_row<K, false>(p, buf.x.data() + e * p.ld, C + e * kk, buf.y.data() + e * p.padded);
        for (int64_t o = 0; o < H; ++o)  // dR[o, e] += g[o] . y[e]
          for (int64_t e = 0; e < eh; ++e)
            add_dot(acc_r(o * eh + e), buf.g.data() + o * p.padded, buf.y.data() + e * p.padded, p.vectors);
        for (int64_t v = 0; v < p.vectors; ++v) {  // dy[e] = sum_o R[o, e] g[o]
          for (int64_t o = 0; o < H; ++o) gv[o] = load(buf.g.data() + o * p.padded + v * kLanes);
          for (int64_t e = 0; e < eh; ++e) {
            vec dy = vec{};
            for (int64_t o = 0; o < H; ++o) dy += splat(R[o * eh + e]) * gv[o];
            store(buf.dy.data() + e * p.ld + p.pad + v * kLanes, dy);
          }
        }
        for (int64_t e = 0; e < eh; ++e)  // dC[e][t] += dy[e] . (x[e] at tap t, masked)
          for (int64_t dyi = 0; dyi < k; ++dyi)
            for (int64_t dxi = 0; dxi < k; ++dxi) {
              const float* x = buf.x.data() + e * p.ld + p.pad + p.offset(dyi, dxi);
              const float* dy = buf.dy.data() + e * p.ld + p.pad;
              const ivec* masks = p.masks.data() + dxi * p.vectors;
              vec sum = load(acc_c(e * kk + dyi * k + dxi));
              for (int64_t v = 0; v < p.vectors; ++v) sum += load(dy + v * kLanes) * masked(load(x + v * kLanes), masks[v]);
              store(acc_c(e * kk + dyi * k + dxi), sum);
            }
        // dx[e], the conv's adjoint (into y, done with); dE[e, i] += dx[e] . a[i]; da[i] = sum_e E[e, i] dx[e]
        for (int64_t e = 0; e < eh; ++e) conv_row<K, true>(p, buf.dy.data() + e * p.ld, C + e * kk, buf.y.data() + e * p.padded);
        for (int64_t e = 0; e < eh; ++e)
          for (int64_t i = 0; i < H; ++i)
            add_dot(acc_e(e * H + i), buf.y.data() + e * p.padded, buf.a.data() + i * p.padded, p.vectors);
        for (int64_t v = 0; v < p.vectors; ++v) {
          for (int64_t e = 0; e < eh; ++e) dxv[e] = load(buf.y.data() + e * p.padded + v * kLanes);
          for (int64_t i = 0; i < H; ++i) {
            vec da = vec{};
            for (int64_t e = 0; e < eh; ++e) da += splat(E[e * H + i]) * dxv[e];
            store(buf.out.data() + i * p.padded + v * kLanes, da);
          }
        }
        // prefix keys, scalar: x = E a, y = x, dy = R^T g = dx; da = E^T dx
        for (int64_t j = 0; j < P; ++j) {
          for (int64_t e = 0; e < eh; ++e) {
            float x = 0.f, dy = 0.f;
            for (int64_t i = 0; i < H; ++i) x += E[e * H + i] * a_all[(i * p.rows + m) * p.tokens + j];
            for (int64_t o = 0; o < H; ++o) {
              const float g = g_all[(o * p.rows + m) * p.tokens + j];
              dy += R[o * eh + e] * g;
              out_weights[eh * H + eh * kk + o * eh + e] += static_cast<double>(g) * x;  // dR
            }
            dy_prefix[e] = dy;
          }
          for (int64_t i = 0; i < H; ++i) {
            const float a = a_all[(i * p.rows + m) * p.tokens + j];
            float da = 0.f;
            for (int64_t e = 0; e < eh; ++e) {
              da += E[e * H + i] * dy_prefix[e];
              out_weights[e * H + i] += static_cast<double>(dy_prefix[e]) * a;  // dE
            }
            da_all[(i * p.rows + m) * p.tokens + j] = da;
          }
        }
        scatter_rows(p, buf.out.data(), m, da_all);
      }
      for (int64_t t = 0; t < eh * H; ++t) out_weights[t] += reduce_add(load(acc_e(t)));
      for (int64_t t = 0; t < eh * kk; ++t) out_weights[eh * H + t] += reduce_add(load(acc_c(t)));
      for (int64_t t = 0; t < H * eh; ++t) out_weights[eh * H + eh * kk + t] += reduce_add(load(acc_r(t)));
    }
  });
  std::vector<double> total(n_weights, 0.0);
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    for (int64_t t = 0; t < n_weights; ++t) total[t] += partial[chunk * n_weights + t];
  auto weights = [&](int64_t first, at::IntArrayRef sizes) {
    at::Tensor t = at::empty(sizes, maps.options());
    float* dst = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) dst[i] = static_cast<float>(total[first + i]);
    return t;
  };
  return {d_maps, weights(0, {eh, H}), weights(eh * H, {eh, k, k}), weights(eh * H + eh * kk, {H, eh})};
}

RefinerGrads refine_backward(const at::Tensor& d_out, const at::Tensor& maps, const at::Tensor& expand,
                             const at::Tensor& kernel, const at::Tensor& reduce, int64_t grid_h, int64_t grid_w) {
  check_refiner_args(maps, expand, kernel, reduce, grid_h, grid_w);
  TORCH_CHECK(d_out.sizes() == maps.sizes() && d_out.scalar_type() == at::kFloat && d_out.is_contiguous(),
              "d_out: contiguous float32 of the maps' shape ", maps.sizes(), ", got ", d_out.sizes());
  const RefinerPlan p(maps, kernel, grid_h, grid_w);
  return p.k == 3 ? refine_backward_k<3>(p, d_out, maps, expand, kernel, reduce)
                  : refine_backward_k<0>(p, d_out, maps, expand, kernel, reduce);
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define REFINER_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define REFINER_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

REFINER_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) {
  m.def("refine_forward(Tensor maps, Tensor expand, Tensor kernel, Tensor reduce, int grid_h, int grid_w) -> Tensor");
  m.def("refine_backward(Tensor d_out, Tensor maps, Tensor expand, Tensor kernel, Tensor reduce, int grid_h, "
        "int grid_w) -> (Tensor, Tensor, Tensor, Tensor)");
}

REFINER_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) {
  m.impl("refine_forward", &refine_forward);
  m.impl("refine_backward", &refine_backward);
}
