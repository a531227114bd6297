// mmserve's CPU kernels for the decode step (`mmserve/engine/cpu_kernels.py` builds and loads this file and
// decode_attention.cpp).
//
// A decode step streams every weight once; what it spends beyond that GEMM floor is many small ops per layer
// (norms, RoPE, the gated activation, residual adds) and attention, which gathered every request's K/V out of
// the pool into a padded block before SDPA read it again. These kernels do each of those in one pass:
// - rms_norm / add_rms_norm: HF's Qwen2 RMSNorm (optionally after the residual add), the same roundings;
// - rope_: RoPE in place over the q and k heads of a row, as `x * cos + roll(x) * sin'` (sin' = sin with its
//   first half negated), rounding each product as the eager ops do: bitwise the eager result;
// - silu_mul: silu(gate) * up over the (T, 2I) gate/up GEMM output (in bf16 with AVX-512, torch's silu of each
//   of the 65,536 bf16 values from a table: the eager ops' bits);
// - store_kv_: a layer's new K and V rows into the pool at their slots, in one pass (rows already in the pool's
//   type: fp8 pools get them converted by the caller; an int8 pool's rows are quantized here, as
//   mmserve.engine.cache.kv_dtype does it);
// - greedy_argmax: each row's first maximum logit (torch.argmax's ids), rows and pieces of rows in parallel;
// - decode_attention_ (decode_attention.cpp): every one-row query against its own slots, reading K and V in
//   place in the pool (no gather), the G query heads that share a KV head together so each K/V row is read once
//   (on AMX tiles in bf16 where the CPU has them: decode_attention_amx.h).
// Element-wise work rounds to the tensor dtype where the eager ops round (float math, bf16 storage). The files
// are built with -ffp-contract=off so no multiply-add is fused into one rounding the eager ops do not have;
// the attention's sums, which are never the eager ones bit for bit, call std::fma where they want it.
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "avx512.h"
#include "cpu_common.h"

namespace {

using namespace mmserve_cpu_ops;

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

#if defined(__AVX512F__)
// torch's own silu of every bf16 value, as floats (256 KB; a layer's activations touch a few KB of it): the
// kernel's bf16 silu is then the eager op's bit for bit, where its own exp was about an ulp from torch's.
const float* bf16_silu_table() {
  static const std::vector<float> table = [] {
    c10::InferenceMode guard;
    const Tensor values = at::arange(65536, at::kInt).to(at::kShort).view(at::kBFloat16);
    const Tensor silu = at::silu(values).to(at::kFloat).contiguous();
    return std::vector<float>(silu.data_ptr<float>(), silu.data_ptr<float>() + 65536);
  }();
  return table.data();
}

// silu_mul_block for bf16 by table (built before the threads start): a gather per vector, where the exp and
// the division took ~2 cycles an element. The product with up rounds as the eager mul does.
template <>
void silu_mul_block<BFloat16>(const BFloat16* __restrict gate, const BFloat16* __restrict up,
                              BFloat16* __restrict out, int64_t n) {
  const float* table = bf16_silu_table();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate + i));
    const __m512 act = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, bits, table, 4);
    _mm256_mask_storeu_epi16(out + i, m, to_bf16(_mm512_mul_ps(act, load16(up + i, m))));
  }
}
#endif

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
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, BFloat16>) bf16_silu_table();
#endif
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

// One (token, KV head) row of an int8 pool, made from `dim` values as kv_dtype.to_cache makes it, with the
// same float operations: scale = max |x| / 127, codes = round-half-even(x / scale) clamped to [-127, 127], the
// scale's four bytes after the codes.
template <typename T>
void quantize_row(const T* x, int64_t dim, int8_t* out) {
  float top = 0.f;
  for (int64_t d = 0; d < dim; ++d) top = std::max(top, std::abs(to_f(x[d])));
  const float scale = top / 127.0f, safe = scale > 0.f ? scale : 1.0f;
  for (int64_t d = 0; d < dim; ++d)
    out[d] = static_cast<int8_t>(std::min(std::max(std::nearbyint(to_f(x[d]) / safe), -127.0f), 127.0f));
  std::memcpy(out + dim, &scale, sizeof(scale));
}

// A layer's new rows into an int8 pool (S, Hkv, D + 4), each quantized on its way in: one pass, where the eager
// quantization was a dozen ops a layer.
void store_kv_int8(Tensor& k_cache, Tensor& v_cache, const int64_t* sp, const Tensor& key, const Tensor& value) {
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2), width = k_cache.size(2);
  int8_t* kc = static_cast<int8_t*>(k_cache.data_ptr());
  int8_t* vc = static_cast<int8_t*>(v_cache.data_ptr());
  dispatch(key.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(heads * dim * 16), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          quantize_row(kp + t * key.stride(0) + h * key.stride(1), dim, kc + (sp[t] * heads + h) * width);
          quantize_row(vp + t * value.stride(0) + h * value.stride(1), dim, vc + (sp[t] * heads + h) * width);
        }
    });
  });
}

// k_cache[slots[t]] = key[t], v_cache[slots[t]] = value[t] for every new token t (any row strides): a layer's
// pool write in one pass, where two index_copy_ calls and their casts cost 40-50 us a layer at one row.
// An int8 pool takes the rows in the model's dtype and quantizes them (store_kv_int8); any other pool takes
// rows already in its type.
void store_kv_(Tensor k_cache, Tensor v_cache, const Tensor& slots, const Tensor& key, const Tensor& value) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "store_kv_: k_cache and v_cache (S, Hkv, D), contiguous, on the CPU");
  const at::ScalarType pool_type = k_cache.scalar_type();
  const bool int8 = pool_type == at::kChar;
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && key.dim() == 3 && key.sizes() == value.sizes() &&
                  key.size(1) == k_cache.size(1) && key.size(2) + (int8 ? kInt8ScaleBytes : 0) == k_cache.size(2) &&
                  key.stride(2) == 1 && value.stride(2) == 1 && value.scalar_type() == key.scalar_type() &&
                  (int8 ? key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16
                        : key.scalar_type() == pool_type),
              "store_kv_: key and value (T, Hkv, D) with contiguous heads, of the pool's row shape and dtype (an "
              "int8 pool: float32 or bfloat16 rows of D values, quantized here)");
  TORCH_CHECK(pool_type == at::kFloat || pool_type == at::kBFloat16 || pool_type == at::kFloat8_e4m3fn ||
                  pool_type == at::kFloat8_e5m2 || pool_type == at::kChar,
              "store_kv_: the pool must be float32, bfloat16, fp8 or int8 (its rows converted by the caller)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == key.size(0),
              "store_kv_: slots (T,) int64, one per row");
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2), num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)  // a bad slot would write outside the pool
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv_: slot out of range");
  if (int8) {
    store_kv_int8(k_cache, v_cache, sp, key, value);
    return;
  }
  // Bytes moved as they are: the rows are already in the pool's type.
  const int64_t item = k_cache.element_size(), row = heads * dim * item, bytes = dim * item;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks0 = key.stride(0) * item, ks1 = key.stride(1) * item;
  const int64_t vs0 = value.stride(0) * item, vs1 = value.stride(1) * item;
  at::parallel_for(0, rows, grain(heads * dim * 16), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kc + sp[t] * row + h * bytes, kp + t * ks0 + h * ks1, bytes);
        std::memcpy(vc + sp[t] * row + h * bytes, vp + t * vs0 + h * vs1, bytes);
      }
  });
}

constexpr int64_t kArgmaxPiece = 16384;  // logits of one argmax task: 32 KB of bf16, in L1/L2 for its two passes

struct PieceMax {
  float value;    // the piece's maximum (NaN if it holds one)
  int64_t index;  // its first position in the row
};

constexpr int64_t kArgmaxBlock = 256;  // logits per vectorised max: the first block holding the maximum is scanned

// The first maximum of n logits, a NaN counting as the maximum (torch.argmax's rule): a vectorised max and NaN
// count per block, then a scan of the first block that holds the maximum (or the first NaN).
template <typename T>
PieceMax piece_max(const T* x, int64_t n, int64_t offset) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  for (int64_t b = 0; b < n; b += kArgmaxBlock) {
    const int64_t len = std::min(kArgmaxBlock, n - b);
    float m = -std::numeric_limits<float>::infinity();
    int nans = 0;
    _Pragma("omp simd reduction(max : m) reduction(+ : nans)") for (int64_t i = 0; i < len; ++i) {
      const float v = to_f(x[b + i]);
      nans += v != v;
      m = std::max(m, v);
    }
    if (nans) {
      for (int64_t i = 0;; ++i)
        if (to_f(x[b + i]) != to_f(x[b + i])) return {std::numeric_limits<float>::quiet_NaN(), offset + b + i};
    }
    if (m > best) {  // strictly: an earlier block keeps a tie
      best = m;
      best_block = b;
    }
  }
  for (int64_t i = best_block; i < n; ++i)
    if (to_f(x[i]) == best) return {best, offset + i};
  return {best, offset};  // unreachable: some element is the maximum
}

// logits (B, V) -> (B,) int64: each row's first maximum, torch.argmax's ids, with rows and pieces of rows
// spread over the threads (one row of 151,936 logits is ten pieces).
Tensor greedy_argmax(const Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_argmax: logits (B, V), V > 0");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const int64_t pieces = (vocab + kArgmaxPiece - 1) / kArgmaxPiece;
  std::vector<PieceMax> found(rows * pieces);
  dispatch(logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows * pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / pieces, lo = (task % pieces) * kArgmaxPiece;
        found[task] = piece_max(base + r * stride + lo, std::min(kArgmaxPiece, vocab - lo), lo);
      }
    });
  });
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // the earliest piece wins ties; a NaN beats every number
    PieceMax best = found[r * pieces];
    for (int64_t p = 1; p < pieces && best.value == best.value; ++p) {
      const PieceMax& c = found[r * pieces + p];
      if (c.value != c.value || c.value > best.value) best = c;
    }
    op[r] = best.index;
  }
  return out;
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
  m.def("greedy_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("store_kv_", &store_kv_);
  m.impl("greedy_argmax", &greedy_argmax);
}
