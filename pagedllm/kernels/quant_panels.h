// Quantized GEMMs at many activation rows on AVX512-VNNI: sixteen activation rows per 512-bit
// register, a group's eight weight rows decoded to bytes once and broadcast.
//
// The group kernels (quant_interleaved.h) broadcast one activation row's four bytes to the eight
// weight rows of a group and unpack the weights again for every four activation rows: at prefill
// sizes that is ~3 instructions per 256-bit dot product. Here a thread decodes its group once
// into bytes (8 rows x K: 16 KiB at K = 2048, in L1), then for each panel of 16 activation rows
// (int8, packed so a k-group of four values of all 16 rows is one 64-byte load) runs
//     for each k-group: one load + 8 x (broadcast a weight row's 4 bytes, vpdpbusd)
// into 8 int32 accumulators (one per weight row, lanes = activation rows): ~2 instructions per
// 512-bit dot product. The float epilogue per block of 32 (or a format's own) is the format's
// own formula, lane by lane in the group kernels' order, so every output is bit-identical to
// theirs: the rows chosen for a panel never change a result.
#pragma once

#include "quant_interleaved.h"

// Q4_K / Q5_K / Q6_K calls with at least this many activation rows take the panels (below, the
// group kernels); the interleaved formats' own rule is in quant_gemm_interleaved_panels.cpp.
constexpr int64_t kPanelRowsMin = 12;

#if PAGEDLLM_X16_VNNI
namespace {
namespace panels {

constexpr int64_t kPanel = 16;  // activation rows per panel: the int32 lanes of a 512-bit register
constexpr int64_t kTile = 4;    // groups decoded at a time (4 x 16 KiB at K = 2048: L2)

// Activation rows in panels of 16: q [panel][k-group][16 rows][4 bytes] (rows past M zero), and
// per activation block (a.nb of them) the rows' d (dx), sum(q) (s; with sums only) and
// d * float(sum q) (dxs), and with fine scales their ds per 32 values: [panel][block][16].
struct Panels {
  const int8_t* q;
  const float* dx;
  const int32_t* s;
  const float* dxs;
  const float* ds;
  int64_t K, nb, count;
};

inline Panels pack(const ilv::Activations8& a, int64_t M) {
  const int64_t count = (M + kPanel - 1) / kPanel, groups = a.K / 4, nds = a.K / 32;
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> dx, dxs, ds;
  static thread_local std::vector<int32_t> s;
  ilv::grow(q, count * kPanel * a.K);
  ilv::grow(dx, count * kPanel * a.nb);
  ilv::grow(s, count * kPanel * a.nb);
  ilv::grow(dxs, count * kPanel * a.nb);
  ilv::grow(ds, count * kPanel * nds);
  int8_t* qp = q.data();
  float *dp = dx.data(), *xsp = dxs.data(), *dsp = ds.data();
  int32_t* sp = s.data();
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < kPanel; ++r) {
        const int64_t m = p * kPanel + r;
        const bool row = m < M;
        int8_t* dst = qp + p * kPanel * a.K + 4 * r;
        for (int64_t g = 0; g < groups; ++g) {
          if (row)
            std::memcpy(dst + g * 4 * kPanel, a.q + m * a.K + 4 * g, 4);
          else
            std::memset(dst + g * 4 * kPanel, 0, 4);
        }
        for (int64_t b = 0; b < a.nb; ++b) {
          const int64_t at = (p * a.nb + b) * kPanel + r;
          const float d = row ? a.d[m * a.nb + b] : 0.f;
          const int32_t sum = row && a.s != nullptr ? a.s[m * a.nb + b] : 0;
          dp[at] = d;
          sp[at] = sum;
          xsp[at] = d * static_cast<float>(sum);
        }
        for (int64_t b = 0; b < nds; ++b)
          dsp[(p * nds + b) * kPanel + r] = row && a.ds != nullptr ? a.ds[m * nds + b] : 0.f;
      }
  });
  return {qp, dp, sp, xsp, dsp, a.K, a.nb, count};
}

// The integer dot products of k-groups g0 .. g0 + n - 1 of panel x with a decoded group w
// ([k-group][8 rows][4 bytes], unsigned), added to acc[8] (lanes = the panel's rows).
inline void dot_kgroups(const int8_t* x, const uint8_t* w, int64_t g0, int n, __m512i* acc) {
  for (int g = 0; g < n; ++g) {
    const __m512i xv = _mm512_loadu_si512(x + (g0 + g) * 4 * kPanel);
    const uint8_t* wg = w + (g0 + g) * 4 * ilv::kRows;
    for (int r = 0; r < ilv::kRows; ++r) {
      int32_t v;
      std::memcpy(&v, wg + 4 * r, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(v), xv);
    }
  }
}

// Groups [g0, g1) of a weight x `count` panels: kTile groups decoded at a time (decode(group, i)
// into scratch slot i), so a panel read once from memory serves all of them
// (compute(p, i, g): panel p x slot i -> group g's eight columns).
template <class Decode, class Compute>
inline void for_each_tile(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, int64_t count, Decode decode,
                          Compute compute) {
  for (int64_t t0 = g0; t0 < g1; t0 += kTile) {
    const int64_t n = std::min(kTile, g1 - t0);
    for (int64_t i = 0; i < n; ++i) decode(w + (t0 + i) * group_bytes, i);
    // The next tile's weights stream into L2 while this one's panels run (compute-bound at few
    // panels; decoding waits on memory otherwise): its bytes in one share per compute call.
    const int64_t next = std::min(kTile, g1 - t0 - n), calls = count * n;
    const char* ahead = reinterpret_cast<const char*>(w + (t0 + n) * group_bytes);
    const int64_t lines = (next * group_bytes + 63) / 64, share = (lines + calls - 1) / calls;
    int64_t sent = 0;
    for (int64_t p = 0; p < count; ++p)
      for (int64_t i = 0; i < n; ++i) {
        for (const int64_t end = std::min(lines, sent + share); sent < end; ++sent)
          _mm_prefetch(ahead + 64 * sent, _MM_HINT_T1);
        compute(p, i, t0 + i);
      }
  }
}

// acc[8] (lane i = the panel's row i, register r = the group's row r) -> y rows p * 16 .. of M.
inline void store(const __m512* acc, int64_t p, int64_t M, float* y, int64_t ldy) {
  alignas(64) float t[ilv::kRows][kPanel];
  for (int r = 0; r < ilv::kRows; ++r) _mm512_store_ps(t[r], acc[r]);
  const int64_t rows = std::min<int64_t>(kPanel, M - p * kPanel);
  for (int64_t i = 0; i < rows; ++i) {
    float* out = y + (p * kPanel + i) * ldy;
    for (int r = 0; r < ilv::kRows; ++r) out[r] = t[r][i];
  }
}

}  // namespace panels
}  // namespace
#endif
