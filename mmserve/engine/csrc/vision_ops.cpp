// mmserve's CPU kernels for the vision towers (`mmserve/encoder/vision_attention.py` and
// `activation_table.py` call them).
//
// - vision_rope: the 2-D rotary embedding of Qwen2-VL, Qwen2.5-VL and Qwen3-VL's vision attention, q and k in
//   one pass. HF's `apply_rotary_pos_emb_vision` takes about eight ops per layer over (S, heads, D): both to
//   fp32, `x * cos`, `rotate_half` (a negation and a cat), `* sin`, the add, both back to the dtype: about 3 ms
//   a layer for the 1,024 patches of a 448² image in bf16, 14% of the tower. Here each output is computed as
//   those ops compute it (fp32 products, one rounding each, their fp32 sum, one rounding to the dtype; no
//   fused multiply-add: -ffp-contract=off), so the result is HF's bit for bit, in fp32 and bf16.
// - bf16_lookup: a bf16 element-wise function by table, out[i] = table[bits of x[i]]. The towers' MLP
//   activations (QuickGELU: a multiply, a sigmoid and a multiply, each rounding to bf16) are a function of one
//   bf16 value, so a table of the activation module's own outputs for all 65,536 values gives its bits in one
//   gather per 16 elements (`encoder/activation_table.py` builds it).
#include <torch/library.h>

#include <tuple>

#include "avx512.h"
#include "cpu_common.h"

namespace {

using namespace mmserve_cpu_ops;

// One head's row: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]).
template <typename T>
void vision_rope_row(const T* __restrict x, const float* __restrict cos, const float* __restrict sin,
                     T* __restrict out, int64_t half) {
  _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
    const float lo = to_f(x[i]), hi = to_f(x[i + half]);
    const float a = lo * cos[i], b = -hi * sin[i];
    const float c = hi * cos[i + half], d = lo * sin[i + half];
    out[i] = from_f<T>(a + b);
    out[i + half] = from_f<T>(c + d);
  }
}

// q, k: (S, heads, D) with heads D apart (views of the qkv GEMM's output); cos, sin: (S, D) fp32. Returns the
// rotated q and k, contiguous (S, heads, D), in q's dtype: what HF's function returns.
std::tuple<Tensor, Tensor> vision_rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  check_rows(q, "q");
  check_rows(k, "k");
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.stride(1) == q.size(2) && k.stride(1) == k.size(2) &&
                  q.scalar_type() == k.scalar_type(),
              "vision_rope: q and k (S, heads, D) of one dtype, heads D apart");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(dim % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim,
              "vision_rope: cos and sin (S, D), contiguous fp32, D even");
  Tensor q_out = at::empty({rows, heads, dim}, q.options());
  Tensor k_out = at::empty({rows, heads, dim}, k.options());
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
    at::parallel_for(0, rows * heads, grain(2 * dim), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / heads, h = task % heads;
        const float *c = cp + t * dim, *s = sp + t * dim;
        vision_rope_row(qp + t * q_stride + h * dim, c, s, qo + task * dim, dim / 2);
        vision_rope_row(kp + t * k_stride + h * dim, c, s, ko + task * dim, dim / 2);
      }
    });
  });
  return {q_out, k_out};
}

// x bf16, contiguous; table (65536,) int32 whose low 16 bits are the output's bf16 bits for each input's.
Tensor bf16_lookup(const Tensor& x, const Tensor& table) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_lookup: x contiguous bf16 on the CPU");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous() && table.numel() == 65536,
              "bf16_lookup: table (65536,) int32");
  Tensor out = at::empty_like(x);
  const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr<BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<BFloat16>());
  const int32_t* tp = table.data_ptr<int32_t>();
  at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX512F__)
    for (; i < end; i += 16) {
      const __mmask16 m = tail_mask(end - i);
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, in + i));
      const __m512i found = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, bits, tp, 4);
      _mm256_mask_storeu_epi16(op + i, m, _mm512_cvtepi32_epi16(found));
    }
#endif
    for (; i < end; ++i) op[i] = static_cast<uint16_t>(tp[in[i]]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def("vision_rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("bf16_lookup(Tensor x, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("vision_rope", &vision_rope);
  m.impl("bf16_lookup", &bf16_lookup);
}
