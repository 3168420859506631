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

// One activation row -> blocks of kBlock (32, or 16 for the fine scales of quant_interleaved.h)
// integers in [-kMax, kMax] with one float scale each: d = amax / kMax, q = round(x / d);
// on_block(b, sum(q)) per block (what additive weight offsets multiply; a format without offsets
// passes a no-op).
template <class Q, int kMax, class OnBlock, int kBlock = 32>
inline void quantize_row(const float* x, int64_t K, Q* q, float* d, OnBlock on_block) {
  for (int64_t b = 0; b < K / kBlock; ++b, x += kBlock, q += kBlock) {
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax != 0.f ? static_cast<float>(kMax) / amax : 0.f;
    d[b] = amax / static_cast<float>(kMax);
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * id));
      q[i] = static_cast<Q>(v);
      sum += v;
    }
    on_block(b, sum);
  }
}

// int16 blocks (quant_gemm.cpp): ds = d * sum(q).
inline void quantize_row_q16(const float* x, int64_t K, int16_t* q, float* d, float* ds) {
  quantize_row<int16_t, 32767>(x, K, q, d, [&](int64_t b, int32_t s) { ds[b] = d[b] * static_cast<float>(s); });
}
