// Gemma's RMSNorm for the fused Gemma 3 decoder layer (mmserve/engine/fused_gemma.py): transformers'
// `Gemma3RMSNorm` is `(x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + w.float())).to(dtype)`, one rounding at
// the end (Qwen2's norm rounds before the weight: rms_norm in cpu_ops.cpp), about seven eager ops; here one pass
// per row. With `residual`, `residual + norm(x)` rounded as the eager add is: the layer's post-norms feed the
// residual stream that way. Rows are the last dimension of x (2-D rows, or 3-D (T, heads, D) for the per-head
// q / k norms, any outer strides); the output is contiguous.
#include <torch/library.h>

#include "cpu_common.h"

namespace {

using namespace mmserve_cpu_ops;

template <typename T>
void gemma_norm_row(const T* x, const T* w, const T* res, T* out, int64_t n, float eps) {
  float sum = 0.f;
  _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);  // rms_norm's (torch's) roundings
  if (res == nullptr) {
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(x[i]) * inv * (1.0f + to_f(w[i])));
  } else {
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {
      const float h = to_f(from_f<T>(to_f(x[i]) * inv * (1.0f + to_f(w[i]))));
      out[i] = from_f<T>(to_f(res[i]) + h);
    }
  }
}

Tensor gemma_rms_norm(const Tensor& x, const Tensor& weight, double eps, const std::optional<Tensor>& residual) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "gemma_rms_norm: x (T, n) or (T, heads, n)");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "gemma_rms_norm: weight (n,) of x's dtype");
  const int64_t outer = x.size(0), inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t so = x.stride(0), si = x.dim() == 3 ? x.stride(1) : 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "gemma_rms_norm: residual contiguous, of x's shape and dtype");
  }
  Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, outer * inner, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r / inner, i = r % inner;
        gemma_norm_row(xp + o * so + i * si, wp, rp ? rp + r * n : nullptr, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def("gemma_rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("gemma_rms_norm", &gemma_rms_norm); }
