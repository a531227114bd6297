// mmserve's CPU kernels for the decode step (`mmserve/engine/cpu_kernels.py` builds and loads this file).
//
// A decode step streams every weight once; what it spends beyond that GEMM floor is many small ops per layer
// (norms, RoPE, the gated activation, residual adds) and attention, which gathered every request's K/V out of
// the pool into a padded block before SDPA read it again. These kernels do each of those in one pass:
// - rms_norm / add_rms_norm: HF's Qwen2 RMSNorm (optionally after the residual add), the same roundings;
// - rope_: RoPE in place over the q and k heads of a row, as `x * cos + roll(x) * sin'` (sin' = sin with its
//   first half negated), rounding each product as the eager ops do: bitwise the eager result;
// - silu_mul: silu(gate) * up over the (T, 2I) gate/up GEMM output;
// - decode_attention_: every one-row query against its own slots, reading K and V in place in the pool
//   (no gather), the G query heads that share a KV head together so each K/V row is read once;
// - store_kv_: a layer's new K and V rows into the pool at their slots, in one pass.
// Element-wise work rounds to the tensor dtype where the eager ops round (float math, bf16 storage). The file
// is built with -ffp-contract=off so no multiply-add is fused into one rounding the eager ops do not have;
// the attention's sums, which are never the eager ones bit for bit, call std::fma where they want it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;

inline float to_f(float x) { return x; }
inline float to_f(BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

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
void dispatch(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else {
    fn(BFloat16{});
  }
}

void check_rows(const Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1, name, " must be rows with a contiguous last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// Rows per parallel task so that a task is worth a thread (one decode row of 896 runs inline).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float sum = 0.f;
  _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {
    const float h = to_f(from_f<T>(to_f(x[i]) * inv));  // HF: normalized in fp32, back to the dtype,
    out[i] = from_f<T>(to_f(w[i]) * h);                  // then times the weight in the dtype
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(), "rms_norm: x (T, n), weight (n,) of x's dtype");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  Tensor out = at::empty({rows, n}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

template <typename T>
void add_row(const T* __restrict x, const T* __restrict delta, T* __restrict out, int64_t n) {
  _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(x[i]) + to_f(delta[i]));
}

// (x + delta, rms_norm(x + delta)): the residual add rounded to the dtype as the eager add is.
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and delta (T, n), weight (n,), one dtype");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), ds = delta.stride(0);
  Tensor sum = at::empty({rows, n}, x.options());
  Tensor out = at::empty({rows, n}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(xp + r * xs, dp + r * ds, sp + r * n, n);
        norm_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// One head's row in place: the first half pairs with the second (rotate_half), so both halves are read first.
template <typename T, int kHalf>
void rope_row(T* __restrict row, const T* __restrict cos, const T* __restrict sin, int64_t runtime_half) {
  const int64_t half = kHalf > 0 ? kHalf : runtime_half;  // fixed for head sizes 64 and 128: unrolled
  float lo[256], hi[256];  // head_dim <= 512 (checked)
  _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
    lo[i] = to_f(row[i]);
    hi[i] = to_f(row[i + half]);
  }
  _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
    const float a = to_f(from_f<T>(lo[i] * to_f(cos[i])));
    const float b = to_f(from_f<T>(hi[i] * to_f(sin[i])));
    row[i] = from_f<T>(a + b);
    const float c = to_f(from_f<T>(hi[i] * to_f(cos[i + half])));
    const float d = to_f(from_f<T>(lo[i] * to_f(sin[i + half])));
    row[i + half] = from_f<T>(c + d);
  }
}

// In place: qk (T, heads, D) rows (any row stride, heads D apart), cos and signed sin (T, D).
void rope_(Tensor qk, const Tensor& cos, const Tensor& sin) {
  check_rows(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(1) == qk.size(2), "rope_: qk (T, heads, D) with heads D apart");
  const int64_t rows = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2, stride = qk.stride(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim && cos.scalar_type() == qk.scalar_type() &&
                  sin.scalar_type() == qk.scalar_type() && dim % 2 == 0 && dim <= 512,
              "rope_: cos and sin (T, D), contiguous, of qk's dtype");
  dispatch(qk.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* base = qk.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const auto one = half == 32   ? rope_row<scalar_t, 32>
                     : half == 64 ? rope_row<scalar_t, 64>
                                  : rope_row<scalar_t, 0>;
    at::parallel_for(0, rows * heads, grain(dim), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / heads, h = task % heads;
        one(base + t * stride + h * dim, cp + t * dim, sp + t * dim, half);
      }
    });
  });
}

constexpr int64_t kActBlock = 512;  // elements of one silu_mul task

// silu(gate) * up over n <= kActBlock elements, each rounded to T as the eager ops round. exp first, into a
// buffer, then the rest: GCC's code for the two in one loop ran 4x slower here.
template <typename T>
void silu_mul_block(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t n) {
  float e[kActBlock];
  _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) e[i] = fast_exp(-to_f(gate[i]));
  _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {
    const float x = to_f(gate[i]);
    const float act = to_f(from_f<T>(x / (1.0f + e[i])));
    out[i] = from_f<T>(act * to_f(up[i]));
  }
}

// gate_up (T, 2I) -> silu(gate) * up (T, I): the gated MLP's activation in one pass.
Tensor silu_mul(const Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up (T, 2I)");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  Tensor out = at::empty({rows, width}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t blocks = (width + kActBlock - 1) / kActBlock;  // row pieces: one row spreads over threads
    at::parallel_for(0, rows * blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / blocks, lo = (task % blocks) * kActBlock;
        const scalar_t* g = in + r * stride + lo;
        silu_mul_block(g, g + width, op + r * width + lo, std::min(kActBlock, width - lo));
      }
    });
  });
  return out;
}

constexpr int64_t kLanes = 8;  // query heads per KV head scored together (Qwen2 shapes have 2-8)
constexpr int64_t kSlots = 8;  // slots scored together: independent multiply-add chains

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {  // bf16 is the high half of a float: widen and shift
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(BFloat16* p, __m512 x) {
  alignas(64) float f[16];
  _mm512_store_ps(f, x);
  for (int i = 0; i < 16; ++i) p[i] = from_f<BFloat16>(f[i]);
}

// Asks for one head's row (kDim elements) in L1 ahead of its use. The pool is far larger than the caches and a
// request's rows are scattered (its decode tokens' slots interleave with other requests'), so each row read
// waited on DRAM: the kernel ran at a third of the bandwidth a plain read of the same rows reaches.
template <typename T, int kDim>
inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int off = 0; off < kDim * static_cast<int>(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// r[i] = column i of the 16 x 16 block whose rows are r[0..15].
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved by element...
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // ...then by pairs of elements...
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {  // ...then by 128-bit quarters, twice
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// scores[g][j] = qf[g] . k_j for every slot, and each head's largest score into tops (qf holds kL-padded
// heads, zeros past `group`). 16 slots at a time are the vector lanes: their K rows, transposed in registers
// into kt (kt[d] = dim d of the 16 slots), are multiplied by each head's qf[g][d] broadcast. The same fused
// multiply-adds in the same order (dims in turn) as the loop with the heads as lanes, at twice the width.
template <typename T, int kDim, int kL>
void score_slots(const float* qf, const T* k_cache, const int64_t* slots, int64_t len, int64_t row_stride,
                 int64_t offset, int64_t group, float* kt, float* scores, float* tops) {
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - j0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t u = j0 + 16; u < std::min(j0 + 32, len); ++u)  // the next block's rows, while this one runs
      prefetch_row<T, kDim>(k_cache + slots[u] * row_stride + offset);
    for (int d0 = 0; d0 < kDim; d0 += 16) {
      __m512 r[16];
      for (int u = 0; u < 16; ++u)  // past the end: the last slot again, its scores dropped
        r[u] = load16(k_cache + slots[j0 + std::min(u, n - 1)] * row_stride + offset + d0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + i) * 16, r[i]);
    }
    for (int64_t g0 = 0; g0 < group; g0 += kL) {
      const float* qg = qf + g0 * kDim;
      __m512 acc[kL];
#pragma GCC unroll 8
      for (int l = 0; l < kL; ++l) acc[l] = _mm512_setzero_ps();
      for (int d = 0; d < kDim; ++d) {
        const __m512 k = _mm512_loadu_ps(kt + d * 16);
#pragma GCC unroll 8
        for (int l = 0; l < kL; ++l) acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(qg[l * kDim + d]), k, acc[l]);
      }
      const int64_t lanes = std::min<int64_t>(kL, group - g0);
      for (int l = 0; l < lanes; ++l) {
        _mm512_mask_storeu_ps(scores + (g0 + l) * len + j0, valid, acc[l]);
        tops[g0 + l] = std::max(tops[g0 + l], _mm512_mask_reduce_max_ps(valid, acc[l]));
      }
    }
  }
}

// score_slots with lanes for the group's heads; false where it does not apply (one head: a dot product).
template <typename T, int kDim>
bool score_vectors(const float* qf, const T* k_cache, const int64_t* slots, int64_t len, int64_t row_stride,
                   int64_t offset, int64_t group, float* kt, float* scores, float* tops) {
  if constexpr (kDim == 0) {
    return false;
  } else {
    if (group < 2) return false;
    const auto run = group >= 5   ? score_slots<T, kDim, 8>
                     : group >= 3 ? score_slots<T, kDim, 4>
                                  : score_slots<T, kDim, 2>;
    run(qf, k_cache, slots, len, row_stride, offset, group, kt, scores, tops);
    return true;
  }
}
#else
template <typename T, int kDim>
bool score_vectors(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                   float*) {
  return false;  // no AVX-512: the portable loops
}
#endif

#if defined(__AVX512F__)
// out[g] = (sum_j p[g][j] v[j]) / sum[g] for the G heads, kL heads at a time: kVecs vectors of 16 dims of each
// accumulate in registers over all slots (at most 16 vectors), each V row read once per block of dims. The
// same fused multiply-adds in the same order (slot by slot) as the plain loop: only loads and stores are fewer.
template <typename T, int kDim, int kL, int kVecs>
void weigh_values(const float* scores, int64_t len, const T* v_cache, const int64_t* slots, int64_t row_stride,
                  int64_t kv_head, int64_t group, const float* inv_sums, T* out, int64_t out_head_stride) {
  constexpr int kBlock = 16 * kVecs;
  static_assert(kDim % kBlock == 0, "head size must be a multiple of the block");
  for (int64_t g0 = 0; g0 < group; g0 += kL) {
    const int64_t lanes = std::min<int64_t>(kL, group - g0);
    const float* p[kL];  // the heads past `group` have weights 0 (the caller pads `scores`)
    for (int l = 0; l < kL; ++l) p[l] = scores + (g0 + l) * len;
    for (int d0 = 0; d0 < kDim; d0 += kBlock) {
      __m512 a[kL][kVecs];
#pragma GCC unroll 8
      for (int l = 0; l < kL; ++l)
#pragma GCC unroll 4
        for (int x = 0; x < kVecs; ++x) a[l][x] = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        if (d0 == 0 && j + 16 < len) prefetch_row<T, kDim>(v_cache + slots[j + 16] * row_stride + kv_head * kDim);
        const T* v = v_cache + slots[j] * row_stride + kv_head * kDim + d0;
        __m512 vx[kVecs];
#pragma GCC unroll 4
        for (int x = 0; x < kVecs; ++x) vx[x] = load16(v + 16 * x);
#pragma GCC unroll 8
        for (int l = 0; l < kL; ++l) {
          const __m512 w = _mm512_set1_ps(p[l][j]);
#pragma GCC unroll 4
          for (int x = 0; x < kVecs; ++x) a[l][x] = _mm512_fmadd_ps(w, vx[x], a[l][x]);
        }
      }
      for (int l = 0; l < lanes; ++l) {
        const __m512 inv = _mm512_set1_ps(inv_sums[g0 + l]);
        T* o = out + (g0 + l) * out_head_stride + d0;
#pragma GCC unroll 4
        for (int x = 0; x < kVecs; ++x) store16(o + 16 * x, _mm512_mul_ps(a[l][x], inv));
      }
    }
  }
}

// weigh_values with lanes for the group's heads (8 for 5-8 heads: one pass over V), few wasted on small groups.
template <typename T, int kDim>
void weigh_values(const float* scores, int64_t len, const T* v_cache, const int64_t* slots, int64_t row_stride,
                  int64_t kv_head, int64_t group, const float* inv_sums, T* out, int64_t out_head_stride) {
  const auto run = group >= 5   ? weigh_values<T, kDim, 8, 2>
                   : group >= 3 ? weigh_values<T, kDim, 4, 4>
                   : group >= 2 ? weigh_values<T, kDim, 2, 4>
                                : weigh_values<T, kDim, 1, 4>;
  run(scores, len, v_cache, slots, row_stride, kv_head, group, inv_sums, out, out_head_stride);
}
#endif

// One request's G query heads (those sharing KV head `kv_head`) against its slots. kDim > 0 fixes the head
// size at compile time (64 and 128 cover the served models), so the per-row loops unroll into whole vectors.
template <typename T, int kDim>
void attend_one(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache, const int64_t* slots,
                int64_t len, int64_t kv_heads, int64_t kv_head, int64_t group, int64_t runtime_dim, float scale,
                T* out, int64_t out_head_stride, std::vector<float>& buf) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t padded = (group + kLanes - 1) / kLanes * kLanes;  // heads, to whole vectors of lanes
  buf.resize(padded * dim + group * dim + padded * len + dim * (kLanes + kSlots) + group);
  float* qf = buf.data();  // the padding heads' queries are zeros
  float* acc = qf + padded * dim;
  float* scores = acc + group * dim;
  float* row = scores + padded * len;  // scratch: a V row, or the transposed queries and K rows
  float* tops = row + dim * (kLanes + kSlots);  // each head's largest score, then 1 / its softmax sum
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_f(q[g * q_head_stride + d]) * scale;
  std::fill(qf + group * dim, qf + padded * dim, 0.f);
  std::fill(acc, acc + group * dim, 0.f);
  const int64_t row_stride = kv_heads * dim;
  std::fill(tops, tops + group, -INFINITY);
  if (score_vectors<T, kDim>(qf, k_cache, slots, len, row_stride, kv_head * dim, group, row, scores, tops)) {
    // scored 16 slots at a time (AVX-512, head sizes 64 and 128)
  } else if (group == 1) {  // one query head per KV head: a dot product per slot
    for (int64_t j = 0; j < len; ++j) {
      const T* k = k_cache + slots[j] * row_stride + kv_head * dim;
      float dot = 0.f;
      _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < dim; ++d) {
        dot = std::fma(qf[d], to_f(k[d]), dot);
      }
      scores[j] = dot;
      tops[0] = std::max(tops[0], dot);
    }
  } else {
    // Up to kLanes query heads side by side as vector lanes: qT[d][lane]. Each K element is broadcast once
    // and multiplied into all of them, with no horizontal sums (a dot product per head cost twice as much).
    for (int64_t g0 = 0; g0 < group; g0 += kLanes) {
      const int64_t lanes = std::min<int64_t>(kLanes, group - g0);
      float* qt = row;
      float* kf = row + dim * kLanes;
      float top[kLanes];  // each head's largest score, kept as they are made (a max scan is a serial chain)
      std::fill(top, top + kLanes, -INFINITY);
      for (int64_t d = 0; d < dim; ++d)
        for (int64_t l = 0; l < kLanes; ++l) qt[d * kLanes + l] = l < lanes ? qf[(g0 + l) * dim + d] : 0.f;
      // kSlots slots at a time: independent accumulators, so the multiply-adds do not wait on each other.
      for (int64_t j = 0; j < len; j += kSlots) {
        const T* k[kSlots];
        for (int64_t u = 0; u < kSlots; ++u)  // past the end: the last slot again, its scores dropped
          k[u] = k_cache + slots[std::min(j + u, len - 1)] * row_stride + kv_head * dim;
        for (int64_t u = 0; u < kSlots; ++u)  // to float in whole vectors, then broadcast from memory
          _Pragma("omp simd") for (int64_t d = 0; d < dim; ++d) kf[u * dim + d] = to_f(k[u][d]);
        float s[kSlots][kLanes] = {};
        for (int64_t d = 0; d < dim; ++d) {
          const float* qd = qt + d * kLanes;
          for (int64_t u = 0; u < kSlots; ++u) {
            const float kd = kf[u * dim + d];
            _Pragma("omp simd") for (int64_t l = 0; l < kLanes; ++l) s[u][l] = std::fma(kd, qd[l], s[u][l]);
          }
        }
        for (int64_t u = 0; u < kSlots && j + u < len; ++u) {
          _Pragma("omp simd") for (int64_t l = 0; l < kLanes; ++l) top[l] = std::max(top[l], s[u][l]);
          for (int64_t l = 0; l < lanes; ++l) scores[(g0 + l) * len + j + u] = s[u][l];
        }
      }
      for (int64_t l = 0; l < lanes; ++l) tops[g0 + l] = top[l];
    }
  }
#if defined(__AVX512F__)
  if constexpr (kDim > 0) {  // the V pass's first rows arrive during the softmax
    for (int64_t j = 0; j < std::min<int64_t>(len, 16); ++j)
      prefetch_row<T, kDim>(v_cache + slots[j] * row_stride + kv_head * kDim);
  }
#endif
  // Softmax as SDPA's CPU kernel does it: the weights exp(s - max) summed in float, rounded to the dtype for
  // the product with V, the sum divided out at the end (keeping them in float drifted from HF's bf16 logits).
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    const float top = tops[g];
    float total = 0.f;
    _Pragma("omp simd reduction(+ : total)") for (int64_t j = 0; j < len; ++j) {
      const float e = fast_exp(s[j] - top);
      total += e;
      s[j] = to_f(from_f<T>(e));
    }
    tops[g] = 1.0f / total;
  }
  std::fill(scores + group * len, scores + padded * len, 0.f);  // the padding heads weigh nothing
#if defined(__AVX512F__)
  if constexpr (kDim > 0) {
    weigh_values<T, kDim>(scores, len, v_cache, slots, row_stride, kv_head, group, tops, out, out_head_stride);
    return;
  }
#endif
  for (int64_t j = 0; j < len; ++j) {
    const T* v = v_cache + slots[j] * row_stride + kv_head * dim;
    _Pragma("omp simd") for (int64_t d = 0; d < dim; ++d) row[d] = to_f(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + j];
      float* a = acc + g * dim;
      _Pragma("omp simd") for (int64_t d = 0; d < dim; ++d) a[d] = std::fma(p, row[d], a[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * out_head_stride + d] = from_f<T>(acc[g * dim + d] * tops[g]);
}

// out[rows[b]] = attention of query[rows[b]] (H heads) over slots[b, :lengths[b]] of the pool's K/V (S, Hkv, D).
void decode_attention_(Tensor out, const Tensor& query, const Tensor& rows, const Tensor& k_cache,
                       const Tensor& v_cache, const Tensor& slots, const Tensor& lengths, double scale) {
  check_rows(query, "query");
  check_rows(out, "out");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "decode_attention_: query and out (T, H, D), one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type() && k_cache.size(2) == query.size(2),
              "decode_attention_: k_cache and v_cache (S, Hkv, D), contiguous, of query's dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && rows.is_contiguous() && slots.is_contiguous() &&
                  lengths.is_contiguous() && slots.dim() == 2 && rows.numel() == slots.size(0) &&
                  lengths.numel() == slots.size(0),
              "decode_attention_: rows (B,), slots (B, L), lengths (B,), int64");
  const int64_t batch = slots.size(0), width = slots.size(1), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, num_slots = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0, "decode_attention_: heads must be a multiple of the KV heads");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {  // a bad index would read or write outside the tensors
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width && rp[b] >= 0 && rp[b] < query.size(0),
                "decode_attention_: bad row or length");
    for (int64_t j = 0; j < lp[b]; ++j) {
      const int64_t slot = sp[b * width + j];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "decode_attention_: slot out of range");
    }
  }
  dispatch(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const auto one = dim == 64    ? attend_one<scalar_t, 64>
                     : dim == 128 ? attend_one<scalar_t, 128>
                                  : attend_one<scalar_t, 0>;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;  // this thread's scratch, grown to the longest request it attends
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads, first = h * group;
        one(qp + rp[b] * query.stride(0) + first * query.stride(1), query.stride(1), kp, vp, sp + b * width,
            lp[b], kv_heads, h, group, dim, static_cast<float>(scale),
            op + rp[b] * out.stride(0) + first * out.stride(1), out.stride(1), buf);
      }
    });
  });
}

// k_cache[slots[t]] = key[t], v_cache[slots[t]] = value[t] for every new token t (any row strides): a layer's
// pool write in one pass, where two index_copy_ calls and their casts cost 40-50 us a layer at one row.
void store_kv_(Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& key, const Tensor& value) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "store_kv_: k_cache and v_cache (S, Hkv, D), contiguous, on the CPU");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && key.dim() == 3 && key.sizes() == value.sizes() &&
                  key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(2) && key.stride(2) == 1 &&
                  value.stride(2) == 1 && key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == k_cache.scalar_type(),
              "store_kv_: key and value (T, Hkv, D) with contiguous heads, of the pool's row shape and dtype");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "store_kv_: the pool must be float32 or bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == key.size(0),
              "store_kv_: slots (T,) int64, one per row");
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)  // a bad slot would write outside the pool
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv_: slot out of range");
  dispatch(k_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t row = heads * dim;
    const size_t bytes = dim * sizeof(scalar_t);
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(row * 16), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          std::memcpy(kc + sp[t] * row + h * dim, kp + t * key.stride(0) + h * key.stride(1), bytes);
          std::memcpy(vc + sp[t] * row + h * dim, vp + t * value.stride(0) + h * value.stride(1), bytes);
        }
    });
  });
}

}  // namespace

TORCH_LIBRARY(mmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decode_attention_(Tensor(a!) out, Tensor query, Tensor rows, Tensor k_cache, Tensor v_cache, Tensor slots, "
      "Tensor lengths, float scale) -> ()");
  m.def("store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention_", &decode_attention_);
  m.impl("store_kv_", &store_kv_);
}
