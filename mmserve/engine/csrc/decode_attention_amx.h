// The bf16 decode attention on AMX tiles (included by decode_attention.cpp): one (request, KV head) task, its
// G query heads against its slots, for head sizes 64 and 128 and 2-16 heads a group.
//
// Why: with AVX-512 the task spent most of its time turning K rows into vector lanes (16 x 16 transposes) and
// widening bf16 to float; read from DRAM the kernel ran at half the bandwidth. Here the multiply-adds are AMX's:
//   scores^T (16 slots x 16 heads) = K (16 slots x 32 dims, tile rows loaded straight from the pool where the
//   slots are consecutive, else gathered) . Q^T (pairs of dims x heads, built once a task);
//   out (G heads x 16 dims)      += P (G heads x 32 slots, the softmax weights rounded to bf16 as SDPA does)
//                                    . V (pairs of slots x dims, interleaved from two slots' rows).
// bf16 products are exact in float; only the order of the float sums differs from the AVX-512 loops (the
// kernel test compares both with SDPA at bf16's tolerance). The softmax runs with the heads as vector lanes.
// An 8-bit pool's rows are widened to bf16 as they are gathered into the K and V tiles (fp8 exactly; int8 as
// code x scale rounded to bf16, kv_dtype.from_cache's values).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define MMSERVE_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <type_traits>
#include <vector>

#include "avx512.h"
#include "cpu_common.h"

namespace mmserve_cpu_ops {

// Linux gives a process AMX's tile registers only when it asks (arch_prctl); oneDNN asks too, the first time
// it runs an AMX kernel. Asked once; false (the AVX-512 loops then) where the kernel or the VM refuses.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tile registers of the kernel: 0-3 accumulate out for 64 dims (16 each), 4 holds P, 5 a right-hand operand
// (Q^T or V), 6 K, 7 the scores of 16 slots.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit AmxConfig(int group) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = t <= 4 ? static_cast<uint8_t>(group) : 16;
    }
  }
};

// A thread's scratch, sized for the longest task it has run; bf16 rows of 32 elements are one tile row.
struct AmxScratch {
  std::vector<uint32_t> qt;     // Q^T: [chunk of 32 dims][pair of dims][16 heads] as bf16 pairs, zeros past G
  std::vector<BFloat16> k_rows;  // 16 gathered K rows
  std::vector<float> tile;       // one 16 x 16 tile of scores, [slot][head]
  std::vector<float> scores;     // [head][slot], the slots padded to a multiple of 32
  std::vector<BFloat16> p;       // the softmax weights: [block of 32 slots][head][slot % 32]
  std::vector<BFloat16> v_pairs;  // V of 32 slots: [16 dims][pair of slots][16 dims][2]
  std::vector<float> out;        // (16 heads, 64 dims)

  void fit(int64_t padded) {
    if (qt.empty()) {
      qt.assign(4 * 16 * 16, 0);
      k_rows.resize(16 * 128);
      tile.resize(256);
      v_pairs.resize(4 * 16 * 32);
      out.resize(16 * 64);
    }
    if (static_cast<int64_t>(scores.size()) < 16 * padded) {
      scores.resize(16 * padded);
      p.resize(16 * padded);
    }
  }
};

inline bool consecutive(const int64_t* slots) {
  for (int u = 1; u < 16; ++u)
    if (slots[u] != slots[0] + u) return false;
  return true;
}

template <int kDim, typename C>
inline void prefetch_rows(const C* cache, const int64_t* slots, int64_t from, int64_t to, int64_t row_stride,
                          int64_t offset) {
  for (int64_t u = from; u < to; ++u) prefetch_row<C, kDim>(cache + slots[u] * row_stride + offset);
}

// Elements x..x+31 of a pool row as 32 bf16 (a tile row): a bf16 pool's as they are, an 8-bit pool's widened
// (every e4m3 and e5m2 value is a bf16 value; an int8 row's values are rounded to bf16 by load_row16).
template <int kDim>
inline __m512i load32_bf16(const BFloat16* row, int64_t x) { return _mm512_loadu_si512(row + x); }
template <int kDim, typename C>
inline __m512i load32_bf16(const C* row, int64_t x) {
  return (__m512i)_mm512_cvtne2ps_pbh(load_row16<kDim>(row, x + 16), load_row16<kDim>(row, x));
}
template <int kDim>
inline __m512i load32_bf16(const KvInt8<BFloat16>* row, int64_t x) {  // cvtne2ps rounds as round_bf16 does
  return (__m512i)_mm512_cvtne2ps_pbh(scaled16<kDim>(row, x + 16), scaled16<kDim>(row, x));
}

// One request's `group` heads of KV head `kv_head` against its `len` slots (bf16, kDim 64 or 128), with the
// caller's tile configuration (AmxConfig(group)) loaded.
template <int kDim, typename C = BFloat16>
void attend_amx(const BFloat16* q, int64_t q_head_stride, const C* k_cache, const C* v_cache,
                const int64_t* slots, int64_t len, int64_t kv_heads, int64_t kv_head, int64_t group, float scale,
                BFloat16* out, int64_t out_head_stride, AmxScratch& s) {
  static_assert(kDim == 64 || kDim == 128, "AMX decode attention: head size 64 or 128");
  constexpr int kChunks = kDim / 32;  // 32 dims (one tile row of bf16) per K x Q^T product
  const int64_t row_stride = kv_heads * row_len<C>(kDim), offset = kv_head * row_len<C>(kDim);
  const int64_t padded = (len + 31) / 32 * 32;
  s.fit(padded);
  for (int64_t g = 0; g < group; ++g) {  // qt[chunk][pair][head] = q[head][the pair's two dims]
    const uint32_t* qg = reinterpret_cast<const uint32_t*>(q + g * q_head_stride);
    for (int pair = 0; pair < kDim / 2; ++pair) s.qt[(pair / 16) * 256 + (pair % 16) * 16 + g] = qg[pair];
  }
  prefetch_rows<kDim>(k_cache, slots, 0, std::min<int64_t>(len, 32), row_stride, offset);
  // Scores, 16 slots a tile, transposed to a vector of 16 slots per head, scaled; each head's maximum kept.
  __m512 tops[16];
  for (int64_t g = 0; g < group; ++g) tops[g] = _mm512_set1_ps(-INFINITY);
  float* sc = s.scores.data();
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - j0);
    prefetch_rows<kDim>(k_cache, slots, j0 + 32, std::min(j0 + 48, len), row_stride, offset);  // two blocks on
    const BFloat16* base;
    int64_t stride;
    if (std::is_same_v<C, BFloat16> && n == 16 && consecutive(slots + j0)) {  // the pool's rows as they are
      base = reinterpret_cast<const BFloat16*>(k_cache + slots[j0] * row_stride + offset);  // (a prompt's run)
      stride = row_stride * 2;
    } else {  // gathered (8-bit: widened); past the end, the last slot again (a duplicate changes no maximum)
      for (int u = 0; u < 16; ++u) {
        const C* row = k_cache + slots[j0 + std::min<int64_t>(u, n - 1)] * row_stride + offset;
        for (int x = 0; x < kDim; x += 32) _mm512_storeu_si512(s.k_rows.data() + u * kDim + x, load32_bf16<kDim>(row, x));
      }
      base = s.k_rows.data();
      stride = kDim * 2;
    }
    _tile_zero(7);
    for (int c = 0; c < kChunks; ++c) {
      _tile_loadd(6, base + c * 32, stride);
      _tile_loadd(5, s.qt.data() + c * 256, 64);
      _tile_dpbf16ps(7, 6, 5);
    }
    _tile_stored(7, s.tile.data(), 64);
    __m512 r[16];
    for (int u = 0; u < 16; ++u) r[u] = _mm512_loadu_ps(s.tile.data() + u * 16);
    transpose16(r);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 x = _mm512_mul_ps(r[g], scale16);
      _mm512_storeu_ps(sc + g * padded + j0, x);
      tops[g] = _mm512_max_ps(tops[g], x);
    }
  }
  prefetch_rows<kDim>(v_cache, slots, 0, std::min<int64_t>(len, 16), row_stride, offset);  // during the softmax
  // Softmax as SDPA's CPU kernel does it: exp(s - max) summed in float, rounded to bf16 for the product with
  // V, the sum divided out at the end. The weights go to P's tiles, zeros past the last slot.
  alignas(64) float inv_sums[16];
  BFloat16* p = s.p.data();
  for (int64_t g = 0; g < group; ++g) {
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops[g]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      const __m512 x = _mm512_loadu_ps(sc + g * padded + j0);
      const __m512 e = _mm512_maskz_mov_ps(tail_mask(len - j0), exp16(_mm512_sub_ps(x, top)));
      sum = _mm512_add_ps(sum, e);
      store16(p + (j0 / 32) * 512 + g * 32 + j0 % 32, e);
    }
    inv_sums[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // out = P . V, 64 dims at a time in tiles 0-3. V's rows of slots j and j + 1 interleaved by element: the
  // pairs layout a right-hand operand has (zeros past the end: a zero weight times garbage could be NaN).
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                      6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                      54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  BFloat16* vp = s.v_pairs.data();
  for (int half = 0; half < kDim / 64; ++half) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j0 = 0; j0 < padded; j0 += 32) {
      if (half == 0) prefetch_rows<kDim>(v_cache, slots, j0 + 16, std::min(j0 + 48, len), row_stride, offset);
      for (int pair = 0; pair < 16; ++pair) {
        const int64_t j = j0 + 2 * pair;
        __m512i r0[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, r1[2] = {r0[0], r0[1]};
        if (j < len) {
          const C* v = v_cache + slots[j] * row_stride + offset;
          r0[0] = load32_bf16<kDim>(v, half * 64);
          r0[1] = load32_bf16<kDim>(v, half * 64 + 32);
        }
        if (j + 1 < len) {
          const C* v = v_cache + slots[j + 1] * row_stride + offset;
          r1[0] = load32_bf16<kDim>(v, half * 64);
          r1[1] = load32_bf16<kDim>(v, half * 64 + 32);
        }
        for (int x = 0; x < 2; ++x) {
          _mm512_storeu_si512(vp + (2 * x) * 512 + pair * 32, _mm512_permutex2var_epi16(r0[x], lo, r1[x]));
          _mm512_storeu_si512(vp + (2 * x + 1) * 512 + pair * 32, _mm512_permutex2var_epi16(r0[x], hi, r1[x]));
        }
      }
      _tile_loadd(4, p + (j0 / 32) * 512, 64);
      _tile_loadd(5, vp, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, vp + 512, 64);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, vp + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, vp + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* o = s.out.data();  // (group, 64) floats
    _tile_stored(0, o, 256);
    _tile_stored(1, o + 16, 256);
    _tile_stored(2, o + 32, 256);
    _tile_stored(3, o + 48, 256);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 inv = _mm512_set1_ps(inv_sums[g]);
      BFloat16* og = out + g * out_head_stride + half * 64;
      for (int d = 0; d < 64; d += 16) store16(og + d, _mm512_mul_ps(_mm512_loadu_ps(o + g * 64 + d), inv));
    }
  }
}

}  // namespace mmserve_cpu_ops
#endif
