// The registers a group kernel (quant_gemm_interleaved.cpp, quant_gemm_q4k_q5k.cpp,
// quant_gemm_q6k.cpp) works in: one group's eight weight rows in the eight 32-bit lanes of a
// 256-bit register (Lanes8), or two adjacent groups' sixteen rows in a 512-bit one (Lanes16,
// AVX512-VNNI).
//
// At 2-11 activation rows (a speculative verifying pass of k + 1 rows, small batches) the group
// kernels are bound by instructions, not memory: per activation row and four weight bytes of a
// lane, one broadcast and one vpdpbusd. With two groups in one register each broadcast and
// vpdpbusd serves sixteen outputs, not eight (the weights of both groups unpacked once, as for
// one). Every lane runs the same integer and float operations in the same order in either width,
// so an output does not depend on which ran (nor on the pairing, which follows the thread split).
//
// A kernel written once against these names: V::load(p, stride) reads 32 bytes at p (Lanes16:
// and 32 at p + stride, the next group's same bytes, into the upper half), and so on.
#pragma once

#include "quant_interleaved.h"

// The kernels' files keep their own float options (PAGEDLLM_EXACT_FLOAT_BEGIN), and gcc does not
// inline a function of other options unless told: these are one instruction each.
#define PAGEDLLM_LANE __attribute__((always_inline))

namespace {
namespace ilv {

#if PAGEDLLM_X8_AVX2
struct Lanes8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t kGroups = 1;
  // the weight stream's bytes ahead of a block of kBytes (quant_interleaved.h)
  template <int64_t kBytes>
  PAGEDLLM_LANE static void prefetch(const uint8_t* p, int64_t) {
    prefetch_ahead<kBytes>(p);
  }
  PAGEDLLM_LANE static I load(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // eight fp16 at p -> float lanes
  PAGEDLLM_LANE static F halves(const uint8_t* p, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // eight unsigned bytes at p -> float lanes
  PAGEDLLM_LANE static F bytes_to_float(const uint8_t* p, int64_t) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // eight signed bytes at p -> int32 lanes
  PAGEDLLM_LANE static I signed_bytes(const uint8_t* p, int64_t) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // sixteen signed bytes at p -> int16 lanes (two per 32-bit lane)
  PAGEDLLM_LANE static I bytes_to_i16(const uint8_t* p, int64_t) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  PAGEDLLM_LANE static I zero() { return _mm256_setzero_si256(); }
  PAGEDLLM_LANE static F zerof() { return _mm256_setzero_ps(); }
  PAGEDLLM_LANE static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  PAGEDLLM_LANE static F set1f(float v) { return _mm256_set1_ps(v); }
  PAGEDLLM_LANE static I bytes(uint8_t v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  PAGEDLLM_LANE static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  PAGEDLLM_LANE static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  PAGEDLLM_LANE static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  PAGEDLLM_LANE static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  PAGEDLLM_LANE static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  PAGEDLLM_LANE static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  PAGEDLLM_LANE static I mullo32(I a, I b) { return _mm256_mullo_epi32(a, b); }
#if PAGEDLLM_X8_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  PAGEDLLM_LANE static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
  PAGEDLLM_LANE static I dpwssd(I acc, I a, I b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif PAGEDLLM_X8_VNNI  // AVX-VNNI: the same instructions, VEX-encoded
  PAGEDLLM_LANE static I dpbusd(I acc, I u8, I s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
  PAGEDLLM_LANE static I dpwssd(I acc, I a, I b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif
  PAGEDLLM_LANE static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  PAGEDLLM_LANE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  PAGEDLLM_LANE static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  PAGEDLLM_LANE static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  PAGEDLLM_LANE static void store(float* y, F v) { _mm256_storeu_ps(y, v); }
};
#else
struct Lanes8 {
  static constexpr int64_t kGroups = 1;
};
#endif

#if PAGEDLLM_X16_VNNI
struct Lanes16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t kGroups = 2;
  template <int64_t kBytes>
  PAGEDLLM_LANE static void prefetch(const uint8_t* p, int64_t stride) {
    prefetch_ahead<kBytes>(p);
    prefetch_ahead<kBytes>(p + stride);
  }
  PAGEDLLM_LANE static I load(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Lanes8::load(p, 0)), Lanes8::load(p + stride, 0), 1);
  }
  PAGEDLLM_LANE static F halves(const uint8_t* p, int64_t stride) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
  }
  PAGEDLLM_LANE static F bytes_to_float(const uint8_t* p, int64_t stride) {
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, b)));
  }
  PAGEDLLM_LANE static I signed_bytes(const uint8_t* p, int64_t stride) {
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a, b));
  }
  PAGEDLLM_LANE static I bytes_to_i16(const uint8_t* p, int64_t stride) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
  }
  PAGEDLLM_LANE static I zero() { return _mm512_setzero_si512(); }
  PAGEDLLM_LANE static F zerof() { return _mm512_setzero_ps(); }
  PAGEDLLM_LANE static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  PAGEDLLM_LANE static F set1f(float v) { return _mm512_set1_ps(v); }
  PAGEDLLM_LANE static I bytes(uint8_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  PAGEDLLM_LANE static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  PAGEDLLM_LANE static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  PAGEDLLM_LANE static I srli16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  PAGEDLLM_LANE static I slli16(I a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
  PAGEDLLM_LANE static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  PAGEDLLM_LANE static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  PAGEDLLM_LANE static I mullo32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  PAGEDLLM_LANE static I dpbusd(I acc, I u8, I s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
  PAGEDLLM_LANE static I dpwssd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  PAGEDLLM_LANE static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  PAGEDLLM_LANE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  PAGEDLLM_LANE static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  PAGEDLLM_LANE static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  PAGEDLLM_LANE static void store(float* y, F v) { _mm512_storeu_ps(y, v); }
};
#endif

// Every activation row times groups [g0, g1) of eight-row groups: kTile groups at a time stay in
// cache while the activation rows pass, four rows per kernel call, then the last one to three
// (five or six: all at once, unless kMaxRows is 4);
// with kPairs, from two rows (and AVX512-VNNI) two groups per call. kernel(lanes, std::integral_constant<int, MR>,
// group, m0, out): lanes.kGroups groups (from `group`, group_bytes apart) x MR activation rows
// into out (their 8 or 16 columns of y).
template <bool kPairs, int kMaxRows = 6, class GroupKernel>
void for_each_group_tile(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, int64_t M, float* y,
                         GroupKernel kernel) {
  constexpr int64_t kTile = 4;
  // Not at one row: there a step streams weights from memory, and with two groups a thread reads
  // two streams at once; an 8B-shape decode step took 1.1-1.2x as long paired (Q4_0, Q4_K_M,
  // alternating runs on 2 Zen 5 cores).
  const bool pair_groups = M > 1;
  for (int64_t t0 = g0; t0 < g1; t0 += kTile) {
    const int64_t t1 = std::min(g1, t0 + kTile);
    auto tile = [&](auto mr, int64_t m) {
      int64_t g = t0;
#if PAGEDLLM_X16_VNNI
      if constexpr (kPairs)
        for (; pair_groups && g + 2 <= t1; g += 2) kernel(Lanes16{}, mr, w + g * group_bytes, m, y + g * kRows);
#endif
      for (; g < t1; ++g) kernel(Lanes8{}, mr, w + g * group_bytes, m, y + g * kRows);
    };
    // Five or six rows (a speculative verifying pass of k = 4 or 5 drafts) in one call: the
    // weights are unpacked once, not for four rows and again for the rest.
    if constexpr (kMaxRows >= 6) {
      if (M == 5 || M == 6) {
        M == 5 ? tile(std::integral_constant<int, 5>{}, 0) : tile(std::integral_constant<int, 6>{}, 0);
        continue;
      }
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
    switch (M - m) {
      case 3: tile(std::integral_constant<int, 3>{}, m); break;
      case 2: tile(std::integral_constant<int, 2>{}, m); break;
      case 1: tile(std::integral_constant<int, 1>{}, m); break;
      default: break;
    }
  }
}

}  // namespace ilv
}  // namespace
