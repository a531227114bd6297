// decode_attention_, mmserve's CPU kernel for a decode step's attention (its schema is declared with the other
// kernels' in cpu_ops.cpp): every one-row query against its own slots, reading K and V in place in the pool.
// One task per (request, KV head); the G query heads of a KV head share each K and V row read. With AVX-512
// and head sizes 64, 128, 256 and 512 the scores take 16 slots as the vector lanes and the weighted V sum keeps every
// head's dims in registers, with the rows prefetched ahead; portable loops do the same multiply-adds in the
// same order elsewhere. The softmax follows SDPA's CPU kernel. In bf16 on a CPU with AMX (and a kernel that
// grants its tiles), head sizes 64 and 128 run on AMX instead (decode_attention_amx.h). An 8-bit pool
// (`--kv-cache-dtype`: fp8, or int8 codes with a scale per row) is read by the same paths, each row widened
// as it is loaded (to exactly what kv_dtype.from_cache gives): about half the bytes of a bf16 row, and the
// same math after the load.
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

#include "avx512.h"
#include "cpu_common.h"
#include "decode_attention_amx.h"

namespace {

using namespace mmserve_cpu_ops;

constexpr int64_t kLanes = 8;  // query heads per KV head scored together (Qwen2 shapes have 2-8)
constexpr int64_t kSlots = 8;  // slots scored together: independent multiply-add chains

#if defined(__AVX512F__)
// scores[g][j] = qf[g] . k_j for every slot, and each head's largest score into tops (qf holds kL-padded
// heads, zeros past `group`). 16 slots at a time are the vector lanes: their K rows, transposed in registers
// into kt (kt[d] = dim d of the 16 slots), are multiplied by each head's qf[g][d] broadcast. The same fused
// multiply-adds in the same order (dims in turn) as the loop with the heads as lanes, at twice the width.
template <typename C, int kDim, int kL>
void score_slots(const float* qf, const C* k_cache, const int64_t* slots, int64_t len, int64_t row_stride,
                 int64_t offset, int64_t group, float* kt, float* scores, float* tops) {
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - j0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t u = j0 + 16; u < std::min(j0 + 32, len); ++u)  // the next block's rows, while this one runs
      prefetch_row<C, kDim>(k_cache + slots[u] * row_stride + offset);
    for (int d0 = 0; d0 < kDim; d0 += 16) {
      __m512 r[16];
      for (int u = 0; u < 16; ++u)  // past the end: the last slot again, its scores dropped
        r[u] = load_row16<kDim>(k_cache + slots[j0 + std::min(u, n - 1)] * row_stride + offset, d0);
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
template <typename C, int kDim>
bool score_vectors(const float* qf, const C* k_cache, const int64_t* slots, int64_t len, int64_t row_stride,
                   int64_t offset, int64_t group, float* kt, float* scores, float* tops) {
  if constexpr (kDim == 0) {
    return false;
  } else {
    if (group < 2) return false;
    const auto run = group >= 5   ? score_slots<C, kDim, 8>
                     : group >= 3 ? score_slots<C, kDim, 4>
                                  : score_slots<C, kDim, 2>;
    run(qf, k_cache, slots, len, row_stride, offset, group, kt, scores, tops);
    return true;
  }
}
#else
template <typename C, int kDim>
bool score_vectors(const float*, const C*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                   float*) {
  return false;  // no AVX-512: the portable loops
}
#endif

#if defined(__AVX512F__)
// out[g] = (sum_j p[g][j] v[j]) / sum[g] for the G heads, kL heads at a time: kVecs vectors of 16 dims of each
// accumulate in registers over all slots (at most 16 vectors), each V row read once per block of dims. The
// same fused multiply-adds in the same order (slot by slot) as the plain loop: only loads and stores are fewer.
template <typename T, typename C, int kDim, int kL, int kVecs>
void weigh_values(const float* scores, int64_t len, const C* v_cache, const int64_t* slots, int64_t row_stride,
                  int64_t kv_head, int64_t group, const float* inv_sums, T* out, int64_t out_head_stride) {
  constexpr int kBlock = 16 * kVecs;
  static_assert(kDim % kBlock == 0, "head size must be a multiple of the block");
  const int64_t offset = kv_head * row_len<C>(kDim);
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
        if (d0 == 0 && j + 16 < len) prefetch_row<C, kDim>(v_cache + slots[j + 16] * row_stride + offset);
        const C* v = v_cache + slots[j] * row_stride + offset;
        __m512 vx[kVecs];
#pragma GCC unroll 4
        for (int x = 0; x < kVecs; ++x) vx[x] = load_row16<kDim>(v, d0 + 16 * x);
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
template <typename T, typename C, int kDim>
void weigh_values(const float* scores, int64_t len, const C* v_cache, const int64_t* slots, int64_t row_stride,
                  int64_t kv_head, int64_t group, const float* inv_sums, T* out, int64_t out_head_stride) {
  const auto run = group >= 5   ? weigh_values<T, C, kDim, 8, 2>
                   : group >= 3 ? weigh_values<T, C, kDim, 4, 4>
                   : group >= 2 ? weigh_values<T, C, kDim, 2, 4>
                                : weigh_values<T, C, kDim, 1, 4>;
  run(scores, len, v_cache, slots, row_stride, kv_head, group, inv_sums, out, out_head_stride);
}
#endif

// One request's G query heads (those sharing KV head `kv_head`) against its slots. kDim > 0 fixes the head
// size at compile time (64, 128, 256 and 512 cover the served models), so the per-row loops unroll into whole
// vectors.
template <typename T, typename C, int kDim>
void attend_one(const T* q, int64_t q_head_stride, const C* k_cache, const C* v_cache, const int64_t* slots,
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
  const int64_t row_stride = kv_heads * row_len<C>(dim), offset = kv_head * row_len<C>(dim);
  std::fill(tops, tops + group, -INFINITY);
  if (score_vectors<C, kDim>(qf, k_cache, slots, len, row_stride, offset, group, row, scores, tops)) {
    // scored 16 slots at a time (AVX-512, the head sizes above)
  } else if (group == 1) {  // one query head per KV head: a dot product per slot
    for (int64_t j = 0; j < len; ++j) {
      widen_row(k_cache + slots[j] * row_stride + offset, dim, row);
      float dot = 0.f;
      _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < dim; ++d) {
        dot = std::fma(qf[d], row[d], dot);
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
        const C* k[kSlots];
        for (int64_t u = 0; u < kSlots; ++u)  // past the end: the last slot again, its scores dropped
          k[u] = k_cache + slots[std::min(j + u, len - 1)] * row_stride + offset;
        for (int64_t u = 0; u < kSlots; ++u) widen_row(k[u], dim, kf + u * dim);  // then broadcast from memory
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
    for (int64_t j = 0; j < std::min<int64_t>(len, 16); ++j) prefetch_row<C, kDim>(v_cache + slots[j] * row_stride + offset);
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
    weigh_values<T, C, kDim>(scores, len, v_cache, slots, row_stride, kv_head, group, tops, out, out_head_stride);
    return;
  }
#endif
  for (int64_t j = 0; j < len; ++j) {
    widen_row(v_cache + slots[j] * row_stride + offset, dim, row);
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
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool int8 = cache_type == at::kChar;  // rows of D codes and their scale's 4 bytes
  const bool eight = int8 || cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && (cache_type == query.scalar_type() || eight) &&
                  v_cache.scalar_type() == cache_type &&
                  k_cache.size(2) == query.size(2) + (int8 ? kInt8ScaleBytes : 0),
              "decode_attention_: k_cache and v_cache (S, Hkv, D (+ 4: int8)), contiguous, of query's dtype, fp8 "
              "or int8");
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
  // The pool's element type: the query's, or an 8-bit cache's (read and widened to float as rows are loaded).
  auto with_cache = [&](auto tag, auto&& fn) {
    if (int8) {
      fn(tag, KvInt8<decltype(tag)>{});
    } else if (cache_type == at::kFloat8_e4m3fn) {
      fn(tag, c10::Float8_e4m3fn{});
    } else if (cache_type == at::kFloat8_e5m2) {
      fn(tag, c10::Float8_e5m2{});
    } else {
      fn(tag, tag);
    }
  };
  dispatch(query.scalar_type(), [&](auto query_tag) { with_cache(query_tag, [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    const scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const cache_t* kp = static_cast<const cache_t*>(k_cache.data_ptr());
    const cache_t* vp = static_cast<const cache_t*>(v_cache.data_ptr());
    const float fscale = static_cast<float>(scale);
    // A thread's share of the (request, KV head) tasks: attend(query heads, slots, length, KV head, out heads).
    auto each_task = [&](int64_t begin, int64_t end, auto&& attend) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads, first = h * group;
        attend(qp + rp[b] * query.stride(0) + first * query.stride(1), sp + b * width, lp[b], h,
               op + rp[b] * out.stride(0) + first * out.stride(1));
      }
    };
#if defined(MMSERVE_HAVE_AMX)
    if constexpr (std::is_same_v<scalar_t, BFloat16>) {  // a bf16 or an 8-bit pool
      if ((dim == 64 || dim == 128) && group >= 2 && group <= 16 && amx_permitted()) {
        const auto one = dim == 64 ? attend_amx<64, cache_t> : attend_amx<128, cache_t>;
        at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
          const AmxConfig config(static_cast<int>(group));
          _tile_loadconfig(&config);
          AmxScratch scratch;
          each_task(begin, end, [&](const scalar_t* q, const int64_t* slots, int64_t len, int64_t h, scalar_t* o) {
            one(q, query.stride(1), kp, vp, slots, len, kv_heads, h, group, fscale, o, out.stride(1), scratch);
          });
          _tile_release();
        });
        return;
      }
    }
#endif
    // Head sizes fixed at compile time: Qwen's 64 / 128, Gemma's 256 (and Gemma 4's full layers' 512).
    const auto one = dim == 64    ? attend_one<scalar_t, cache_t, 64>
                     : dim == 128 ? attend_one<scalar_t, cache_t, 128>
                     : dim == 256 ? attend_one<scalar_t, cache_t, 256>
                     : dim == 512 ? attend_one<scalar_t, cache_t, 512>
                                  : attend_one<scalar_t, cache_t, 0>;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;  // this thread's scratch, grown to the longest request it attends
      each_task(begin, end, [&](const scalar_t* q, const int64_t* slots, int64_t len, int64_t h, scalar_t* o) {
        one(q, query.stride(1), kp, vp, slots, len, kv_heads, h, group, dim, fscale, o, out.stride(1), buf);
      });
    });
  }); });
}

}  // namespace

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) { m.impl("decode_attention_", &decode_attention_); }
