// The KV cache's row stores of rope_and_cache_write (layer_ops.cpp): one head's values into a
// cache row, in the cache's element type (kv_cache_dtype), as the reference's write_kv_cache.
#pragma once

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One head's D values into a cache row: copied where the cache has the activations' element,
// else rounded to nearest even as torch's .to() rounds (the reference path's write_kv_cache).
inline void store_row(uint16_t* dst, const uint16_t* src, int64_t D) { std::memcpy(dst, src, D * sizeof(uint16_t)); }
inline void store_row(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void store_row(at::BFloat16* dst, const float* src, int64_t D) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) d[i] = float_to_bf16_bits(src[i]);
}
// float16 / float8 saturate at their largest finite value rather than store an infinity (as the
// reference's to_cache_dtype); c10's conversions round to nearest even, as torch's .to().
template <typename C>
inline void store_saturated(C* dst, const float* src, int64_t D, float limit) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<C>(std::min(limit, std::max(-limit, src[i])));
}
inline void store_row(at::Half* dst, const float* src, int64_t D) { store_saturated(dst, src, D, 65504.f); }
inline void store_row(at::Float8_e4m3fn* dst, const float* src, int64_t D) { store_saturated(dst, src, D, 448.f); }
inline void store_row(at::Float8_e5m2* dst, const float* src, int64_t D) { store_saturated(dst, src, D, 57344.f); }
// int8 (pagedllm/attention/int8_kv.py), per group of n values: scale = max|x| / 127 over the group
// (0 where that is not a normal float),
// q = x / scale rounded to nearest even, clamped to +-127. Without -ffast-math, which may turn
// x / scale into x * (1 / scale): the reference's divisions and rounding, so its bits (noinline:
// the attribute holds for this function's own code only). Vectorized by hand, 8 lanes (AVX2; a
// head's 32 / 64 values are 4 / 8 steps, and AVX512 builds run the same code): under that
// attribute the compiler neither vectorizes the loops nor inlines std::max (called per value, it
// cost as much as the rest of the store). Each lane does what the scalar tail does: a NaN is
// skipped by the maximum (max_ps returns its second operand, the running maximum) and stored as
// -127 (max_ps(NaN, -127) is -127), as std::max / std::min order them below.
__attribute__((noinline, optimize("no-fast-math"))) void store_row_int8(int8_t* dst, float* scale, const float* src,
                                                                        int64_t n) {
  int64_t i = 0;
  float amax = 0.f;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m8 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)), m8);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  amax = _mm_cvtss_f32(m4);
#endif
  for (; i < n; ++i) {
    const float a = __builtin_fabsf(src[i]);
    amax = amax < a ? a : amax;
  }
  float sc = amax / 127.f;
  if (!(sc >= std::numeric_limits<float>::min())) sc = 0.f;
  *scale = sc;
  if (sc == 0.f) {
    std::memset(dst, 0, n);
    return;
  }
  i = 0;
#if defined(__AVX2__)
  const __m256 s8 = _mm256_set1_ps(sc), lo8 = _mm256_set1_ps(-127.f), hi8 = _mm256_set1_ps(127.f);
  for (; i + 8 <= n; i += 8) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + i), s8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo8), hi8));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
  }
#endif
  for (; i < n; ++i) {
    float q = std::nearbyint(src[i] / sc);
    q = -127.f < q ? q : -127.f;  // std::max(-127.f, q)
    q = q < 127.f ? q : 127.f;    // std::min(127.f, q)
    dst[i] = static_cast<int8_t>(q);
  }
}
// A row of D values as int8_scale_groups(D) groups, each with its scale (scales[0 .. groups)).
inline void store_row_int8_groups(int8_t* dst, float* scales, const float* src, int64_t D) {
  const int64_t groups = int8_scale_groups(D), n = D / groups;
  for (int64_t g = 0; g < groups; ++g) store_row_int8(dst + g * n, scales + g, src + g * n, n);
}

}  // namespace
