// Linear layers over quantized weights (mmserve/quant/linear.py): y = x W^T + b with W stored as int8, int4 or
// fp8 codes and fp32 scales per (output row, group of `group` inputs), optional integer zero points.
//
// A decode step streams every weight once, so its time is the weights' bytes over DRAM bandwidth: int8 halves
// them against bf16, int4 quarters them (plus scales). That only turns into time if the codes are expanded in
// registers on the way to the multiply, never into a full-size weight in memory. Each thread takes a range of
// output rows; for each it expands the row's codes into an L1-resident buffer of the activations' dtype, one
// pass over the codes (a 16-entry table per group for int4, the one lookup a nibble needs), and dots every
// input row with it (AVX512-BF16 `vdpbf16ps` for bf16, FMA for fp32). On a CPU with AMX, bf16 rows go to
// tiles instead (quant_linear_amx): 16 output rows' codes expanded into a bf16 block once, then one tile
// product per 16 rows of x, so the codes are expanded once however many rows there are (measured: a 152k x
// 896 head at 16 rows in 11 ms on tiles against 45 ms with `vdpbf16ps` per row). The expanded values are the
// reference's dequantized weights exactly, `(q - z) * s` in fp32 (then rounded to bf16 for bf16 inputs), so
// only the order of the sums differs from a GEMM over the dequantized weights. Many rows (prefill) go the other
// way: `dequantize_weight` expands the whole weight once, in parallel, and the caller's GEMM (oneDNN) runs it.
//
// Codes (mmserve's layout, built by mmserve/quant/layout.py from every supported checkpoint format):
//   kind 0, int8: int8 (N, K), value q (- z);  kind 2, fp8: e4m3 bytes (N, K), value fp8(q);
//   kind 1, int4: uint8 (N, K/2); in each run of 32 inputs, byte j holds input j in its low nibble and input
//   j + 16 in its high nibble (one 16-byte load gives the run's two halves of 16 in order), value q - z.
#include <torch/library.h>

#include "cpu_common.h"
#include "avx512.h"
#include "decode_attention_amx.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MMSERVE_QUANT_SIMD 1
#endif

namespace {

using namespace mmserve_cpu_ops;

constexpr int64_t kInt8 = 0, kInt4 = 1, kFp8 = 2;

// How far ahead of the expansion the codes are prefetched: a thread reads its rows' codes front to back, but
// with the expansion's work between loads the core keeps too few misses in flight for DRAM's bandwidth
// (measured on a 152k x 896 head, bf16, 2 threads: int8 11.5 -> 6.6 ms, int4 10.1 -> 3.4 ms with 4 KB).
// Prefetches past the end of the codes are harmless (they never fault).
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_codes(const uint8_t* p) { __builtin_prefetch(p + kPrefetchBytes, 0, 3); }

// e4m3 (bias 7) as a float: its exponent and mantissa bits placed in a float's fields give 2^-120 of the value
// (a subnormal code becomes a float subnormal, still exact), and the sign goes to the top bit.
inline float fp8_value(uint8_t b) {
  const uint32_t bits = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * 0x1p120f;
}

struct Codes {
  const uint8_t* data;  // row-major codes of the whole weight
  const float* scales;  // (N, K / group)
  const int8_t* zeros;  // (N, K / group) or null
  int64_t k, group, kind;

  int64_t row_bytes() const { return kind == kInt4 ? k / 2 : k; }

  // Row n's dequantized weights (K floats), scalar: the reference the vector paths equal, and their tail.
  void row_scalar(int64_t n, float* out) const {
    const uint8_t* row = data + n * row_bytes();
    const int64_t groups = k / group;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t g = i / group;
      const float z = zeros ? static_cast<float>(zeros[n * groups + g]) : 0.f;
      const float s = scales[n * groups + g];
      float q;
      if (kind == kInt8) {
        q = static_cast<float>(static_cast<int8_t>(row[i]));
      } else if (kind == kInt4) {
        const int64_t base = (i / 32) * 16, j = i % 32;
        q = static_cast<float>(j < 16 ? row[base + j] & 0x0f : row[base + j - 16] >> 4);
      } else {
        out[i] = fp8_value(row[i]) * s;
        continue;
      }
      out[i] = (q - z) * s;
    }
  }
};

#ifdef MMSERVE_QUANT_SIMD
// 16 int8 or fp8 codes (16 bytes at p) dequantized: (q - z) * s, or the fp8 code's value times s; one rounding
// each, as the scalar path (row_scalar) does it.
inline __m512 dequantize16(int64_t kind, const uint8_t* p, __m512 z, __m512 s) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (kind == kInt8) return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), z), s);
  return _mm512_mul_ps(e4m3_to_ps(_mm512_cvtepu8_epi32(b)), s);
}

// Row n's dequantized weights as 16-float vectors, 32 inputs at a time: fn(offset, first 16, next 16).
template <typename Fn>
inline void expand_row(const Codes& c, int64_t n, Fn&& fn) {
  const uint8_t* row = c.data + n * c.row_bytes();
  const int64_t groups = c.k / c.group;
  const float* sc = c.scales + n * groups;
  const int8_t* zp = c.zeros ? c.zeros + n * groups : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(sc[g]);
    const __m512 z = _mm512_set1_ps(zp ? static_cast<float>(zp[g]) : 0.f);
    const int64_t end = (g + 1) * c.group;
    if (c.kind == kInt4) {  // the group's 16 possible values, looked up by nibble
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_mul_ps(_mm512_sub_ps(iota, z), s);
      for (int64_t i = g * c.group; i < end; i += 32) {
        if (i % 128 == 0) prefetch_codes(row + i / 2);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2)));
        const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0f));
        const __m512i hi = _mm512_srli_epi32(b, 4);
        fn(i, _mm512_permutexvar_ps(lo, table), _mm512_permutexvar_ps(hi, table));
      }
    } else {
      for (int64_t i = g * c.group; i < end; i += 32) {
        if (i % 64 == 0) prefetch_codes(row + i);
        fn(i, dequantize16(c.kind, row + i, z, s), dequantize16(c.kind, row + i + 16, z, s));
      }
    }
  }
}

// Row n dequantized into buf (K values of T).
inline void expand_into(const Codes& c, int64_t n, float* buf) {
  expand_row(c, n, [&](int64_t i, __m512 a, __m512 b) {
    _mm512_storeu_ps(buf + i, a);
    _mm512_storeu_ps(buf + i + 16, b);
  });
}
inline void expand_into(const Codes& c, int64_t n, BFloat16* buf) {
  expand_row(c, n, [&](int64_t i, __m512 a, __m512 b) {
    _mm512_storeu_si512(buf + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // low half from a: inputs in order
  });
}

inline float dot(const float* x, const float* w, int64_t k) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < k; i += 32)
    for (int p = 0; p < 2; ++p)
      acc[p] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16 * p), _mm512_loadu_ps(w + i + 16 * p), acc[p]);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}
inline float dot(const BFloat16* x, const BFloat16* w, int64_t k) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= k; i += 64)
    for (int p = 0; p < 2; ++p)
      acc[p] = _mm512_dpbf16_ps(acc[p], (__m512bh)_mm512_loadu_si512(x + i + 32 * p),
                                (__m512bh)_mm512_loadu_si512(w + i + 32 * p));
  if (i < k)
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(x + i), (__m512bh)_mm512_loadu_si512(w + i));
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

// The decode path for bf16 rows: codes expanded in registers straight into `vdpbf16ps`, no buffer, for up to
// 8 rows at a time (each row's two accumulators stay in registers). int4: a 32-byte load is two runs of 32
// inputs; widened to 16-bit lanes, its low nibbles are inputs [0, 16) and [32, 48) of the 64 and its high
// nibbles [16, 32) and [48, 64), each looked up in the group's table of 16 bf16 values (bf16((q - z) * s), the
// reference's weights) by `vpermw`. The rows of x are shuffled once per call into that lane order (`xs`), so
// lane i of the weights meets lane i of x. int8: 64 codes widened to fp32, dequantized as expand_row does it,
// rounded to bf16 in input order.
constexpr int64_t kRowTile = 8;

// x (M, K) in the int4 lane order: per 64 inputs, [0, 16) [32, 48) [16, 32) [48, 64).
void shuffle_int4_rows(const BFloat16* x, BFloat16* xs, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; i += 64)
      for (int q = 0; q < 4; ++q) {
        static constexpr int kFrom[4] = {0, 32, 16, 48};
        std::memcpy(xs + r * k + i + 16 * q, x + r * k + i + kFrom[q], 16 * sizeof(BFloat16));
      }
}

inline bool fast_bf16(const Codes& c) {
  return c.kind != kFp8 && c.k % 64 == 0 && c.group % 64 == 0;
}

// y[r, n] for rows [0, M) of x (in the lane order of the codes' kind), one output row n. M is a template
// argument so that the loops over rows unroll and the accumulators stay in registers.
template <int M>
inline void dot_rows(const Codes& c, int64_t n, const BFloat16* x, float* out) {
  constexpr int m = M;
  const uint8_t* row = c.data + n * c.row_bytes();
  const int64_t groups = c.k / c.group;
  const float* sc = c.scales + n * groups;
  const int8_t* zp = c.zeros ? c.zeros + n * groups : nullptr;
  __m512 acc[M][2];
  for (int r = 0; r < m; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(sc[g]);
    const __m512 z = _mm512_set1_ps(zp ? static_cast<float>(zp[g]) : 0.f);
    const int64_t end = (g + 1) * c.group;
    if (c.kind == kInt4) {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(iota, z), s)));
      for (int64_t i = g * c.group; i < end; i += 64) {
        if (i % 128 == 0) prefetch_codes(row + i / 2);
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i / 2)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x0f)), table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        for (int r = 0; r < m; ++r) {
          const BFloat16* xr = x + r * c.k + i;
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(xr), lo);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(xr + 32), hi);
        }
      }
    } else {
      for (int64_t i = g * c.group; i < end; i += 64) {
        prefetch_codes(row + i);
        __m512 v[4];
        for (int p = 0; p < 4; ++p) v[p] = dequantize16(kInt8, row + i + 16 * p, z, s);
        const __m512bh lo = _mm512_cvtne2ps_pbh(v[1], v[0]), hi = _mm512_cvtne2ps_pbh(v[3], v[2]);
        for (int r = 0; r < m; ++r) {
          const BFloat16* xr = x + r * c.k + i;
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(xr), lo);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(xr + 32), hi);
        }
      }
    }
  }
  for (int r = 0; r < m; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

void quant_linear_bf16(const Codes& c, const BFloat16* x, int64_t m, int64_t n, const BFloat16* bias,
                       BFloat16* y) {
  std::vector<BFloat16> shuffled;
  if (c.kind == kInt4) {
    shuffled.resize(m * c.k);
    shuffle_int4_rows(x, shuffled.data(), m, c.k);
    x = shuffled.data();
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float out[kRowTile];
    for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
      const int64_t rows = std::min(kRowTile, m - r0);
      for (int64_t j = begin; j < end; ++j) {
        const BFloat16* xr = x + r0 * c.k;
        switch (rows) {
          case 1: dot_rows<1>(c, j, xr, out); break;
          case 2: dot_rows<2>(c, j, xr, out); break;
          case 3: dot_rows<3>(c, j, xr, out); break;
          case 4: dot_rows<4>(c, j, xr, out); break;
          case 5: dot_rows<5>(c, j, xr, out); break;
          case 6: dot_rows<6>(c, j, xr, out); break;
          case 7: dot_rows<7>(c, j, xr, out); break;
          default: dot_rows<8>(c, j, xr, out); break;
        }
        const float b = bias ? static_cast<float>(bias[j]) : 0.f;
        for (int64_t r = 0; r < rows; ++r) y[(r0 + r) * n + j] = static_cast<BFloat16>(out[r] + b);
      }
    }
  });
}

#if defined(MMSERVE_HAVE_AMX)
// The same product on AMX tiles, for CPUs that have them: the multiply-adds cost next to nothing there, so the
// step is the codes' expansion alone, once per weight whatever the number of rows (up to kAmxRows). Per block
// of 16 output rows and chunk of 32 inputs: the 16 rows' codes expanded (exactly as expand_row does it, rounded
// to bf16) into one left-hand tile (16 outputs x 32 inputs), multiplied into one accumulator per 16 rows of x:
// y^T (16 outputs x 16 rows) += W chunk . x^T chunk, with x^T in AMX's pair layout ([pair of inputs][row][2]),
// built once per call, zero rows past M. Tiles 0-3 accumulate, 4 holds the weights, 5 x^T; all 16 x 64 bytes.
constexpr int64_t kAmxRows = 64;

struct alignas(64) QuantTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  QuantTileConfig() {
    for (int t = 0; t < 6; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// x (M, K) as tiles: [row tile][chunk of 32 inputs][pair][16 rows][2], rows past M zero.
void pair_rows(const BFloat16* x, int64_t m, int64_t k, BFloat16* out) {
  const int64_t tiles = (m + 15) / 16, chunks = k / 32;
  std::memset(out, 0, tiles * chunks * 512 * sizeof(BFloat16));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i)
      out[((r / 16) * chunks + i / 32) * 512 + ((i % 32) / 2) * 32 + (r % 16) * 2 + i % 2] = x[r * k + i];
}

// One block's 16 rows expanded 32 inputs at a time: their group's values (int4: a table of 16 bf16 values;
// int8 / fp8: the scale and zero) made once per group, not per chunk.
struct BlockExpander {
  const Codes& c;
  int64_t first, outs;  // the block's first row and how many rows it has (16 but at the end)
  __m512i table[16];
  __m512 scale[16], zero[16];

  void start_group(int64_t g) {
    const int64_t groups = c.k / c.group;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < outs; ++j) {
      const int64_t at = (first + j) * groups + g;
      scale[j] = _mm512_set1_ps(c.scales[at]);
      zero[j] = _mm512_set1_ps(c.zeros ? static_cast<float>(c.zeros[at]) : 0.f);
      if (c.kind == kInt4)
        table[j] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(iota, zero[j]), scale[j])));
    }
  }

  // Inputs [i, i + 32) of the block's rows into tile (16 rows of 32 bf16), zero rows past `outs`. Each row's
  // codes in the next block are prefetched as it goes (the rows are read side by side, so a prefetch a fixed
  // distance ahead within the block would land on codes already on their way).
  void chunk(int64_t i, BFloat16* tile) const {
    const int64_t bytes = c.row_bytes(), ahead = 16 * bytes;
    for (int64_t j = 0; j < outs; ++j) {
      const uint8_t* row = c.data + (first + j) * bytes;
      __m512i out;
      if (c.kind == kInt4) {  // 16 bytes hold the 32 inputs: low nibbles [0, 16), high [16, 32)
        if (i % 128 == 0) __builtin_prefetch(row + ahead + i / 2, 0, 3);
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2)));
        const __m512i idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0x0f))), _mm256_srli_epi16(b, 4), 1);
        out = _mm512_permutexvar_epi16(idx, table[j]);
      } else {
        if (i % 64 == 0) __builtin_prefetch(row + ahead + i, 0, 3);
        const __m512 v0 = dequantize16(c.kind, row + i, zero[j], scale[j]);
        const __m512 v1 = dequantize16(c.kind, row + i + 16, zero[j], scale[j]);
        out = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
      }
      _mm512_store_si512(tile + j * 32, out);
    }
  }
};

template <int kTiles>
void amx_blocks(const Codes& c, const BFloat16* xt, int64_t m, int64_t n, const BFloat16* bias, BFloat16* y,
                int64_t begin, int64_t end) {
  const int64_t chunks = c.k / 32;
  alignas(64) BFloat16 w[16 * 32] = {};
  alignas(64) float acc[16 * 16];
  for (int64_t blk = begin; blk < end; ++blk) {
    BlockExpander ex{c, blk * 16, std::min<int64_t>(16, n - blk * 16)};
    if (ex.outs < 16) std::memset(w, 0, sizeof(w));  // the rows past the end stay zero
    _tile_zero(0);
    if constexpr (kTiles > 1) _tile_zero(1);
    if constexpr (kTiles > 2) _tile_zero(2);
    if constexpr (kTiles > 3) _tile_zero(3);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      if ((ch * 32) % c.group == 0) ex.start_group(ch * 32 / c.group);
      ex.chunk(ch * 32, w);
      asm volatile("" ::: "memory");  // the tile load reads what chunk() stored: the compiler cannot tell
      _tile_loadd(4, w, 64);
      // Tile registers are named at compile time: one product per accumulator, unrolled.
      _tile_loadd(5, xt + ch * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (kTiles > 1) { _tile_loadd(5, xt + (chunks + ch) * 512, 64); _tile_dpbf16ps(1, 4, 5); }
      if constexpr (kTiles > 2) { _tile_loadd(5, xt + (2 * chunks + ch) * 512, 64); _tile_dpbf16ps(2, 4, 5); }
      if constexpr (kTiles > 3) { _tile_loadd(5, xt + (3 * chunks + ch) * 512, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    for (int t = 0; t < kTiles; ++t) {
      switch (t) {
        case 0: _tile_stored(0, acc, 64); break;
        case 1: _tile_stored(1, acc, 64); break;
        case 2: _tile_stored(2, acc, 64); break;
        default: _tile_stored(3, acc, 64); break;
      }
      asm volatile("" ::: "memory");
      const int64_t rows = std::min<int64_t>(16, m - t * 16);
      for (int64_t j = 0; j < ex.outs; ++j) {
        const float b = bias ? static_cast<float>(bias[ex.first + j]) : 0.f;
        for (int64_t r = 0; r < rows; ++r)
          y[(t * 16 + r) * n + ex.first + j] = static_cast<BFloat16>(acc[j * 16 + r] + b);
      }
    }
  }
}

void quant_linear_amx(const Codes& c, const BFloat16* x, int64_t m, int64_t n, const BFloat16* bias,
                      BFloat16* y) {
  const int64_t tiles = (m + 15) / 16;
  std::vector<BFloat16> xt(tiles * (c.k / 32) * 512);
  pair_rows(x, m, c.k, xt.data());
  const auto run = tiles == 1 ? amx_blocks<1> : tiles == 2 ? amx_blocks<2> : tiles == 3 ? amx_blocks<3> : amx_blocks<4>;
  at::parallel_for(0, (n + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    const QuantTileConfig config;
    _tile_loadconfig(&config);
    run(c, xt.data(), m, n, bias, y, begin, end);
    _tile_release();
  });
}
#endif
#endif

template <typename T>
void expand_any(const Codes& c, int64_t n, T* buf, float* scratch) {
#ifdef MMSERVE_QUANT_SIMD
  if (c.k % 32 == 0 && c.group % 32 == 0) return expand_into(c, n, buf);
#endif
  c.row_scalar(n, scratch);
  for (int64_t i = 0; i < c.k; ++i) buf[i] = from_f<T>(scratch[i]);
}

template <typename T>
float dot_any(const T* x, const T* w, int64_t k) {
#ifdef MMSERVE_QUANT_SIMD
  if (k % 32 == 0) return dot(x, w, k);
#endif
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += to_f(x[i]) * to_f(w[i]);
  return sum;
}

Codes codes_of(const Tensor& data, const Tensor& scales, const std::optional<Tensor>& zeros, int64_t kind,
               int64_t group, int64_t k) {
  TORCH_CHECK(kind == kInt8 || kind == kInt4 || kind == kFp8, "quant_linear: kind 0 (int8), 1 (int4) or 2 (fp8)");
  TORCH_CHECK(group > 0 && k % group == 0, "quant_linear: the group size must divide the input width");
  TORCH_CHECK(kind != kInt4 || k % 32 == 0, "quant_linear: int4 codes need an input width that is a multiple of 32");
  TORCH_CHECK(data.is_contiguous() && data.dim() == 2 && data.element_size() == 1, "quant_linear: codes (N, bytes)");
  const int64_t n = data.size(0);
  TORCH_CHECK(data.size(1) == (kind == kInt4 ? k / 2 : k), "quant_linear: codes do not match the input width");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / group,
              "quant_linear: scales (N, K / group) float32");
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kChar && zeros->sizes() == scales.sizes(),
                "quant_linear: zeros (N, K / group) int8");
  }
  return Codes{static_cast<const uint8_t*>(data.data_ptr()), scales.data_ptr<float>(),
               zeros.has_value() ? zeros->data_ptr<int8_t>() : nullptr, k, group, kind};
}

// y (M, N) = x (M, K) W^T + bias, x float32 or bfloat16 rows, y in x's dtype.
Tensor quant_linear(const Tensor& x, const Tensor& data, const Tensor& scales, const std::optional<Tensor>& zeros,
                    int64_t kind, int64_t group, const std::optional<Tensor>& bias) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_linear: x (M, K) contiguous");
  const int64_t m = x.size(0), k = x.size(1);
  const Codes c = codes_of(data, scales, zeros, kind, group, k);
  const int64_t n = data.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "quant_linear: bias (N,) of x's dtype");
  }
  Tensor y = at::empty({m, n}, x.options());
#ifdef MMSERVE_QUANT_SIMD
#if defined(MMSERVE_HAVE_AMX)
  // One row (c=1 decode) streams faster through `vdpbf16ps` in registers than through a tile buffer (a 152k x
  // 896 head: int8 6.6 against 10.8 ms, int4 4.0 against 6.7); from two rows on, the tiles.
  const bool one_row = m == 1 && fast_bf16(c);
  if (x.scalar_type() == at::kBFloat16 && !one_row && m <= kAmxRows && c.k % 32 == 0 && c.group % 32 == 0 &&
      amx_permitted()) {
    quant_linear_amx(c, x.data_ptr<BFloat16>(), m, n, bias.has_value() ? bias->data_ptr<BFloat16>() : nullptr,
                     y.data_ptr<BFloat16>());
    return y;
  }
#endif
  if (x.scalar_type() == at::kBFloat16 && fast_bf16(c)) {
    quant_linear_bf16(c, x.data_ptr<BFloat16>(), m, n, bias.has_value() ? bias->data_ptr<BFloat16>() : nullptr,
                      y.data_ptr<BFloat16>());
    return y;
  }
#endif
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
      std::vector<T> buf(k);
      std::vector<float> scratch(k);
      for (int64_t r = begin; r < end; ++r) {
        expand_any(c, r, buf.data(), scratch.data());
        const float b = bp ? to_f(bp[r]) : 0.f;
        for (int64_t i = 0; i < m; ++i) yp[i * n + r] = from_f<T>(dot_any(xp + i * k, buf.data(), k) + b);
      }
    });
  });
  return y;
}

// The whole weight dequantized, (N, K) in `dtype` (float32 or bfloat16): for steps of many rows.
Tensor dequantize_weight(const Tensor& data, const Tensor& scales, const std::optional<Tensor>& zeros, int64_t kind,
                         int64_t group, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_weight: float32 or bfloat16");
  const Codes c = codes_of(data, scales, zeros, kind, group, k);
  const int64_t n = data.size(0);
  Tensor w = at::empty({n, k}, data.options().dtype(dtype));
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* wp = w.data_ptr<T>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(k);
      for (int64_t r = begin; r < end; ++r) expand_any(c, r, wp + r * k, scratch.data());
    });
  });
  return w;
}

// Whether bf16 rows run on AMX tiles here (the CPU has them and the kernel grants them): the Python side then
// keeps many more rows on quant_linear before it turns to dequantize_weight and a GEMM.
bool quant_linear_has_amx() {
#if defined(MMSERVE_QUANT_SIMD) && defined(MMSERVE_HAVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mmserve_cpu, m) {
  m.def("quant_linear_amx() -> bool", &quant_linear_has_amx);  // no tensor to dispatch on: one kernel for all
  m.def(
      "quant_linear(Tensor x, Tensor data, Tensor scales, Tensor? zeros, int kind, int group, Tensor? bias) -> "
      "Tensor");
  m.def(
      "dequantize_weight(Tensor data, Tensor scales, Tensor? zeros, int kind, int group, int k, ScalarType dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(mmserve_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
}
