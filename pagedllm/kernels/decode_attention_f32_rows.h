// The row-level pieces of the float32 decode attention (decode_attention_f32.h), AVX2 + FMA + F16C:
// widening 8 cached K / V values of any cache dtype to float, q.k of 8 keys for one or several
// queries, p.v over a run of value rows, the exponential and the 8-way sums they use.
#pragma once

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {

// e^x for x <= 0 to ~2 float ulps, as exp16 (common.h) with the 2^n built from exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // 2^n stays a normal float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The 8 horizontal sums of a[0..7], in order (21 shuffles and adds instead of 8 reductions of ~6).
inline __m256 sum8(const __m256 a[8]) {
  __m256 x[4], z[2];
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    x[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 2; ++k) {  // per 128-bit lane: that lane's sums of keys 4k .. 4k+3
    const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(x[2 * k]), _mm256_castps_pd(x[2 * k + 1]));
    const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(x[2 * k]), _mm256_castps_pd(x[2 * k + 1]));
    z[k] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(z[0], z[1], 0x20), _mm256_permute2f128_ps(z[0], z[1], 0x31));
}

// Eight K or V values widened to float: the cache holds float32, or bf16 / fp16 (kv_cache_dtype).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// float8 through float16 (F16C): e5m2 is float16's high byte. e4m3's sign, exponent and mantissa
// shifted into float16's places read as the value * 2^-8 (exponent biases 7 and 15; subnormals
// included): load8 returns that, and kLoadScale says so. The kernel scales the scores and the
// probabilities by it instead of every value (exact: a power of two). The cache never holds
// e4m3's NaN (the writer saturates).
template <typename KV>
constexpr float kLoadScale = 1.f;
template <>
constexpr float kLoadScale<at::Float8_e4m3fn> = 256.f;
inline __m128i load8_bytes_as_words(const void* p) {
  return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::Float8_e5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(load8_bytes_as_words(p), 8)); }
inline __m256 load8(const at::Float8_e4m3fn* p) {
  // sign-extended, so after the shift bit 15 is the sign; bit 14 (the sign again) is cleared
  const __m128i w = _mm_slli_epi16(load8_bytes_as_words(p), 7);
  return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16(static_cast<short>(0xBF80))));
}

// int8: widened to int32, then float (the scales are applied per key, KvScales).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Raw scores of query row q against the m <= 8 key rows k (row stride D); lanes >= m are 0. The
// dims loop is outside the keys loop: 8 independent FMA chains (Zen 3: 2 FMAs of latency 4 in flight).
template <int D, bool kFull, typename KV>
inline __m256 qk8(const KV* k, const float* q, int m) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int c = 0; c < D / 8; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      if (kFull || i < m) a[i] = _mm256_fmadd_ps(qc, load8(k + i * D + 8 * c), a[i]);
  }
  return sum8(a);
}

// qk8 for J queries at once (rows q[j]): each key's 8 values are loaded and widened
// once for all J heads instead of once per head (widening fp16 / fp8 / int8 rows, not the FMAs,
// bounded the single-head loop). Per head the same FMAs in the same order as qk8: the same bits.
// J * 8 accumulators: J = 3 needs the 32 vector registers of AVX512VL (kQkHeads).
template <int D, bool kFull, int J, typename KV>
inline void qk8_heads(const KV* k, const float* const* q, int m, __m256 (&out)[J]) {
  __m256 a[J][8];
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[j][i] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int c = 0; c < D / 8; ++c) {
    __m256 qc[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) qc[j] = _mm256_loadu_ps(q[j] + 8 * c);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      if (kFull || i < m) {
        const __m256 x = load8(k + i * D + 8 * c);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) a[j][i] = _mm256_fmadd_ps(qc[j], x, a[j][i]);
      }
  }
#pragma GCC unroll 4
  for (int j = 0; j < J; ++j) out[j] = sum8(a[j]);
}

#if defined(__AVX512VL__)
constexpr int kQkHeads = 3;  // 24 accumulators + 3 query vectors + 1 key vector of 32 registers
#else
constexpr int kQkHeads = 1;  // 16 registers: qk8's 8 accumulators
#endif

// qk8 over int8 rows scaled per group (common.h int8_scale_groups(D) > 1): each group's partial
// dots times its key's scale for it (s: the m keys' scales, row stride the groups per row).
template <int D, bool kFull>
inline __m256 qk8_grouped(const int8_t* k, const float* q, int m, const float* s) {
  constexpr int NG = int8_scale_groups(D), C = D / NG / 8;  // groups per row, 8-value columns per group
  __m256 a[8], p[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int gi = 0; gi < NG; ++gi) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) p[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int c = gi * C; c < (gi + 1) * C; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        if (kFull || i < m) p[i] = _mm256_fmadd_ps(qc, load8(k + i * D + 8 * c), p[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      if (kFull || i < m) a[i] = _mm256_fmadd_ps(p[i], _mm256_set1_ps(s[i * NG + gi]), a[i]);
  }
  return sum8(a);
}

// Rows [from, to) of a run of one kv head (row stride D) asked for ahead of their use: blocks are
// scattered (paging), so the hardware prefetcher stops at each block's end.
template <int D, typename KV>
inline void prefetch_rows(const KV* p, int64_t from, int64_t to) {
  constexpr int64_t kLine = 64 / sizeof(KV);  // elements per cache line
  for (int64_t off = from * D; off < to * D; off += kLine) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// p.v of n rows of V (row stride D, dims c0 .. c0 + 8W of them from v on) for J query heads whose
// probabilities start at p (row stride ps), into acc (row stride D, same dims). The J x W
// accumulators stay in registers for the run.
// Row i of `ahead` (pf rows of it; may be null) is asked for while row i is read.
// int8 scaled per group (NG > 1): vs the n rows' scales (row stride NG), g0 the group of dim c0;
// each group's dims take the probability times the row's scale for that group.
template <int D, int W, int J, typename KV, int NG = 1>
inline void pv_run(const KV* v, int64_t n, const float* p, int64_t ps, float* acc, const KV* ahead, int64_t pf,
                   const float* vs = nullptr, int g0 = 0) {
  constexpr int PerGroup = NG > 1 ? D / NG / 8 : W;  // accumulators (8 dims each) per scale group
  __m256 a[J][W];
  for (int j = 0; j < J; ++j)
    for (int w = 0; w < W; ++w) a[j][w] = _mm256_loadu_ps(acc + j * D + 8 * w);
  for (int64_t i = 0; i < n; ++i) {
    if (ahead != nullptr && i < pf) prefetch_rows<D>(ahead, i, i + 1);
    __m256 pj[J];
    if constexpr (NG == 1)
      for (int j = 0; j < J; ++j) pj[j] = _mm256_broadcast_ss(p + j * ps + i);
    for (int w = 0; w < W; ++w) {
      if constexpr (NG > 1)
        if (w % PerGroup == 0) {
          const float sv = vs[i * NG + g0 + w / PerGroup];
          for (int j = 0; j < J; ++j) pj[j] = _mm256_set1_ps(p[j * ps + i] * sv);
        }
      const __m256 x = load8(v + i * D + 8 * w);
      for (int j = 0; j < J; ++j) a[j][w] = _mm256_fmadd_ps(pj[j], x, a[j][w]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + j * D + 8 * w, a[j][w]);
}

}  // namespace
#endif
