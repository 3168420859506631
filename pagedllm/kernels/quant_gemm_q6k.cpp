// y = x @ W^T for Q6_K weights repacked eight rows at a time (Q4_K_M files keep their attn_v, half
// their ffn_down and the output head in Q6_K).
//
// A Q6_K super-block of 256 values: value = d * sc_j * (q - 32), q 6-bit unsigned (low four bits in
// ql, high two in qh), sc_j an int8 scale per 16 values. int8 activation blocks of 32 (d_x = amax /
// 127, the same activations as Q4_0 / Q4_1 / Q4_K), so the two 16-value sub-blocks of an activation
// block combine in integers:
//     i = sc_a * (sum_a(q_w * q_x) - 32 * sum_a(q_x)) + sc_b * (sum_b(...) - 32 * sum_b(q_x))   (exact)
//     acc = fma(float(i), d * d_x, acc)
// in this order whatever the number of activation rows, so an output is bit-identical whether
// its activation row comes alone or with 300 others. (|i| <= 2 * 127 * (16 * 63 * 127 + 32 * 16 *
// 127) < 2^31.)
//
// Layout of one group of eight rows, per super-block (1680 bytes: the file's 8 x 210, regrouped):
//     [d of rows 0..7 (fp16)] [sc: scale j, row r at 8j + r (int8)]
//     [half h (0, 1), run u (0..7): ql bytes 64h + 4u.. | ql bytes 64h + 32 + 4u.. | qh bytes 32h + 4u..,
//      each rows 0..7 x 4 bytes]
// ggml's order: in half h, ql byte l holds values 128h + l (low nibble) and 128h + 64 + l (high),
// ql byte 32 + l values 128h + 32 + l and 128h + 96 + l; qh byte l their high bits, two each.
#include "entry_points.h"
#include "quant_interleaved.h"
#include "quant_lanes.h"
#include "quant_panels.h"

#include <cmath>
#include <cstring>

PAGEDLLM_EXACT_FLOAT_BEGIN

namespace {
namespace q6k {

using ilv::Activations8;
using ilv::kRows;

constexpr int64_t kSuper = 256, kFileBytes = 210;
constexpr int64_t kScales = 2 * kRows, kRuns = kScales + 16 * kRows;  // offsets in a group's super-block
constexpr int64_t kRunBytes = 3 * 4 * kRows, kGroupBytes = kRuns + 16 * kRunBytes;  // 1680
// ggml's Q6_K block: ql[128], qh[64], scales[16], d
constexpr int64_t kQl = 0, kQh = 128, kSc = 192, kD = 208;

void to_group(const uint8_t* file, int64_t r, uint8_t* g) {
  std::memcpy(g + 2 * r, file + kD, 2);
  for (int j = 0; j < 16; ++j) g[kScales + 8 * j + r] = file[kSc + j];
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 8; ++u) {
      uint8_t* run = g + kRuns + (8 * h + u) * kRunBytes + 4 * r;
      std::memcpy(run, file + kQl + 64 * h + 4 * u, 4);
      std::memcpy(run + 32, file + kQl + 64 * h + 32 + 4 * u, 4);
      std::memcpy(run + 64, file + kQh + 32 * h + 4 * u, 4);
    }
}

void from_group(const uint8_t* g, int64_t r, uint8_t* file) {
  std::memcpy(file + kD, g + 2 * r, 2);
  for (int j = 0; j < 16; ++j) file[kSc + j] = g[kScales + 8 * j + r];
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 8; ++u) {
      const uint8_t* run = g + kRuns + (8 * h + u) * kRunBytes + 4 * r;
      std::memcpy(file + kQl + 64 * h + 4 * u, run, 4);
      std::memcpy(file + kQl + 64 * h + 32 + 4 * u, run + 32, 4);
      std::memcpy(file + kQh + 32 * h + 4 * u, run + 64, 4);
    }
}

// What the kernel takes of the activations beyond Activations8: sum(q_x) per 16 values.
struct Sums16 {
  const int32_t* s;  // [M, K / 16]
};

#if PAGEDLLM_X8_AVX2
// sum over lanes of four u8 x s8 products, added to acc (int32 lanes)
template <class V>
inline typename V::I dot4(typename V::I acc, typename V::I u, typename V::I s) {
#if PAGEDLLM_X8_VNNI
  return V::dpbusd(acc, u, s);
#else
  // <= 2 * 63 * 128 per pair: fits int16; widened at once (four runs would not fit)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A run's 6-bit values, rows 0..7 x 4 each (V: of each group): q[i] holds values 32i + 4u.. of
// the half (low four bits from ql, high two from qh).
template <class V>
inline void run_values(const uint8_t* run, int64_t group_bytes, typename V::I* q) {
  using I = typename V::I;
  const I low4 = V::bytes(0x0F), low2 = V::bytes(0x03);
  const I a_ = V::load(run, group_bytes), b_ = V::load(run + 32, group_bytes), hb = V::load(run + 64, group_bytes);
  q[0] = V::or_(V::and_(a_, low4), V::slli16(V::and_(hb, low2), 4));
  q[1] = V::or_(V::and_(b_, low4), V::slli16(V::and_(V::srli16(hb, 2), low2), 4));
  q[2] = V::or_(V::and_(V::srli16(a_, 4), low4), V::slli16(V::and_(V::srli16(hb, 4), low2), 4));
  q[3] = V::or_(V::and_(V::srli16(b_, 4), low4), V::slli16(V::and_(V::srli16(hb, 6), low2), 4));
}

// V::kGroups groups (quant_lanes.h) x activation rows m0 .. m0 + MR - 1 -> y[:, 0:8 * kGroups].
template <class V, int MR>
inline void group_kernel(const uint8_t* group, int64_t group_bytes, const Activations8& a, const Sums16& s16,
                         int64_t m0, float* y, int64_t ldy) {
  using I = typename V::I;
  typename V::F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zerof();
  for (int64_t s = 0; s < a.K / kSuper; ++s) {
    const uint8_t* blk = group + s * kGroupBytes;
    V::template prefetch<kGroupBytes>(blk, group_bytes);
    const typename V::F d = V::halves(blk, group_bytes);
    for (int h = 0; h < 2; ++h) {
      I block_int[MR][4];  // activation blocks 4h .. 4h + 3 of the super-block
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < 4; ++i) block_int[m][i] = V::zero();
      for (int k = 0; k < 2; ++k) {  // sub-blocks of 16: values 4u.. for u in 4k .. 4k + 3
        I dot[MR][4];
        for (int m = 0; m < MR; ++m)
          for (int i = 0; i < 4; ++i) dot[m][i] = V::zero();
#pragma GCC unroll 4
        for (int u = 4 * k; u < 4 * k + 4; ++u) {
          I q[4];
          run_values<V>(blk + kRuns + (8 * h + u) * kRunBytes, group_bytes, q);
          for (int m = 0; m < MR; ++m) {
            const int8_t* xb = a.q + (m0 + m) * a.K + kSuper * s + 128 * h + 4 * u;
            for (int i = 0; i < 4; ++i) dot[m][i] = dot4<V>(dot[m][i], q[i], V::set1(ilv::load4(xb + 32 * i)));
          }
        }
        for (int i = 0; i < 4; ++i) {
          const int j = 8 * h + 2 * i + k;  // the scale of values 128h + 32i + 16k ..
          const I sc = V::signed_bytes(blk + kScales + 8 * j, group_bytes);
          for (int m = 0; m < MR; ++m) {
            const int32_t sum16 = s16.s[(m0 + m) * (a.K / 16) + (kSuper * s + 128 * h + 32 * i + 16 * k) / 16];
            const I centred = V::sub32(dot[m][i], V::set1(32 * sum16));
            block_int[m][i] = V::add32(block_int[m][i], V::mullo32(centred, sc));
          }
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int i = 0; i < 4; ++i) {
          const float dx = a.d[(m0 + m) * a.nb + s * 8 + 4 * h + i];
          acc[m] = V::fmadd(V::cvt(block_int[m][i]), V::mul(d, V::set1f(dx)), acc[m]);
        }
    }
  }
  for (int m = 0; m < MR; ++m) V::store(y + (m0 + m) * ldy, acc[m]);
}
#else
// Portable: the same integers and the same float operations, one lane at a time.
template <class V, int MR>
inline void group_kernel(const uint8_t* group, int64_t, const Activations8& a, const Sums16& s16, int64_t m0, float* y,
                         int64_t ldy) {
  for (int m = 0; m < MR; ++m) {
    float acc[kRows] = {};
    for (int64_t s = 0; s < a.K / kSuper; ++s) {
      const uint8_t* blk = group + s * kGroupBytes;
      for (int h = 0; h < 2; ++h)
        for (int64_t r = 0; r < kRows; ++r) {
          const float d = h2f(blk + 2 * r);
          for (int i = 0; i < 4; ++i) {
            int32_t block_int = 0;
            for (int k = 0; k < 2; ++k) {
              int32_t dot = 0;
              for (int u = 4 * k; u < 4 * k + 4; ++u) {
                const uint8_t* run = blk + kRuns + (8 * h + u) * kRunBytes + 4 * r;
                for (int e = 0; e < 4; ++e) {
                  const uint8_t lo = (i % 2 == 0 ? run[e] : run[32 + e]) >> (i < 2 ? 0 : 4);
                  const int q = (lo & 0xF) | (((run[64 + e] >> (2 * i)) & 3) << 4);
                  dot += q * a.q[(m0 + m) * a.K + kSuper * s + 128 * h + 32 * i + 4 * u + e];
                }
              }
              const int j = 8 * h + 2 * i + k;
              const int32_t sum16 = s16.s[(m0 + m) * (a.K / 16) + (kSuper * s + 128 * h + 32 * i + 16 * k) / 16];
              block_int += static_cast<int8_t>(blk[kScales + 8 * j + r]) * (dot - 32 * sum16);
            }
            const float dx = a.d[(m0 + m) * a.nb + s * 8 + 4 * h + i];
            acc[r] = std::fma(static_cast<float>(block_int), d * dx, acc[r]);
          }
        }
    }
    std::memcpy(y + (m0 + m) * ldy, acc, sizeof(acc));
  }
}
#endif

#if PAGEDLLM_X16_VNNI
// Many activation rows (quant_panels.h). A group decoded once: values 0..63 as bytes (k-group
// 64s + 32h + 8i + u: q[i] of run u of half h), scale J (of values 16J..) per row as int32, d
// per super-block and row as float.
inline void decode_group(const uint8_t* group, int64_t K, uint8_t* wq, int32_t* sc, float* d) {
  for (int64_t s = 0; s < K / kSuper; ++s) {
    const uint8_t* blk = group + s * kGroupBytes;
    _mm256_storeu_ps(d + s * kRows, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
    for (int j = 0; j < 16; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + (16 * s + j) * kRows),
                          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kScales + 8 * j))));
    for (int h = 0; h < 2; ++h)
      for (int u = 0; u < 8; ++u) {
        const uint8_t* run = blk + kRuns + (8 * h + u) * kRunBytes;
        __m256i q[4];
        run_values<ilv::Lanes8>(run, 0, q);
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + (64 * s + 32 * h + 8 * i + u) * 4 * kRows), q[i]);
      }
  }
}

// One decoded group x panel p -> y's eight columns, group_kernel's operations per block of 32.
// s16: 32 * sum(q_x) per 16 values, [panel][K / 16][16].
inline void panel_times_group(const panels::Panels& x, const int32_t* s16, int64_t p, const uint8_t* wq,
                              const int32_t* sc, const float* d, int64_t M, float* y, int64_t ldy) {
  const int8_t* xq = x.q + p * panels::kPanel * x.K;
  const int32_t* sp = s16 + p * panels::kPanel * (x.K / 16);
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i block_int[kRows];
    for (int r = 0; r < kRows; ++r) block_int[r] = _mm512_setzero_si512();
    for (int64_t J = 2 * b; J < 2 * b + 2; ++J) {
      __m512i dot[kRows];
      for (int r = 0; r < kRows; ++r) dot[r] = _mm512_setzero_si512();
      panels::dot_kgroups(xq, wq, 4 * J, 4, dot);
      const __m512i sums = _mm512_loadu_si512(sp + J * panels::kPanel);
      for (int r = 0; r < kRows; ++r)
        block_int[r] = _mm512_add_epi32(
            block_int[r], _mm512_mullo_epi32(_mm512_sub_epi32(dot[r], sums), _mm512_set1_epi32(sc[J * kRows + r])));
    }
    const __m512 dx = _mm512_loadu_ps(x.dx + (p * x.nb + b) * panels::kPanel);
    const float* ds = d + (b / 8) * kRows;
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_int[r]), _mm512_mul_ps(_mm512_set1_ps(ds[r]), dx), acc[r]);
  }
  panels::store(acc, p, M, y, ldy);
}

// Groups [g0, g1) x every panel, panels::kTile groups decoded at a time.
inline void groups_panels(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, const panels::Panels& x,
                          const int32_t* s16, int64_t M, float* y, int64_t ldy) {
  const int64_t K = x.K, T = panels::kTile;
  static thread_local std::vector<uint8_t> wq;
  static thread_local std::vector<int32_t> sc;
  static thread_local std::vector<float> d;
  ilv::grow(wq, T * K * kRows);
  ilv::grow(sc, T * K / 16 * kRows);
  ilv::grow(d, T * K / kSuper * kRows);
  panels::for_each_tile(
      w, group_bytes, g0, g1, x.count,
      [&](const uint8_t* g, int64_t i) {
        decode_group(g, K, wq.data() + i * K * kRows, sc.data() + i * K / 16 * kRows, d.data() + i * K / kSuper * kRows);
      },
      [&](int64_t p, int64_t i, int64_t g) {
        panel_times_group(x, s16, p, wq.data() + i * K * kRows, sc.data() + i * K / 16 * kRows,
                          d.data() + i * K / kSuper * kRows, M, y + g * kRows, ldy);
      });
}
#endif

}  // namespace q6k
}  // namespace

torch::Tensor quant_q6k_interleave(torch::Tensor w) {
  ilv::check_group_rows(w, q6k::kFileBytes, "Q6_K interleave");
  return ilv::repack_groups(w, q6k::kFileBytes, q6k::kGroupBytes, q6k::to_group);
}

torch::Tensor quant_q6k_rows(torch::Tensor w, torch::Tensor ids) {
  ilv::check_group_rows(w, q6k::kGroupBytes / q6k::kRows, "Q6_K rows");
  return ilv::group_rows(w, ids, q6k::kFileBytes, q6k::kGroupBytes, q6k::from_group, "Q6_K rows");
}

// x: [M, K] float32; w: [N, bytes] from quant_q6k_interleave -> [M, N] float32.
torch::Tensor quant_gemm_q6k(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "Q6_K quant_gemm: x must be [M, K] float32");
  ilv::check_group_rows(w, q6k::kFileBytes, "Q6_K quant_gemm");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % q6k::kSuper == 0 && w.size(1) == K / q6k::kSuper * q6k::kFileBytes,
              "Q6_K quant_gemm: weight row bytes do not match K = ", K);
  auto y = scratch_empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto act = ilv::quantize_activations<int8_t, 127>(x.data_ptr<float>(), M, K, false);
  static thread_local std::vector<int32_t> sums;
  ilv::grow(sums, M * K / 16);
  int32_t* sp = sums.data();
  at::parallel_for(0, M * K / 16, 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int32_t t = 0;
      for (int j = 0; j < 16; ++j) t += act.q[16 * i + j];
      sp[i] = t;
    }
  });
  const q6k::Sums16 s16{sp};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t group_bytes = q6k::kRows * w.size(1);
  float* yp = y.data_ptr<float>();
#if PAGEDLLM_X16_VNNI
  if (M >= kPanelRowsMin) {
    const auto xp = panels::pack(act, M);
    // 32 * sum(q_x) per 16 values, in panels: [panel][K / 16][16 rows] (rows past M: 0)
    static thread_local std::vector<int32_t> panel_sums;
    const int64_t n16 = K / 16;
    ilv::grow(panel_sums, xp.count * panels::kPanel * n16);
    int32_t* ps = panel_sums.data();
    std::fill(ps, ps + xp.count * panels::kPanel * n16, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t J = 0; J < n16; ++J)
        ps[((m / panels::kPanel) * n16 + J) * panels::kPanel + m % panels::kPanel] = 32 * sp[m * n16 + J];
    at::parallel_for(0, N / q6k::kRows, panels::kTile, [&](int64_t g0, int64_t g1) {
      q6k::groups_panels(wp, group_bytes, g0, g1, xp, ps, M, yp, N);
    });
    return y;
  }
#endif
  at::parallel_for(0, N / q6k::kRows, 4, [&](int64_t g0, int64_t g1) {
    // four rows per call at most: a call holds 8 x MR accumulators
    ilv::for_each_group_tile<true, 4>(wp, group_bytes, g0, g1, M, yp,
                                      [&](auto lanes, auto mr, const uint8_t* gp, int64_t m, float* out) {
                                        q6k::group_kernel<decltype(lanes), decltype(mr)::value>(gp, group_bytes, act,
                                                                                               s16, m, out, N);
                                      });
  });
  return y;
}

PAGEDLLM_EXACT_FLOAT_END
