// The op both kernel libraries register as `layer_norm(x, residual?, weight, bias, eps)`: LayerNorm
// over the last dim of float32 tokens, or of x + residual (the block's `x + branch`, whose float32
// sum it also returns), in one pass over each row, written in the library's dtype: bf16
// (layer_norm_bf16.h: for bf16 inference, the value the next linear would cast it to) or float32
// (layer_norm_fp32.h). `LayerNorm` and `add_and_norm` (trainers/kernels/_norm.py) call it.
//
// The file that includes this defines, before: layer_norm_rows<Residual>(x, residual, sum, out,
// weight, bias, first, last, C, eps) over rows [first, last), Residual void (none) or float, and
// bf16 (at::BFloat16) where kNormResidualBf16; NormOut, the output's element type; and
// ATTENTION_LIBRARY, the ops' namespace.
#pragma once

namespace {

void check_norm_input(const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == sizes, what,
              ": a contiguous CPU ", dtype, " tensor of size ", sizes, ", got ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// x (..., C) float32; residual (..., C) float32 (or bf16 where the library takes it), or none;
// weight, bias (C) float32. -> [LayerNorm(x (+ residual)) as Out] or, with a residual, [that, x + residual]
template <typename Out, bool kBf16Residual>
std::vector<at::Tensor> layer_norm_op(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                      const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.dim() >= 1, "layer_norm: x (..., C), got a 0-d tensor");
  check_norm_input(x, x.sizes(), at::kFloat, "x");
  const int64_t C = x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
  check_norm_input(weight, {C}, at::kFloat, "weight");
  check_norm_input(bias, {C}, at::kFloat, "bias");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(c10::CppTypeToScalarType<Out>::value));
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1));  // rows per task: ~32 KB
  const float* px = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  Out* o = out.data_ptr<Out>();
  if (!residual.has_value()) {
    at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
      layer_norm_rows<void>(px, nullptr, nullptr, o, w, b, first, last, C, e);
    });
    return {out};
  }
  const at::Tensor& r = *residual;
  const bool bf16_residual = kBf16Residual && r.scalar_type() == at::kBFloat16;
  TORCH_CHECK(r.scalar_type() == at::kFloat || bf16_residual, "residual: float32", kBf16Residual ? " or bfloat16" : "",
              ", got ", r.scalar_type());
  check_norm_input(r, x.sizes(), r.scalar_type(), "residual");
  at::Tensor sum = at::empty(x.sizes(), x.options());
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    if constexpr (kBf16Residual) {
      if (bf16_residual)
        return layer_norm_rows<at::BFloat16>(px, r.data_ptr<at::BFloat16>(), s, o, w, b, first, last, C, e);
    }
    layer_norm_rows<float>(px, r.data_ptr<float>(), s, o, w, b, first, last, C, e);
  });
  return {out, sum};
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument unexpanded: expand ATTENTION_LIBRARY first
#define NORM_TORCH_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define NORM_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

NORM_TORCH_LIBRARY_FRAGMENT(ATTENTION_LIBRARY, m) {
  m.def("layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> Tensor[]");
}

NORM_TORCH_LIBRARY_IMPL(ATTENTION_LIBRARY, CPU, m) {
  m.impl("layer_norm", &layer_norm_op<NormOut, kNormResidualBf16>);
}
