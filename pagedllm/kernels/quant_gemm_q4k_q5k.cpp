// y = x @ W^T for Q4_K and Q5_K weights repacked eight rows at a time (the Q4_K_M files users
// download hold most of their weights in Q4_K; Q5_K_M files theirs in Q5_K).
//
// The row-at-a-time K-quant path (quant_gemm.cpp) decodes 16 rows to int16 and multiplies int16
// activations: several times the work of the interleaved Q4_0 kernel per weight. A Q4_K
// sub-block of 32 values is a Q4_1 block in all but its scales: value = d * sc * q - dmin * m,
// q in 0..15, sc and m 6-bit integers of the super-block of 256. Q5_K is the same with a fifth
// bit per value (q in 0..31), as Q5_1 is Q4_1's. So this kernel is the interleaved Q4_1 / Q5_1
// kernel (quant_gemm_interleaved.cpp) over sub-blocks, int8 activation blocks of 32 (d_x =
// amax / 127, the same activations as Q4_0 / Q4_1), each sub-block's scale and min read from
// bytes unpacked once at load:
//     i = sum(q_w * q_x)                                  (exact integers)
//     acc = fma(float(i), (d * sc) * d_x, acc)
//     acc = fma(-(dmin * m), d_x * float(sum(q_x)), acc)
// in this order whatever the number of activation rows, so an output is bit-identical whether
// its activation row comes alone or with 300 others.
//
// Layout of one group of eight rows, per super-block (Q4_K 1184 bytes: the file's 8 x 144, plus
// the 6-bit scales unpacked to bytes; Q5_K 1440: 8 x 176 plus the same):
//     [d of rows 0..7 (fp16)] [dmin (fp16) x 8] [sc: sub-block j, row r at 8j + r] [m: the same]
//     [qs: chunk c (0..3) of 64 values, run u (0..7): rows 0..7 x qs bytes 32c + 4u .. 32c + 4u + 3]
//     [Q5_K: qh: run u: rows 0..7 x qh bytes 4u .. 4u + 3]
// A qs byte 32c + i holds value 64c + i (low nibble, sub-block 2c) and 64c + 32 + i (high
// nibble, sub-block 2c + 1): run u meets activation bytes 64c + 4u.. (low) and 64c + 32 + 4u..
// (high), broadcast to every lane. Q5_K's qh byte i holds the fifth bits of values 64c + i (bit
// 2c) and 64c + 32 + i (bit 2c + 1) for c = 0..3: one run of qh serves every chunk.
#include "entry_points.h"
#include "quant_interleaved.h"
#include "quant_lanes.h"
#include "quant_panels.h"

#include <cmath>
#include <cstring>

PAGEDLLM_EXACT_FLOAT_BEGIN

namespace {
namespace q45k {

using ilv::Activations8;
using ilv::kRows;

constexpr int64_t kSuper = 256;             // values per super-block
constexpr int64_t kScales = 2 * 2 * kRows;  // offset of sc in a group's super-block
constexpr int64_t kMins = kScales + 8 * kRows, kQs = kMins + 8 * kRows;
constexpr int64_t kQh = kQs + 128 * kRows;  // Q5_K's fifth bits

// Q4_K (kFive false) or Q5_K: the file's block and the group's super-block.
template <bool kFive>
struct Format {
  static constexpr int64_t kFileBytes = kFive ? 176 : 144;
  static constexpr int64_t kFileQh = 16, kFileQs = kFive ? 48 : 16;  // ggml: d, dmin, scales[12], (qh[32]), qs[128]
  static constexpr int64_t kGroupBytes = kQh + (kFive ? 32 * kRows : 0);  // 1440 / 1184
  static constexpr const char* kName = kFive ? "Q5_K" : "Q4_K";
};

// llama.cpp's get_scale_min_k4: 6-bit scale and min of sub-block j from a super-block's 12 bytes.
inline void scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 12 bytes of 8 scales and 8 mins (scale_min's inverse).
inline void pack_scale_min(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
}

// Row r (of eight) of a group: GGUF super-block `file` -> the group's super-block, or back.
template <bool kFive>
void to_group(const uint8_t* file, int64_t r, uint8_t* g) {
  using F = Format<kFive>;
  std::memcpy(g + 2 * r, file, 2);
  std::memcpy(g + 16 + 2 * r, file + 2, 2);
  for (int j = 0; j < 8; ++j) scale_min(file + 4, j, g + kScales + 8 * j + r, g + kMins + 8 * j + r);
  for (int c = 0; c < 4; ++c)
    for (int u = 0; u < 8; ++u) std::memcpy(g + kQs + 256 * c + 32 * u + 4 * r, file + F::kFileQs + 32 * c + 4 * u, 4);
  if (kFive)
    for (int u = 0; u < 8; ++u) std::memcpy(g + kQh + 32 * u + 4 * r, file + F::kFileQh + 4 * u, 4);
}

template <bool kFive>
void from_group(const uint8_t* g, int64_t r, uint8_t* file) {
  using F = Format<kFive>;
  std::memcpy(file, g + 2 * r, 2);
  std::memcpy(file + 2, g + 16 + 2 * r, 2);
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) sc[j] = g[kScales + 8 * j + r], m[j] = g[kMins + 8 * j + r];
  pack_scale_min(sc, m, file + 4);
  for (int c = 0; c < 4; ++c)
    for (int u = 0; u < 8; ++u) std::memcpy(file + F::kFileQs + 32 * c + 4 * u, g + kQs + 256 * c + 32 * u + 4 * r, 4);
  if (kFive)
    for (int u = 0; u < 8; ++u) std::memcpy(file + F::kFileQh + 4 * u, g + kQh + 32 * u + 4 * r, 4);
}

#if PAGEDLLM_X8_AVX2
// The eight rows' (d * sc) or (dmin * m) of sub-block j, one lane each (V: of each group).
template <class V = ilv::Lanes8>
inline typename V::F sub_scales(typename V::F d, const uint8_t* bytes, int64_t group_bytes = 0) {
  return V::mul(d, V::bytes_to_float(bytes, group_bytes));
}

// Bit `bit` of every byte of qh moved to 0x10: a Q5_K value's fifth bit. (A 16-bit shift by at
// most four keeps bit 4 of each byte within that byte.)
template <class V>
inline typename V::I fifth_bits(typename V::I qh, int bit) {
  const typename V::I shifted = bit <= 4 ? V::slli16(qh, 4 - bit) : V::srli16(qh, bit - 4);
  return V::and_(shifted, V::bytes(0x10));
}

// V::kGroups groups (quant_lanes.h) x activation rows m0 .. m0 + MR - 1 -> y[:, 0:8 * kGroups].
template <bool kFive, class V, int MR>
inline void group_kernel(const uint8_t* group, int64_t group_bytes, const Activations8& a, int64_t m0, float* y,
                         int64_t ldy) {
  using I = typename V::I;
  constexpr int64_t kGroupBytes = Format<kFive>::kGroupBytes;
  const I low4 = V::bytes(0x0F);
#if !PAGEDLLM_X8_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  typename V::F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zerof();
  for (int64_t s = 0; s < a.K / kSuper; ++s) {
    const uint8_t* blk = group + s * kGroupBytes;
    V::template prefetch<kGroupBytes>(blk, group_bytes);
    const typename V::F d = V::halves(blk, group_bytes), dmin = V::halves(blk + 16, group_bytes);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      I lo_sum[MR], hi_sum[MR];
      for (int m = 0; m < MR; ++m) lo_sum[m] = hi_sum[m] = V::zero();
#if !PAGEDLLM_X8_VNNI
      I lo_wide[MR], hi_wide[MR];  // Q5_K: the first four runs' int16 sums, widened
#endif
      const uint8_t* qs = blk + kQs + 256 * c;
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const I w = V::load(qs + 32 * u, group_bytes);
        I lo = V::and_(w, low4), hi = V::and_(V::srli16(w, 4), low4);
        if constexpr (kFive) {
          const I qh = V::load(blk + kQh + 32 * u, group_bytes);
          lo = V::or_(lo, fifth_bits<V>(qh, 2 * c));
          hi = V::or_(hi, fifth_bits<V>(qh, 2 * c + 1));
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* xb = a.q + (m0 + m) * a.K + kSuper * s + 64 * c + 4 * u;
#if PAGEDLLM_X8_VNNI
          lo_sum[m] = V::dpbusd(lo_sum[m], lo, V::set1(ilv::load4(xb)));
          hi_sum[m] = V::dpbusd(hi_sum[m], hi, V::set1(ilv::load4(xb + 32)));
#else
          // Q4_K: <= 2 * 15 * 127 per product pair, eight runs: 30480 < 2^15. Q5_K: 2 * 31 * 127,
          // four runs: 31496 < 2^15, then widened.
          lo_sum[m] = _mm256_add_epi16(lo_sum[m], _mm256_maddubs_epi16(lo, ilv::broadcast4(xb)));
          hi_sum[m] = _mm256_add_epi16(hi_sum[m], _mm256_maddubs_epi16(hi, ilv::broadcast4(xb + 32)));
          if constexpr (kFive) {
            if (u == 3) {
              lo_wide[m] = _mm256_madd_epi16(lo_sum[m], ones);
              hi_wide[m] = _mm256_madd_epi16(hi_sum[m], ones);
              lo_sum[m] = hi_sum[m] = V::zero();
            }
          }
#endif
        }
      }
      const uint8_t* sc = blk + kScales + 8 * (2 * c);
      const uint8_t* mn = blk + kMins + 8 * (2 * c);
      const typename V::F sc_lo = sub_scales<V>(d, sc, group_bytes), sc_hi = sub_scales<V>(d, sc + 8, group_bytes);
      const typename V::F m_lo = sub_scales<V>(dmin, mn, group_bytes), m_hi = sub_scales<V>(dmin, mn + 8, group_bytes);
      for (int m = 0; m < MR; ++m) {
#if !PAGEDLLM_X8_VNNI
        lo_sum[m] = _mm256_madd_epi16(lo_sum[m], ones);
        hi_sum[m] = _mm256_madd_epi16(hi_sum[m], ones);
        if constexpr (kFive) {
          lo_sum[m] = _mm256_add_epi32(lo_sum[m], lo_wide[m]);
          hi_sum[m] = _mm256_add_epi32(hi_sum[m], hi_wide[m]);
        }
#endif
        const int64_t at = (m0 + m) * a.nb + s * 8 + 2 * c;  // the activation block of sub-block 2c
        const float dx_lo = a.d[at], dx_hi = a.d[at + 1];
        acc[m] = V::fmadd(V::cvt(lo_sum[m]), V::mul(sc_lo, V::set1f(dx_lo)), acc[m]);
        acc[m] = V::fnmadd(m_lo, V::set1f(dx_lo * static_cast<float>(a.s[at])), acc[m]);
        acc[m] = V::fmadd(V::cvt(hi_sum[m]), V::mul(sc_hi, V::set1f(dx_hi)), acc[m]);
        acc[m] = V::fnmadd(m_hi, V::set1f(dx_hi * static_cast<float>(a.s[at + 1])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) V::store(y + (m0 + m) * ldy, acc[m]);
}
#else
// Portable: the same integers and the same float operations, one lane at a time.
template <bool kFive, class V, int MR>
inline void group_kernel(const uint8_t* group, int64_t, const Activations8& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t kGroupBytes = Format<kFive>::kGroupBytes;
  for (int m = 0; m < MR; ++m) {
    float acc[kRows] = {};
    for (int64_t s = 0; s < a.K / kSuper; ++s) {
      const uint8_t* blk = group + s * kGroupBytes;
      for (int c = 0; c < 4; ++c) {
        const int64_t at = (m0 + m) * a.nb + s * 8 + 2 * c;
        const int8_t* xb = a.q + (m0 + m) * a.K + kSuper * s + 64 * c;
        for (int64_t r = 0; r < kRows; ++r) {
          int32_t lo = 0, hi = 0;
          for (int u = 0; u < 8; ++u)
            for (int j = 0; j < 4; ++j) {
              const uint8_t v = blk[kQs + 256 * c + 32 * u + 4 * r + j];
              const int h = kFive ? blk[kQh + 32 * u + 4 * r + j] >> (2 * c) : 0;
              lo += ((v & 0xF) | ((h & 1) << 4)) * xb[4 * u + j];
              hi += ((v >> 4) | ((h & 2) << 3)) * xb[32 + 4 * u + j];
            }
          const float d = h2f(blk + 2 * r), dmin = h2f(blk + 16 + 2 * r);
          for (int h = 0; h < 2; ++h) {
            const int sub = 2 * c + h;
            const float sc = d * static_cast<float>(blk[kScales + 8 * sub + r]);
            const float mn = dmin * static_cast<float>(blk[kMins + 8 * sub + r]);
            const float dx = a.d[at + h];
            acc[r] = std::fma(static_cast<float>(h ? hi : lo), sc * dx, acc[r]);
            acc[r] = std::fma(-mn, dx * static_cast<float>(a.s[at + h]), acc[r]);
          }
        }
      }
    }
    std::memcpy(y + (m0 + m) * ldy, acc, sizeof(acc));
  }
}
#endif

#if PAGEDLLM_X16_VNNI
// Many activation rows (quant_panels.h). A group decoded once to bytes: k-group 64s + 16c + u of
// the low nibbles, 64s + 16c + 8 + u of the high ones (Q5_K: their fifth bits added), and each
// sub-block's (d * sc) and (dmin * m) per row as floats.
template <bool kFive>
inline void decode_group(const uint8_t* group, int64_t K, uint8_t* wq, float* scales) {
  constexpr int64_t kGroupBytes = Format<kFive>::kGroupBytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / kSuper; ++s) {
    const uint8_t* blk = group + s * kGroupBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int j = 0; j < 8; ++j) {
      float* sj = scales + (8 * s + j) * 2 * kRows;  // [sub-block][sc, m][8 rows]
      _mm256_storeu_ps(sj, sub_scales(d, blk + kScales + 8 * j));
      _mm256_storeu_ps(sj + kRows, sub_scales(dmin, blk + kMins + 8 * j));
    }
    for (int c = 0; c < 4; ++c)
      for (int u = 0; u < 8; ++u) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQs + 256 * c + 32 * u));
        __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        if constexpr (kFive) {
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQh + 32 * u));
          lo = _mm256_or_si256(lo, fifth_bits<ilv::Lanes8>(qh, 2 * c));
          hi = _mm256_or_si256(hi, fifth_bits<ilv::Lanes8>(qh, 2 * c + 1));
        }
        uint8_t* out = wq + (64 * s + 16 * c + u) * 4 * kRows;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * 4 * kRows), hi);
      }
  }
}

// One decoded group x panel p -> y's eight columns, group_kernel's float operations per sub-block.
inline void panel_times_group(const panels::Panels& x, int64_t p, const uint8_t* wq, const float* scales, int64_t M,
                              float* y, int64_t ldy) {
  const int8_t* xq = x.q + p * panels::kPanel * x.K;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < x.K / 32; ++j) {
    __m512i dot[kRows];
    for (int r = 0; r < kRows; ++r) dot[r] = _mm512_setzero_si512();
    panels::dot_kgroups(xq, wq, 8 * j, 8, dot);
    const __m512 dx = _mm512_loadu_ps(x.dx + (p * x.nb + j) * panels::kPanel);
    const __m512 dxs = _mm512_loadu_ps(x.dxs + (p * x.nb + j) * panels::kPanel);
    const float* sj = scales + j * 2 * kRows;
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(_mm512_set1_ps(sj[r]), dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(sj[kRows + r]), dxs, acc[r]);
    }
  }
  panels::store(acc, p, M, y, ldy);
}

// Groups [g0, g1) x every panel (panels::for_each_tile).
template <bool kFive>
inline void groups_panels(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, const panels::Panels& x,
                          int64_t M, float* y, int64_t ldy) {
  const int64_t K = x.K;
  static thread_local std::vector<uint8_t> wq;
  static thread_local std::vector<float> scales;
  ilv::grow(wq, panels::kTile * K * kRows);
  ilv::grow(scales, panels::kTile * K / 32 * 2 * kRows);
  const int64_t S = K / 32 * 2 * kRows;  // a slot's scales
  panels::for_each_tile(
      w, group_bytes, g0, g1, x.count,
      [&](const uint8_t* g, int64_t i) {
        decode_group<kFive>(g, K, wq.data() + i * K * kRows, scales.data() + i * S);
      },
      [&](int64_t p, int64_t i, int64_t g) {
        panel_times_group(x, p, wq.data() + i * K * kRows, scales.data() + i * S, M, y + g * kRows, ldy);
      });
}
#endif

template <bool kFive>
torch::Tensor interleave(const torch::Tensor& w) {
  using F = Format<kFive>;
  ilv::check_group_rows(w, F::kFileBytes, F::kName);
  return ilv::repack_groups(w, F::kFileBytes, F::kGroupBytes, to_group<kFive>);
}

template <bool kFive>
torch::Tensor rows(const torch::Tensor& w, const torch::Tensor& ids) {
  using F = Format<kFive>;
  ilv::check_group_rows(w, F::kGroupBytes / kRows, F::kName);
  return ilv::group_rows(w, ids, F::kFileBytes, F::kGroupBytes, from_group<kFive>, F::kName);
}

// x: [M, K] float32; w: [N, bytes] from interleave<kFive> -> [M, N] float32.
template <bool kFive>
torch::Tensor gemm(torch::Tensor x, const torch::Tensor& w) {
  constexpr int64_t kGroupBytes = Format<kFive>::kGroupBytes;
  const char* name = Format<kFive>::kName;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, name, " quant_gemm: x must be [M, K] float32");
  ilv::check_group_rows(w, kGroupBytes / kRows, name);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kSuper == 0 && w.size(1) * kRows == K / kSuper * kGroupBytes, name,
              " quant_gemm: weight row bytes do not match K = ", K);
  auto y = scratch_empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto act = ilv::quantize_activations<int8_t, 127>(x.data_ptr<float>(), M, K, true);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t group_bytes = kRows * w.size(1);
  float* yp = y.data_ptr<float>();
#if PAGEDLLM_X16_VNNI
  if (M >= kPanelRowsMin) {
    const auto xp = panels::pack(act, M);
    at::parallel_for(0, N / kRows, panels::kTile, [&](int64_t g0, int64_t g1) {
      groups_panels<kFive>(wp, group_bytes, g0, g1, xp, M, yp, N);
    });
    return y;
  }
#endif
  at::parallel_for(0, N / kRows, 4, [&](int64_t g0, int64_t g1) {
    ilv::for_each_group_tile<true>(wp, group_bytes, g0, g1, M, yp,
                                   [&](auto lanes, auto mr, const uint8_t* gp, int64_t m, float* out) {
                                     group_kernel<kFive, decltype(lanes), decltype(mr)::value>(gp, group_bytes, act, m,
                                                                                              out, N);
                                   });
  });
  return y;
}

}  // namespace q45k
}  // namespace

torch::Tensor quant_q45k_interleave(torch::Tensor w, bool five) {
  return five ? q45k::interleave<true>(w) : q45k::interleave<false>(w);
}

torch::Tensor quant_q45k_rows(torch::Tensor w, torch::Tensor ids, bool five) {
  return five ? q45k::rows<true>(w, ids) : q45k::rows<false>(w, ids);
}

torch::Tensor quant_gemm_q45k(torch::Tensor x, torch::Tensor w, bool five) {
  return five ? q45k::gemm<true>(x, w) : q45k::gemm<false>(x, w);
}

PAGEDLLM_EXACT_FLOAT_END
