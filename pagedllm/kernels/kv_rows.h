// The KV cache's row stores of rope_and_cache_write (layer_ops.cpp): one head's values into a
// cache row, in the cache's element type (kv_cache_dtype), as the reference's write_kv_cache.
#pragma once

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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
// the attribute holds for this function's own code only).
__attribute__((noinline, optimize("no-fast-math"))) void store_row_int8(int8_t* dst, float* scale, const float* src,
                                                                        int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
  float sc = amax / 127.f;
  if (!(sc >= std::numeric_limits<float>::min())) sc = 0.f;
  *scale = sc;
  if (sc == 0.f) {
    std::memset(dst, 0, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(src[i] / sc))));
}
// A row of D values as int8_scale_groups(D) groups, each with its scale (scales[0 .. groups)).
inline void store_row_int8_groups(int8_t* dst, float* scales, const float* src, int64_t D) {
  const int64_t groups = int8_scale_groups(D), n = D / groups;
  for (int64_t g = 0; g < groups; ++g) store_row_int8(dst + g * n, scales + g, src + g * n, n);
}

}  // namespace
