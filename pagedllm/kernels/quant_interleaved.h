// What the kernels of weights repacked eight rows at a time share (quant_gemm_interleaved.cpp:
// Q4_0 / Q4_1 / Q8_0; quant_gemm_q4k.cpp: Q4_K): the activation rows quantized once per call,
// broadcasts of activation bytes to every row lane, and the weight-stream prefetch.
#pragma once

#include "common.h"
#include "quant_activations.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_X8_AVX2 1
#else
#define PAGEDLLM_X8_AVX2 0
#endif
// AVX512-VNNI on 256-bit registers (vpdpbusd: four u8 x s8 products summed into each int32 lane,
// no 16-bit intermediate): Zen 4 / 5, Ice Lake and later Intel.
#if PAGEDLLM_X8_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDLLM_X8_VNNI 1
#else
#define PAGEDLLM_X8_VNNI 0
#endif

namespace {
namespace ilv {

constexpr int64_t kRows = 8;  // weight rows per group: the lanes of a 256-bit register

// Quantized activation rows of a call: q [M, K] (int8 for Q4_x, int16 for Q8_0), d [M, nb] and,
// for int8, s = sum(q) [M, nb].
template <class Q>
struct Activations {
  const Q* q;
  const float* d;
  const int32_t* s;
  int64_t K, nb;
};
using Activations8 = Activations<int8_t>;
using Activations16 = Activations<int16_t>;

template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// The call's activation rows, quantized once and shared by every thread (scratch kept per thread
// between calls); with_sums: also s = sum(q) per block (Q4_0's - 8 and Q4_1's min need it).
template <class Q, int kMax>
Activations<Q> quantize_activations(const float* x, int64_t M, int64_t K, bool with_sums) {
  const int64_t nb = K / 32;
  static thread_local std::vector<Q> q;
  static thread_local std::vector<float> d;
  static thread_local std::vector<int32_t> s;
  grow(q, M * K);
  grow(d, M * nb);
  if (with_sums) grow(s, M * nb);
  Q* qp = q.data();
  float* dp = d.data();
  int32_t* sp = with_sums ? s.data() : nullptr;
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row<Q, kMax>(x + m * K, K, qp + m * K, dp + m * nb, [&](int64_t blk, int32_t sum) {
        if (sp != nullptr) sp[m * nb + blk] = sum;
      });
  });
  return {qp, dp, sp, K, nb};
}

#if PAGEDLLM_X8_AVX2
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Asks for the weight bytes kPrefetchDistance ahead of a block of kBytes (every cache line they
// span). The weights are read once per call and nothing else hides the memory latency: at one
// activation row the hardware prefetcher alone streamed a decode step's weights at ~14 GB/s,
// with this ~18 (alternating runs). A prefetch past the end of the weights is harmless.
constexpr int64_t kPrefetchDistance = 1024;

template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* block) {
  const char* p = reinterpret_cast<const char*>(block) + kPrefetchDistance;
  for (int64_t o = 0; o < kBytes + 63; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
#endif

}  // namespace ilv
}  // namespace
