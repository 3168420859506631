// y = x @ W^T for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights repacked by quant_interleave_rows, at
// many activation rows, on AVX512-VNNI: quant_panels.h's panels (16 activation rows per register,
// a group decoded to bytes once). quant_gemm_interleaved() calls it; the activations are
// quantized by the same code, and each output is bit-identical to the group kernel's
// (quant_gemm_interleaved.cpp), plain and with fine scales. Q8_0 keeps its int16 activations:
// panels of 16 rows x 2 values per register, vpdpwssd.
#include "entry_points.h"
#include "quant_panels.h"

PAGEDLLM_EXACT_FLOAT_BEGIN

namespace {
namespace interleaved_panels {

#if PAGEDLLM_X16_VNNI
using ilv::kRows;
using ilv::Nibble;

// A group decoded once: block b's low nibbles (elements 4c..4c+3, run c) -> k-group 8b + c, its
// high nibbles (16 + 4c..) -> 8b + 4 + c, fifth bits merged (0..31); d and m per row as floats.
template <int64_t QT>
void decode_group(const uint8_t* group, int64_t nblocks, uint8_t* wq, float* dw, float* mw) {
  using F = Nibble<QT>;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = group + b * kRows * F::kBlockBytes;
    _mm256_storeu_ps(dw + b * kRows, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
    if (F::kMin)
      _mm256_storeu_ps(mw + b * kRows, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16))));
    const __m256i high =
        F::kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + F::kHigh)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + F::kQs + 32 * c));
      __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      if constexpr (F::kFive) {  // as group_kernel: run c's fifth bits at bit c (low) and 4 + c (high)
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(high, 4 - c), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(high, c), bit4));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + (8 * b + c) * 4 * kRows), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + (8 * b + 4 + c) * 4 * kRows), hi);
    }
  }
}

// dot[r] -= kBias * sum(q_x) of the lanes' activation block at `at`.
template <int32_t kBias>
inline void centre(__m512i* dot, const int32_t* s) {
  if constexpr (kBias != 0) {
    const __m512i bias = _mm512_mullo_epi32(_mm512_loadu_si512(s), _mm512_set1_epi32(kBias));
    for (int r = 0; r < kRows; ++r) dot[r] = _mm512_sub_epi32(dot[r], bias);
  }
}

// One decoded group x panel p -> y's eight columns, group_kernel's float operations per block.
template <int64_t QT, bool kFine>
void panel_times_group(const panels::Panels& x, int64_t p, const uint8_t* wq, const float* dw, const float* mw,
                       int64_t M, float* y, int64_t ldy) {
  using F = Nibble<QT>;
  constexpr int64_t P = panels::kPanel;
  const int8_t* xq = x.q + p * P * x.K;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.K / 32; ++b) {
    const float* db = dw + b * kRows;
    const float* mb = mw + b * kRows;
    __m512i dot[kRows];
    if constexpr (kFine) {  // the block's halves of 16 apart, each with its own d_x
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < kRows; ++r) dot[r] = _mm512_setzero_si512();
        panels::dot_kgroups(xq, wq, 8 * b + 4 * h, 4, dot);
        const int64_t at = (p * x.nb + 2 * b + h) * P;
        centre<F::kBias>(dot, x.s + at);
        const __m512 dx = _mm512_loadu_ps(x.dx + at);
        for (int r = 0; r < kRows; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(_mm512_set1_ps(db[r]), dx), acc[r]);
      }
      if constexpr (F::kMin) {
        const __m512 ds = _mm512_loadu_ps(x.ds + (p * (x.K / 32) + b) * P);
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mb[r]), ds, acc[r]);
      }
    } else {
      for (int r = 0; r < kRows; ++r) dot[r] = _mm512_setzero_si512();
      panels::dot_kgroups(xq, wq, 8 * b, 8, dot);
      const int64_t at = (p * x.nb + b) * P;
      centre<F::kBias>(dot, x.s + at);
      const __m512 dx = _mm512_loadu_ps(x.dx + at);
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(_mm512_set1_ps(db[r]), dx), acc[r]);
      if constexpr (F::kMin) {
        const __m512 dxs = _mm512_loadu_ps(x.dxs + at);
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mb[r]), dxs, acc[r]);
      }
    }
  }
  panels::store(acc, p, M, y, ldy);
}

// Q8_0 at many rows: int16 activation rows in panels, [panel][pair of values][16 rows][2 x int16],
// and the rows' d per block [panel][block][16].
struct Panels16 {
  const int16_t* q;
  const float* dx;
  int64_t K, nb, count;
};

inline Panels16 pack16(const ilv::Activations16& a, int64_t M) {
  constexpr int64_t P = panels::kPanel;
  const int64_t count = (M + P - 1) / P, pairs = a.K / 2;
  static thread_local std::vector<int16_t> q;
  static thread_local std::vector<float> dx;
  ilv::grow(q, count * P * a.K);
  ilv::grow(dx, count * P * a.nb);
  int16_t* qp = q.data();
  float* dp = dx.data();
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < P; ++r) {
        const int64_t m = p * P + r;
        int16_t* dst = qp + p * P * a.K + 2 * r;
        for (int64_t i = 0; i < pairs; ++i) {
          dst[i * 2 * P] = m < M ? a.q[m * a.K + 2 * i] : 0;
          dst[i * 2 * P + 1] = m < M ? a.q[m * a.K + 2 * i + 1] : 0;
        }
        for (int64_t b = 0; b < a.nb; ++b) dp[(p * a.nb + b) * P + r] = m < M ? a.d[m * a.nb + b] : 0.f;
      }
  });
  return {qp, dp, a.K, a.nb, count};
}

// A Q8_0 group decoded once: pair i of values of the eight rows as int16, [pair][8 rows][2], and
// d per block and row as floats.
inline void decode_group_q8(const uint8_t* group, int64_t nblocks, int16_t* wq, float* dw) {
  constexpr int64_t bb = 34;
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = group + b * kRows * bb;
    _mm256_storeu_ps(dw + b * kRows, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
    for (int p = 0; p < 16; ++p)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + (16 * b + p) * 2 * kRows),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * p))));
  }
}

// One decoded Q8_0 group x panel p -> y's eight columns, group_kernel_q8's operations per block.
inline void panel_times_group_q8(const Panels16& x, int64_t p, const int16_t* wq, const float* dw, int64_t M, float* y,
                                 int64_t ldy) {
  constexpr int64_t P = panels::kPanel;
  const int16_t* xq = x.q + p * P * x.K;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i dot[kRows];
    for (int r = 0; r < kRows; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t i = 16 * b; i < 16 * b + 16; ++i) {  // <= 2 * 128 * 32767 per pair, 16 pairs: < 2^31
      const __m512i xv = _mm512_loadu_si512(xq + i * 2 * P);
      const int16_t* wi = wq + i * 2 * kRows;
      for (int r = 0; r < kRows; ++r) {
        int32_t v;
        std::memcpy(&v, wi + 2 * r, 4);
        dot[r] = _mm512_dpwssd_epi32(dot[r], _mm512_set1_epi32(v), xv);
      }
    }
    const __m512 dx = _mm512_loadu_ps(x.dx + (p * x.nb + b) * P);
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(_mm512_set1_ps(dw[b * kRows + r]), dx), acc[r]);
  }
  panels::store(acc, p, M, y, ldy);
}

void run_q8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  const auto xp = pack16(ilv::quantize_activations<int16_t, 32767>(x, M, K, false), M);
  const int64_t nblocks = K / 32, group_bytes = kRows * nblocks * 34, T = panels::kTile;
  at::parallel_for(0, N / kRows, T, [&](int64_t g0, int64_t g1) {
    static thread_local std::vector<int16_t> wq;
    static thread_local std::vector<float> dw;
    ilv::grow(wq, T * K * kRows);
    ilv::grow(dw, T * nblocks * kRows);
    panels::for_each_tile(
        w, group_bytes, g0, g1, xp.count,
        [&](const uint8_t* g, int64_t i) {
          decode_group_q8(g, nblocks, wq.data() + i * K * kRows, dw.data() + i * nblocks * kRows);
        },
        [&](int64_t p, int64_t i, int64_t g) {
          panel_times_group_q8(xp, p, wq.data() + i * K * kRows, dw.data() + i * nblocks * kRows, M, y + g * kRows, N);
        });
  });
}

template <int64_t QT, bool kFine>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y) {
  const auto act = kFine ? ilv::quantize_activations<int8_t, 127, 16>(x, M, K, true)
                         : ilv::quantize_activations<int8_t, 127>(x, M, K, true);
  const auto xp = panels::pack(act, M);
  const int64_t nblocks = K / 32, group_bytes = kRows * nblocks * Nibble<QT>::kBlockBytes, T = panels::kTile;
  at::parallel_for(0, N / kRows, T, [&](int64_t g0, int64_t g1) {
    static thread_local std::vector<uint8_t> wq;
    static thread_local std::vector<float> dw, mw;
    ilv::grow(wq, T * K * kRows);
    ilv::grow(dw, T * nblocks * kRows);
    ilv::grow(mw, T * nblocks * kRows);
    panels::for_each_tile(
        w, group_bytes, g0, g1, xp.count,
        [&](const uint8_t* g, int64_t i) {
          decode_group<QT>(g, nblocks, wq.data() + i * K * kRows, dw.data() + i * nblocks * kRows,
                           mw.data() + i * nblocks * kRows);
        },
        [&](int64_t p, int64_t i, int64_t g) {
          panel_times_group<QT, kFine>(xp, p, wq.data() + i * K * kRows, dw.data() + i * nblocks * kRows,
                                       mw.data() + i * nblocks * kRows, M, y + g * kRows, N);
        });
  });
}
#endif

}  // namespace interleaved_panels
}  // namespace

// Whole panels only, from a format's own row count; the rest (< 16 rows, or all of a smaller call)
// runs the group kernels. A panel costs the same at 1 row as at 16, and the group kernels (two row
// groups per 512-bit register, five or six rows at once) cost ~1/13 of a panel per row, so a
// part-filled panel loses to them. Zen 5, 2048 -> 8192, a build with these panels and one with
// them off, alternating: Q4_0 at 12 / 24 rows 0.53 / 0.88 ms in panels against 0.39 / 0.71 in the
// group kernels; at 32 rows 0.88 against 0.96, at 512 12.6 against 15.4. Q8_0's panels (int16
// pairs, vpdpwssd) only draw level with its group kernels at a few hundred rows (128 rows 7.76
// against 7.26 ms, 512 equal). benchmarks/probes/panel_threshold.py checks the choice.
constexpr int64_t kPanelRowsFrom4 = 32, kPanelRowsFrom8 = 256;

int64_t quant_gemm_interleaved_panels(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                                      int64_t qtype, float* y) {
#if PAGEDLLM_X16_VNNI
  if (M < (qtype == ilv::Q8_0 ? kPanelRowsFrom8 : kPanelRowsFrom4)) return 0;
  M = M / panels::kPanel * panels::kPanel;
  namespace np = interleaved_panels;
  switch (qtype) {
    case ilv::Q4_0: np::run<ilv::Q4_0, false>(x, M, K, w, N, y); return M;
    case ilv::Q4_1: np::run<ilv::Q4_1, false>(x, M, K, w, N, y); return M;
    case ilv::Q5_0: np::run<ilv::Q5_0, false>(x, M, K, w, N, y); return M;
    case ilv::Q5_1: np::run<ilv::Q5_1, false>(x, M, K, w, N, y); return M;
    case ilv::Q8_0: np::run_q8(x, M, K, w, N, y); return M;
    case kFineScales + ilv::Q4_0: np::run<ilv::Q4_0, true>(x, M, K, w, N, y); return M;
    case kFineScales + ilv::Q4_1: np::run<ilv::Q4_1, true>(x, M, K, w, N, y); return M;
    case kFineScales + ilv::Q5_0: np::run<ilv::Q5_0, true>(x, M, K, w, N, y); return M;
    case kFineScales + ilv::Q5_1: np::run<ilv::Q5_1, true>(x, M, K, w, N, y); return M;
    default: return 0;
  }
#else
  (void)x, (void)M, (void)K, (void)w, (void)N, (void)qtype, (void)y;
  return 0;
#endif
}

PAGEDLLM_EXACT_FLOAT_END
