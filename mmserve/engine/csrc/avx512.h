// AVX-512 helpers of the decode attention kernels (decode_attention.cpp, decode_attention_amx.h): loads and
// stores of 16 lanes in either element type, row prefetches, a 16 x 16 transpose, exp and bf16 rounding.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <type_traits>

#include "cpu_common.h"

namespace mmserve_cpu_ops {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {  // bf16 is the high half of a float: widen and shift
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// The lanes of a vector that hold the `left` elements still to go (none if left <= 0): a row's tail.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}
inline __m512 load16(const BFloat16* p, __mmask16 m) {  // the lanes of m (a row's tail), zeros past them
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
// 16 e4m3 codes (one per 32-bit lane) as floats, exactly, in integer steps: exponent and mantissa moved into a
// float's fields with the bias difference (120) added, which is the value 2^(e-7) (1 + m/8) of a normal code; a
// subnormal code (e = 0) gets exponent 1's instead, 2^-6 (1 + m/8), and subtracting 2^-6 leaves its value
// 2^-6 m/8. (Scaling the bits by 2^120 in float instead made float subnormals of every code below 2^-6: 4x
// slower attention on one CPU.)
inline __m512 e4m3_to_ps(__m512i u) {
  const __m512i body = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), 20);
  const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x78));  // exponent bits all zero
  const __m512i biased = _mm512_add_epi32(body, _mm512_set1_epi32(120 << 23));
  const __m512 v = _mm512_castsi512_ps(_mm512_mask_add_epi32(biased, sub, biased, _mm512_set1_epi32(1 << 23)));
  const __m512 mag = _mm512_mask_sub_ps(v, sub, v, _mm512_set1_ps(0x1p-6f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}
// fp8 KV rows: e4m3 as above; e5m2 is the high byte of an fp16.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  return e4m3_to_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(u, 8));
}


// Asks for one head's row (kDim elements) in L1 ahead of its use. The pool is far larger than the caches and a
// request's rows are scattered (its decode tokens' slots interleave with other requests'), so each row read
// waited on DRAM: the kernel ran at a third of the bandwidth a plain read of the same rows reaches.
template <typename T, int kDim>
inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  const int bytes = static_cast<int>(row_len<T>(kDim) * sizeof(T));  // an int8 row's scale included
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
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

// fast_exp (cpu_common.h) on 16 lanes, the same operations in the same order.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Each lane rounded to bf16 (to nearest, ties to even: c10's BFloat16 for finite values), as a float.
inline __m512 round_bf16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// x rounded to bf16 (round_bf16) in the 16 bf16 of a 256-bit vector.
inline __m256i to_bf16(__m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16));
}
inline void store16(BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }

// Dims d0..d0+15 of a pool row (the row of one token and one KV head) as floats: load16 of the element type,
// or an int8 row's codes times its scale, rounded to the model dtype T as widen_row does.
template <int kDim, typename C>
inline __m512 load_row16(const C* row, int64_t d0) {
  return load16(row + d0);
}
// An int8 row's code x scale in float, before any rounding to T (the AMX path's conversion to bf16 rounds).
template <int kDim, typename T>
inline __m512 scaled16(const KvInt8<T>* row, int64_t d0) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d0));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(row_scale(row, kDim)));
}
template <int kDim, typename T>
inline __m512 load_row16(const KvInt8<T>* row, int64_t d0) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return round_bf16(scaled16<kDim>(row, d0));
  } else {
    return scaled16<kDim>(row, d0);
  }
}

}  // namespace mmserve_cpu_ops
#endif
