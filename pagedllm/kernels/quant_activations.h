// Activation rows quantized on the fly for the GGUF kernels (quant_gemm.cpp,
// quant_gemm_interleaved.cpp), and the fp16 scales of the weight blocks.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // F16C's _cvtsh_ss may be there without AVX2
#endif

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// One activation row -> int16 blocks of 32: d = amax / 32767, q = round(x / d); ds = d * sum(q)
// (what the weights' additive offsets multiply).
inline void quantize_row_q16(const float* x, int64_t K, int16_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax != 0.f ? 32767.f / amax : 0.f;
    d[b] = amax / 32767.f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * id));
      q[i] = static_cast<int16_t>(v);
      sum += v;
    }
    ds[b] = d[b] * static_cast<float>(sum);
  }
}

// One activation row -> int8 blocks of 32: d = amax / 127, q = round(x / d), s = sum(q).
inline void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * id));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    s[b] = sum;
  }
}

