// What mmserve's CPU kernels share (cpu_ops.cpp, decode_attention.cpp): element types, float conversions,
// a vectorizable exp, the dtype dispatch and the row checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mmserve_cpu_ops {
using at::BFloat16;
using at::Tensor;

inline float to_f(float x) { return x; }
inline float to_f(BFloat16 x) { return static_cast<float>(x); }
// An fp8 KV cache's elements (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): read, never written, by the kernels.
inline float to_f(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_f(c10::Float8_e5m2 x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// An int8 KV cache's element (`--kv-cache-dtype int8`, mmserve/engine/cache/kv_dtype.py): a pool row of one
// token and one KV head is head_dim codes, then the row's fp32 scale in the next four bytes. The tag carries
// the model dtype T because a code's value, code x scale in float, is rounded to T as from_cache rounds it.
template <typename T>
struct KvInt8 {
  int8_t code;
};
constexpr int64_t kInt8ScaleBytes = 4;
template <typename C>
constexpr int64_t kRowExtra = 0;
template <typename T>
constexpr int64_t kRowExtra<KvInt8<T>> = kInt8ScaleBytes;
// Elements of a pool row of head size `dim` (the stride between one token's KV heads).
template <typename C>
constexpr int64_t row_len(int64_t dim) { return dim + kRowExtra<C>; }

template <typename T>
inline float row_scale(const KvInt8<T>* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof(s));
  return s;
}

// A pool row's `dim` values as floats: the element types' own values, an int8 row's code x scale rounded to T.
template <typename C>
inline void widen_row(const C* row, int64_t dim, float* dst) {
  _Pragma("omp simd") for (int64_t d = 0; d < dim; ++d) dst[d] = to_f(row[d]);
}
template <typename T>
inline void widen_row(const KvInt8<T>* row, int64_t dim, float* dst) {
  const float s = row_scale(row, dim);
  for (int64_t d = 0; d < dim; ++d) dst[d] = to_f(from_f<T>(static_cast<float>(row[d].code) * s));
}

// exp for float in Cody-Waite range reduction and a degree-6 polynomial (the classic Cephes coefficients),
// written with plain arithmetic so loops over it vectorize; within about one ulp of expf.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Calls fn with a value of the element type: float or BFloat16 (check_rows admits nothing else).
template <typename Fn>
inline void dispatch(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(BFloat16{});
  }
}

inline void check_rows(const Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1, name, " must be rows with a contiguous last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// Rows per parallel task so that a task is worth a thread (one decode row of 896 runs inline).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

}  // namespace mmserve_cpu_ops
