// GPSA's whole layer in float32, one op per direction, for trainers/kernels/_gpsa_layer.py: the q, k, v
// projection, the attention core (forward_map / backward_map) and the output projection, a few
// images at a time, so that a chunk's q, k, v, its core's output, dO and d_qkv are still in the
// core's L2 when the next product reads them. Apart, each product streams the whole batch's
// (12,544 x 288 floats of q, k, v at GPSA's benchmark shape, 14.5 MB) through memory before the next
// starts. attention_core_fp32.cpp includes it after attention_ops.h and registers its ops in that
// library. With y = x W_qkv^T -> core -> out W_proj^T + b:
//
//     gpsa_layer_forward(x (B, N, C), w_qkv (3C, C), gate (H), pos (H, N, N), scale, w_proj (C, C),
//                        b_proj (C), for_backward, keep_maps)
//         -> y (B, N, C), and for the backward (else empty): qkv (B, N, 3C), the core's output
//            (B, N, C), each map row's max and 1 / sum, the softmax maps (keep_maps)
//     gpsa_layer_backward(dy, x, qkv, out, w_qkv, w_proj, gate, pos, row_max, row_inv, maps, coef, scale)
//         -> dx, dW_qkv, dW_proj, db_proj, sum_b dA (H, N, N), sum <dA, soft> per head (H)
//
// The products run on the kernel's broadcast-FMA tiles (gemm). The backward splits the batch into
// one part per thread, each part with its own weight-gradient and map sums, added in order
// afterwards: the result does not depend on scheduling (on the thread count it does, as
// attention_backward's sums). A part per image instead (fixed by B alone) cost ConViT-Ti's shape
// (B 8, N 196, C 192) 10 MB of sums to zero and add, more than the layer gained.
// benchmarks/gpsa_layer.py times it against the projections and the core apart
// (`ratio_fused_layer_gain`).
// For narrow layers only: every chunk's products pass over the whole weights and the backward adds
// into their whole gradients, so from C 288 on the layer apart is quicker (_gpsa_layer.py's limit).
#pragma once

namespace {

// a chunk: about this many tokens (4 images of 49, 1 of 196): its q, k, v and gradients in L2
constexpr int64_t kLayerChunkTokens = 196;

int64_t layer_chunk_images(int64_t tokens) { return std::max<int64_t>(1, kLayerChunkTokens / tokens); }

// y (rows x n, rows ldy apart) = x (rows x k, ldx apart) b, b (k x n) row-major; `add`: y += instead
inline void rows_times(int64_t rows, const float* x, int64_t ldx, const float* b, int64_t k, int64_t n, float* y,
                       int64_t ldy, bool add = false) {
  gemm(rows, n / kLanes, x, ldx, 1, b, n, k, y, ldy, 1.f, -1, add);
}

// out (k x n) += a^T b over `depth` rows: a (depth x k), b (depth x n), both row-major; in blocks of
// rows as linear_weight_grad (b's rows for a column block stay in L1 while the row tiles pass)
inline void add_weight_grad(int64_t depth, const float* a, int64_t k, const float* b, int64_t n, float* out) {
  for (int64_t d0 = 0; d0 < depth; d0 += kWeightGradDepthBlock)
    gemm(k, n / kLanes, a + d0 * k, 1, k, b + d0 * n, n, std::min(kWeightGradDepthBlock, depth - d0), out, n, 1.f, -1,
         true);
}

struct LayerDims {
  int64_t batch, tokens, width, heads;
  Dims core;  // per (batch, head), over one chunk of `chunk` images
  int64_t chunk;
};

LayerDims check_layer(const at::Tensor& x, const at::Tensor& w_qkv, const at::Tensor& gate, const at::Tensor& pos,
                      const at::Tensor& w_proj) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gpsa_layer: x contiguous float32 (B, N, C), got ", x.scalar_type(), " ", x.sizes());
  const int64_t B = x.size(0), N = x.size(1), C = x.size(2), H = gate.numel();
  TORCH_CHECK(N >= 1 && N <= kMaxTokens, "gpsa_layer: 1 <= N <= ", kMaxTokens, ", got ", N);
  TORCH_CHECK(H >= 1 && C % H == 0 && C % kLanes == 0, "gpsa_layer: C a multiple of the heads and of ", kLanes,
              ", got C ", C, " and ", H, " heads");
  check_floats(w_qkv, {3 * C, C}, "w_qkv");
  check_floats(w_proj, {C, C}, "w_proj");
  check_floats(gate, {H}, "gate");
  check_floats(pos, {H, N, N}, "pos");
  const int64_t chunk = layer_chunk_images(N);
  return {B, N, C, H, Dims(chunk, H, N, C / H), chunk};
}

// the strides of a chunk's q, k, v as (3, images, H, N, d) heads (Heads), in rows of 3C floats
std::vector<int64_t> chunk_strides(const LayerDims& L) {
  const int64_t C = L.width;
  return {C, L.tokens * 3 * C, C / L.heads, 3 * C, 1};
}

std::vector<at::Tensor> gpsa_layer_forward(const at::Tensor& x, const at::Tensor& w_qkv, const at::Tensor& gate,
                                           const at::Tensor& pos, double scale, const at::Tensor& w_proj,
                                           const at::Tensor& b_proj, bool for_backward, bool keep_maps) {
  const LayerDims L = check_layer(x, w_qkv, gate, pos, w_proj);
  const int64_t B = L.batch, N = L.tokens, C = L.width, H = L.heads, d = C / H;
  check_floats(b_proj, {C}, "b_proj");
  const at::TensorOptions floats = x.options();
  at::Tensor y = at::empty({B, N, C}, floats);
  // kept for the backward; in inference each thread's chunk buffers hold them instead
  at::Tensor qkv = at::empty({for_backward ? B : 0, N, 3 * C}, floats);
  at::Tensor out = at::empty({for_backward ? B : 0, N, C}, floats);
  at::Tensor row_max = at::empty({for_backward ? B * H * N : 0}, floats);
  at::Tensor row_inv = at::empty({for_backward ? B * H * N : 0}, floats);
  at::Tensor maps = at::empty({for_backward && keep_maps ? B * H * N * L.core.tokens_pad : 0}, floats);
  const at::Tensor w_qkv_t = w_qkv.t().contiguous(), w_proj_t = w_proj.t().contiguous();  // (C, 3C), (C, C)
  const at::Tensor pos_k = map_layout(pos, L.core);
  const float *px = x.data_ptr<float>(), *wq = w_qkv_t.data_ptr<float>(), *wp = w_proj_t.data_ptr<float>();
  const float *bias = b_proj.data_ptr<float>(), *g = gate.data_ptr<float>(), *p = pos_k.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const std::vector<int64_t> strides = chunk_strides(L);
  at::parallel_for(0, B, L.chunk, [&](int64_t begin, int64_t end) {
    Buffers buf(L.core, false);
    std::vector<float> qkv_chunk(for_backward ? 0 : L.chunk * N * 3 * C), out_chunk(for_backward ? 0 : L.chunk * N * C);
    for (int64_t b0 = begin; b0 < end; b0 += L.chunk) {
      const int64_t images = std::min(L.chunk, end - b0), rows = images * N;
      float* q = for_backward ? qkv.data_ptr<float>() + b0 * N * 3 * C : qkv_chunk.data();
      float* o = for_backward ? out.data_ptr<float>() + b0 * N * C : out_chunk.data();
      rows_times(rows, px + b0 * N * C, C, wq, C, 3 * C, q, 3 * C);  // q, k, v (rows x 3C)
      const Heads heads{q, strides};
      for (int64_t b = 0; b < images; ++b)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t m = (b0 + b) * H + h;  // the map's index in the batch
          forward_map(L.core, heads, b, h, static_cast<float>(scale), g, p, nullptr, Rows{o + b * N * C + h * d, C},
                      buf, for_backward ? row_max.data_ptr<float>() + m * N : nullptr,
                      for_backward ? row_inv.data_ptr<float>() + m * N : nullptr,
                      maps.numel() > 0 ? maps.data_ptr<float>() + m * N * L.core.tokens_pad : nullptr);
        }
      float* yc = py + b0 * N * C;
      for (int64_t r = 0; r < rows; ++r) copy_row(yc + r * C, bias, C);
      rows_times(rows, o, C, wp, C, C, yc, C, /*add=*/true);  // y = b + out W_proj^T
    }
    if (maps.numel() > 0) _mm_sfence();  // the maps are streamed past the caches: stored before the op returns
  });
  return {y, qkv, out, row_max, row_inv, maps};
}

std::vector<at::Tensor> gpsa_layer_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& qkv,
                                            const at::Tensor& out, const at::Tensor& w_qkv, const at::Tensor& w_proj,
                                            const at::Tensor& gate, const at::Tensor& pos, const at::Tensor& row_max,
                                            const at::Tensor& row_inv, const at::Tensor& maps, const at::Tensor& coef,
                                            double scale) {
  const LayerDims L = check_layer(x, w_qkv, gate, pos, w_proj);
  const int64_t B = L.batch, N = L.tokens, C = L.width, H = L.heads, d = C / H, ld = L.core.tokens_pad;
  check_floats(dy, {B, N, C}, "dy");
  check_floats(qkv, {B, N, 3 * C}, "qkv");
  check_floats(out, {B, N, C}, "out");
  check_floats(row_max, {B * H * N}, "row_max");
  check_floats(row_inv, {B * H * N}, "row_inv");
  const bool kept = maps.numel() > 0;
  if (kept) check_floats(maps, {B * H * N * ld}, "maps");
  check_floats(coef, {H}, "coef");
  at::Tensor dx = at::empty({B, N, C}, x.options());
  // each part's sums: dW_qkv^T (C x 3C), dW_proj^T (C x C), db (C), sum_b dA^T (H x N x ld, padded
  // for whole-vector stores), then its heads' <dA, soft> (H)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  const int64_t grads = 3 * C * C + C * C + C, sum_size = grads + H * N * ld + kLanes;
  at::Tensor sums = at::zeros({parts, sum_size}, x.options());
  at::Tensor dots = at::zeros({parts, H}, x.options());
  const at::Tensor pos_k = map_layout(pos, L.core);
  const float *pdy = dy.data_ptr<float>(), *px = x.data_ptr<float>(), *po = out.data_ptr<float>();
  const float *wq = w_qkv.data_ptr<float>(), *wp = w_proj.data_ptr<float>();
  const float *g = gate.data_ptr<float>(), *p = pos_k.data_ptr<float>(), *c = coef.data_ptr<float>();
  const float *mx = row_max.data_ptr<float>(), *inv = row_inv.data_ptr<float>();
  const float* soft = kept ? maps.data_ptr<float>() : nullptr;
  float* pdx = dx.data_ptr<float>();
  const std::vector<int64_t> strides = chunk_strides(L);
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    Buffers buf(L.core, false);
    std::vector<float> d_out(L.chunk * N * C), d_qkv(L.chunk * N * 3 * C);
    std::vector<double> head_dots(H);  // kept here: the parts' rows of `dots` share cache lines
    for (int64_t part = first; part < last; ++part) {
      float* dw_qkv_t = sums.data_ptr<float>() + part * sum_size;
      float *dw_proj_t = dw_qkv_t + 3 * C * C, *db = dw_proj_t + C * C, *sum_rows = db + C;
      std::fill(head_dots.begin(), head_dots.end(), 0.);
      for (int64_t b0 = B * part / parts; b0 < B * (part + 1) / parts; b0 += L.chunk) {
        const int64_t images = std::min(L.chunk, B * (part + 1) / parts - b0), rows = images * N;
        const float* dy_c = pdy + b0 * N * C;
        rows_times(rows, dy_c, C, wp, C, C, d_out.data(), C);           // dO = dy W_proj
        add_weight_grad(rows, po + b0 * N * C, C, dy_c, C, dw_proj_t);  // dW_proj^T += out^T dy
        for (int64_t r = 0; r < rows; ++r)                              // db += dy's rows
          for (int64_t j = 0; j < C; j += kLanes) store(db + j, load(db + j) + load(dy_c + r * C + j));
        const Heads heads{qkv.data_ptr<float>() + b0 * N * 3 * C, strides}, d_heads{d_qkv.data(), strides};
        for (int64_t b = 0; b < images; ++b)
          for (int64_t h = 0; h < H; ++h) {
            const int64_t m = (b0 + b) * H + h;
            const int64_t next_rows = h + 1 < H ? b * N * C + (h + 1) * d : (b + 1) * N * C;  // the next map's dO
            const bool last_map = h + 1 == H && b + 1 == images;
            const Rows d_out_next = last_map ? Rows{nullptr, 0} : Rows{d_out.data() + next_rows, C};
            if (kept && m + 1 < B * H) {  // the next map's kept soft into cache, as attention_backward
              const char* next = reinterpret_cast<const char*>(soft + (m + 1) * N * ld);
              for (int64_t byte = 0; byte < N * ld * 4; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T1);
            }
            backward_map(L.core, heads, d_heads, Rows{d_out.data() + b * N * C + h * d, C}, d_out_next, b, h,
                         static_cast<float>(scale), g, p, nullptr, mx + m * N, inv + m * N,
                         kept ? soft + m * N * ld : nullptr, c[h], buf, sum_rows, &head_dots[h]);
          }
        rows_times(rows, d_qkv.data(), 3 * C, wq, 3 * C, C, pdx + b0 * N * C, C);   // dx = d_qkv W_qkv
        add_weight_grad(rows, px + b0 * N * C, C, d_qkv.data(), 3 * C, dw_qkv_t);  // dW_qkv^T += x^T d_qkv
      }
      for (int64_t h = 0; h < H; ++h) dots.data_ptr<float>()[part * H + h] = static_cast<float>(head_dots[h]);
    }
  });
  const at::Tensor total = sums.sum(0);
  return {dx,
          total.narrow(0, 0, 3 * C * C).view({C, 3 * C}).t(),
          total.narrow(0, 3 * C * C, C * C).view({C, C}).t(),
          total.narrow(0, 4 * C * C, C),
          from_map_layout(total.narrow(0, grads, H * N * ld), L.core),
          dots.sum(0)};
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define GPSA_LAYER_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define GPSA_LAYER_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

GPSA_LAYER_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) {
  m.def("gpsa_layer_forward(Tensor x, Tensor w_qkv, Tensor gate, Tensor pos, float scale, Tensor w_proj, "
        "Tensor b_proj, bool for_backward, bool keep_maps) -> Tensor[]");
  m.def("gpsa_layer_backward(Tensor dy, Tensor x, Tensor qkv, Tensor out, Tensor w_qkv, Tensor w_proj, Tensor gate, "
        "Tensor pos, Tensor row_max, Tensor row_inv, Tensor maps, Tensor coef, float scale) -> Tensor[]");
}

GPSA_LAYER_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) {
  m.impl("gpsa_layer_forward", &gpsa_layer_forward);
  m.impl("gpsa_layer_backward", &gpsa_layer_backward);
}
