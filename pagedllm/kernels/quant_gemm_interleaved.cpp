// y = x @ W^T for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights repacked eight rows at a time.
//
// The row-at-a-time kernel (quant_gemm.cpp) spends a conversion, a multiply and an FMA per
// output per block of 32: at many activation rows that float work, not the integer dot products,
// bounds it. Here the eight outputs of a row group sit in the eight 32-bit lanes of one register,
// as in llama.cpp's repacked Q4_0_8x8: each lane sums its block's whole integer dot product, and
// one conversion + FMA then scales eight outputs at once; and a thread reads its weights as one
// sequential stream (the row-at-a-time kernel reads four rows at once and draws ~9 GB/s from
// memory at one activation row, this one ~16).
//  - Q4_0 / Q4_1 / Q5_0 / Q5_1: int8 activation blocks of 32 (d = amax / 127; llama.cpp's q8_0 /
//    q8_1 scheme), the unsigned 4- or 5-bit weights times int8 (vpmaddubsw / vpdpbusd).
//  - Q8_0: int16 activation blocks (d = amax / 32767, as quant_gemm.cpp): 8-bit x 8-bit products
//    do not sum in 16 bits, so int8 would save no instruction, and 16 bits keep the logits of a
//    Q8_0 head close to float.
//
// Layout of one group of eight rows, per block b (the size of the rows' eight GGUF blocks:
// 144 / 160 / 176 / 192 / 272 bytes; repacking is in place):
//     [d of rows 0..7 (fp16)] [Q4_1 / Q5_1: m of rows 0..7 (fp16)]
//     [Q5_x: fifth bits, rows 0..7 x 4 bytes] [run 0..3: rows 0..7 x qs bytes 4c..4c+3]
// A GGUF qs byte j holds element j (low nibble) and element j + 16 (high nibble), so run c
// unpacks to elements 4c..4c+3 and 16+4c..19+4c of each row, which meet the activation bytes at
// the same offsets broadcast to every lane. A Q5_x block's 32 fifth bits (qh: bit i of element
// i) are transposed into four bytes, byte j bit k = element j + 4k: run c's low-nibble elements
// at bit c of bytes 0..3, its high-nibble ones at bit 4 + c, in the lanes and bytes of their
// nibbles; one 16-bit shift and a mask move them to 0x10 (group_kernel). Q4_x / Q8_0 blocks keep
// their bytes (permuted), Q5_x their bits.
//
// Per output and block, in this order whatever the number of activation rows:
//     i = sum(q_w * q_x) [Q4_0: - 8 * sum(q_x); Q5_0: - 16 * sum(q_x)]        (exact integers)
//     acc = fma(float(i), d_w * d_x, acc)
//     Q4_1 / Q5_1: acc = fma(m_w, d_x * float(sum(q_x)), acc)
// so an output is bit-identical whether its activation row comes alone or with 300 others.
#include "entry_points.h"
#include "quant_interleaved.h"
#include "quant_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

PAGEDLLM_EXACT_FLOAT_BEGIN

// Named inside the anonymous namespace: the kernel-build test compiles every kernel file as one
// unit, where quant_gemm.cpp's helpers of the same names live.
namespace {
namespace ilv {

// A GGUF block: `fields` fp16 values (d; Q4_1 / Q5_1: d, m), `qh` bytes of fifth bits (Q5_x), then
// `qs` bytes, regrouped in runs of `run`.
struct Layout {
  int64_t fields, qh, qs, run;
  int64_t block_bytes() const { return 2 * fields + qh + qs; }
};

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {1, 0, 16, 4};
    case Q4_1: return {2, 0, 16, 4};
    case Q5_0: return {1, 4, 16, 4};
    case Q5_1: return {2, 4, 16, 4};
    case Q8_0: return {1, 0, 32, 2};
    default: TORCH_CHECK(false, "interleaved quant_gemm: only Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, not type ", qtype);
  }
}

// A Q5_x block's fifth bits (qh bit i: element i) <-> the group's order (byte j bit k: element
// j + 4k, see the layout above).
void move_fifth_bits(const uint8_t* from, uint8_t* to, bool to_group) {
  uint8_t out[4] = {};
  for (int i = 0; i < 32; ++i) {
    const int g = 8 * (i % 4) + i / 4;  // element i's bit in the group's four bytes
    const int s = to_group ? i : g, d = to_group ? g : i;
    out[d / 8] |= static_cast<uint8_t>(((from[s / 8] >> (s % 8)) & 1) << (d % 8));
  }
  std::memcpy(to, out, 4);
}

// Row r (of eight) of a group <-> a GGUF row (nb blocks); `to_group` picks the direction.
void permute_row(uint8_t* row, int64_t r, int64_t nb, const Layout& l, uint8_t* group, bool to_group) {
  const int64_t bb = l.block_bytes(), sb = 2 * l.fields * kRows, qs = sb + l.qh * kRows;
  auto move = [to_group](uint8_t* g, uint8_t* w, int64_t n) { to_group ? std::memcpy(g, w, n) : std::memcpy(w, g, n); };
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* dst = group + b * kRows * bb;
    uint8_t* src = row + b * bb;
    for (int64_t f = 0; f < l.fields; ++f) move(dst + 16 * f + 2 * r, src + 2 * f, 2);
    if (l.qh != 0) {
      uint8_t* g = dst + sb + l.qh * r;
      uint8_t* w = src + 2 * l.fields;
      to_group ? move_fifth_bits(w, g, true) : move_fifth_bits(g, w, false);
    }
    for (int64_t c = 0; c < l.qs / l.run; ++c)
      move(dst + qs + kRows * l.run * c + l.run * r, src + 2 * l.fields + l.qh + l.run * c, l.run);
  }
}

#if PAGEDLLM_X8_AVX2
// V::kGroups groups of eight weight rows (quant_lanes.h; the second group_bytes after the first) x
// activation rows m0 .. m0 + MR - 1 -> y[:, 0:8 * kGroups]. kFine: the activations have a scale
// per 16 (Activations::ds), so the low nibbles (elements 0..15) and the high ones (16..31) sum
// apart and each half is scaled by its own d_x.
template <class V, int MR, int64_t QT, bool kFine = false>
inline void group_kernel(const uint8_t* group, int64_t group_bytes, const Activations8& a, int64_t m0, float* y,
                         int64_t ldy) {
  using F = Nibble<QT>;
  using I = typename V::I;
  constexpr int64_t bb = F::kBlockBytes;
  [[maybe_unused]] const I low4 = V::bytes(0x0F), bit4 = V::bytes(0x10);
#if !PAGEDLLM_X8_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  typename V::F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zerof();
  for (int64_t b = 0; b < a.nb / (kFine ? 2 : 1); ++b) {
    const uint8_t* blk = group + b * kRows * bb;
    V::template prefetch<kRows * bb>(blk, group_bytes);
    const typename V::F dw = V::halves(blk, group_bytes);
    [[maybe_unused]] const I high = F::kFive ? V::load(blk + F::kHigh, group_bytes) : V::zero();
    I sums[MR];
    [[maybe_unused]] I pair[MR];  // kFine: the high half's sums
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const I w = V::load(blk + F::kQs + 32 * c, group_bytes);
      I lo = V::and_(w, low4), hi = V::and_(V::srli16(w, 4), low4);
      if constexpr (F::kFive) {
        // run c's fifth bits: bit c (low nibbles) and 4 + c (high) -> 0x10. A 16-bit shift: the
        // bits it carries across a byte boundary land at bits 0..3 (left) or 5..7 (right), masked.
        lo = V::or_(lo, V::and_(V::slli16(high, 4 - c), bit4));
        hi = V::or_(hi, V::and_(V::srli16(high, c), bit4));
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xb = a.q + (m0 + m) * a.K + 32 * b;
#if PAGEDLLM_X8_VNNI
        // four u8 x s8 products summed straight into each int32 lane
        const I xlo = V::set1(load4(xb + 4 * c)), xhi = V::set1(load4(xb + 16 + 4 * c));
        if constexpr (kFine) {
          sums[m] = V::dpbusd(c == 0 ? V::zero() : sums[m], lo, xlo);
          pair[m] = V::dpbusd(c == 0 ? V::zero() : pair[m], hi, xhi);
        } else {
          const I zero_or_sum = c == 0 ? V::zero() : sums[m];
          sums[m] = V::dpbusd(V::dpbusd(zero_or_sum, lo, xlo), hi, xhi);
        }
#else
        const __m256i xlo = ilv::broadcast4(xb + 4 * c), xhi = ilv::broadcast4(xb + 16 + 4 * c);
        // vpmaddubsw: two u8 x s8 products per int16 lane, |x| <= 127 (never -128)
        if constexpr (kFine) {
          // one half alone: <= 2 * 31 * 127 per run, four runs: 31496 < 2^15 even with 5 bits
          const __m256i pl = _mm256_maddubs_epi16(lo, xlo), ph = _mm256_maddubs_epi16(hi, xhi);
          sums[m] = c == 0 ? pl : _mm256_add_epi16(sums[m], pl);
          pair[m] = c == 0 ? ph : _mm256_add_epi16(pair[m], ph);
          continue;
        }
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
        if constexpr (!F::kFive) {
          // 4 bits: <= 2 * 15 * 127 per product pair, two pairs per run, four runs: 30480 < 2^15
          sums[m] = c == 0 ? p : _mm256_add_epi16(sums[m], p);
        } else if (c % 2 == 0) {
          pair[m] = p;
        } else {
          // 5 bits: <= 2 * 31 * 127 per product pair, two pairs per run: two runs (31496) fit
          // int16, four (62992) would not, so each two are widened to int32
          const __m256i d32 = _mm256_madd_epi16(_mm256_add_epi16(pair[m], p), ones);
          sums[m] = c == 1 ? d32 : _mm256_add_epi32(sums[m], d32);
        }
#endif
      }
    }
    [[maybe_unused]] const typename V::F mw = F::kMin ? V::halves(blk + 16, group_bytes) : V::zerof();
    for (int m = 0; m < MR; ++m) {
      if constexpr (kFine) {
        const int64_t at = (m0 + m) * a.nb + 2 * b;
#if PAGEDLLM_X8_VNNI
        I dlo = sums[m], dhi = pair[m];
#else
        I dlo = _mm256_madd_epi16(sums[m], ones), dhi = _mm256_madd_epi16(pair[m], ones);
#endif
        if (F::kBias != 0) {
          dlo = V::sub32(dlo, V::set1(F::kBias * a.s[at]));
          dhi = V::sub32(dhi, V::set1(F::kBias * a.s[at + 1]));
        }
        acc[m] = V::fmadd(V::cvt(dlo), V::mul(dw, V::set1f(a.d[at])), acc[m]);
        acc[m] = V::fmadd(V::cvt(dhi), V::mul(dw, V::set1f(a.d[at + 1])), acc[m]);
        if (F::kMin) acc[m] = V::fmadd(mw, V::set1f(a.ds[at / 2]), acc[m]);
        continue;
      }
      const int64_t at = (m0 + m) * a.nb + b;
#if PAGEDLLM_X8_VNNI
      I dot = sums[m];
#else
      I dot = F::kFive ? sums[m] : _mm256_madd_epi16(sums[m], ones);
#endif
      if (F::kBias != 0) dot = V::sub32(dot, V::set1(F::kBias * a.s[at]));
      const float dx = a.d[at];
      acc[m] = V::fmadd(V::cvt(dot), V::mul(dw, V::set1f(dx)), acc[m]);
      if (F::kMin) acc[m] = V::fmadd(mw, V::set1f(dx * static_cast<float>(a.s[at])), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) V::store(y + (m0 + m) * ldy, acc[m]);
}

// Q8_0: V::kGroups groups x activation rows m0 .. m0 + MR - 1 (int16) -> y[:, 0:8 * kGroups].
template <class V, int MR>
inline void group_kernel_q8(const uint8_t* group, int64_t group_bytes, const Activations16& a, int64_t m0, float* y,
                            int64_t ldy) {
  using I = typename V::I;
  constexpr int64_t bb = 34;
  typename V::F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zerof();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = group + b * kRows * bb;
    V::template prefetch<kRows * bb>(blk, group_bytes);
    const typename V::F dw = V::halves(blk, group_bytes);
    const int16_t* xb[MR];
    I sums[MR];
    for (int m = 0; m < MR; ++m) {
      xb[m] = a.q + (m0 + m) * a.K + 32 * b;
      sums[m] = V::zero();
    }
    // Unrolled: left rolled, the compiler recomputed the activation address and branched on the
    // first pair at every pair, and the kernel ran at a third of its speed.
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const I w = V::bytes_to_i16(blk + 16 + 16 * p, group_bytes);
      for (int m = 0; m < MR; ++m)  // <= 2 * 128 * 32767 per pair, sixteen pairs: < 2^31
#if PAGEDLLM_X8_VNNI
        sums[m] = V::dpwssd(sums[m], w, V::set1(load4(xb[m] + 2 * p)));
#else
        sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(w, _mm256_set1_epi32(load4(xb[m] + 2 * p))));
#endif
    }
    for (int m = 0; m < MR; ++m) {
      const typename V::F scale = V::mul(dw, V::set1f(a.d[(m0 + m) * a.nb + b]));
      acc[m] = V::fmadd(V::cvt(sums[m]), scale, acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) V::store(y + (m0 + m) * ldy, acc[m]);
}
#else
// Portable: the same integers and the same float operations, one lane at a time.
template <class V, int MR, int64_t QT, bool kFine = false>
inline void group_kernel(const uint8_t* group, int64_t, const Activations8& a, int64_t m0, float* y, int64_t ldy) {
  using F = Nibble<QT>;
  constexpr int64_t bb = F::kBlockBytes;
  for (int m = 0; m < MR; ++m) {
    float acc[kRows] = {};
    for (int64_t b = 0; b < a.nb / (kFine ? 2 : 1); ++b) {
      const uint8_t* blk = group + b * kRows * bb;
      const int64_t at = (m0 + m) * a.nb + (kFine ? 2 * b : b);
      const int8_t* xb = a.q + (m0 + m) * a.K + 32 * b;
      const float dx = a.d[at];
      for (int64_t r = 0; r < kRows; ++r) {
        int32_t dlo = 0, dhi = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t v = blk[F::kQs + 32 * c + 4 * r + j];
            const int h = F::kFive ? blk[F::kHigh + 4 * r + j] : 0;  // bit c: element 4c + j, 4 + c: 16 + 4c + j
            const int lo = (v & 0xF) | (((h >> c) & 1) << 4), hi = (v >> 4) | (((h >> (4 + c)) & 1) << 4);
            dlo += lo * xb[4 * c + j];
            dhi += hi * xb[16 + 4 * c + j];
          }
        if constexpr (kFine) {
          dlo -= F::kBias * a.s[at];
          dhi -= F::kBias * a.s[at + 1];
          acc[r] = std::fma(static_cast<float>(dlo), h2f(blk + 2 * r) * dx, acc[r]);
          acc[r] = std::fma(static_cast<float>(dhi), h2f(blk + 2 * r) * a.d[at + 1], acc[r]);
          if (F::kMin) acc[r] = std::fma(h2f(blk + 16 + 2 * r), a.ds[at / 2], acc[r]);
        } else {
          const int32_t dot = dlo + dhi - F::kBias * a.s[at];
          acc[r] = std::fma(static_cast<float>(dot), h2f(blk + 2 * r) * dx, acc[r]);
          if (F::kMin) acc[r] = std::fma(h2f(blk + 16 + 2 * r), dx * static_cast<float>(a.s[at]), acc[r]);
        }
      }
    }
    std::memcpy(y + (m0 + m) * ldy, acc, sizeof(acc));
  }
}

template <class V, int MR>
inline void group_kernel_q8(const uint8_t* group, int64_t, const Activations16& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = 34;
  for (int m = 0; m < MR; ++m) {
    float acc[kRows] = {};
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = group + b * kRows * bb;
      const int16_t* xb = a.q + (m0 + m) * a.K + 32 * b;
      const float dx = a.d[(m0 + m) * a.nb + b];
      for (int64_t r = 0; r < kRows; ++r) {
        int32_t dot = 0;
        for (int p = 0; p < 16; ++p)
          for (int j = 0; j < 2; ++j) dot += static_cast<int8_t>(blk[16 + 16 * p + 2 * r + j]) * xb[2 * p + j];
        acc[r] = std::fma(static_cast<float>(dot), h2f(blk + 2 * r) * dx, acc[r]);
      }
    }
    std::memcpy(y + (m0 + m) * ldy, acc, sizeof(acc));
  }
}
#endif

// The kernel of a format (+ kFineScales: its fine-scale variant) for V's groups x MR activation rows.
template <int64_t QT, class V, int MR, class A>
inline void run_group(const uint8_t* group, int64_t group_bytes, const A& a, int64_t m0, float* y, int64_t ldy) {
  if constexpr (QT == Q8_0) {
    group_kernel_q8<V, MR>(group, group_bytes, a, m0, y, ldy);
  } else if constexpr (QT > kFineScales) {
    group_kernel<V, MR, QT - kFineScales, true>(group, group_bytes, a, m0, y, ldy);
  } else {
    group_kernel<V, MR, QT>(group, group_bytes, a, m0, y, ldy);
  }
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "interleaved quant_gemm: w must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * layout_of(qtype).block_bytes(),
              "interleaved quant_gemm: weight row bytes do not match K = ", K);
  TORCH_CHECK(w.size(0) % kRows == 0, "interleaved quant_gemm: rows must be a multiple of 8, not ", w.size(0));
}

}  // namespace ilv
}  // namespace

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: repacked in place (the same bytes, permuted; Q5_x's fifth bits
// transposed), returns w; Q4_K, Q5_K, Q6_K: a new
// tensor (quant_gemm_q4k_q5k.cpp: their scales unpacked; quant_gemm_q6k.cpp: regrouped).
torch::Tensor quant_interleave_rows(torch::Tensor w, int64_t qtype) {
  if (qtype == ilv::kQ4K || qtype == ilv::kQ5K) return quant_q45k_interleave(w, qtype == ilv::kQ5K);
  if (qtype == ilv::kQ6K) return quant_q6k_interleave(w);
  const ilv::Layout l = ilv::layout_of(qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_interleave_rows: bad w");
  const int64_t row_bytes = w.size(1), nb = row_bytes / l.block_bytes();
  ilv::check_weight(w, qtype, nb * 32);
  uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t group_bytes = ilv::kRows * row_bytes;
  at::parallel_for(0, w.size(0) / ilv::kRows, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(static_cast<size_t>(group_bytes));
    for (int64_t g = g0; g < g1; ++g) {
      std::memcpy(rows.data(), p + g * group_bytes, group_bytes);
      for (int64_t r = 0; r < ilv::kRows; ++r)
        ilv::permute_row(rows.data() + r * row_bytes, r, nb, l, p + g * group_bytes, true);
    }
  });
  return w;
}

torch::Tensor quant_interleaved_rows(torch::Tensor w, int64_t qtype, torch::Tensor ids) {
  if (qtype == ilv::kQ4K || qtype == ilv::kQ5K) return quant_q45k_rows(w, ids, qtype == ilv::kQ5K);
  if (qtype == ilv::kQ6K) return quant_q6k_rows(w, ids);
  const ilv::Layout l = ilv::layout_of(qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_interleaved_rows: bad w");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "quant_interleaved_rows: ids must be int64 [R]");
  const int64_t row_bytes = w.size(1), nb = row_bytes / l.block_bytes(), N = w.size(0);
  ilv::check_weight(w, qtype, nb * 32);
  ids = ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  auto out = torch::empty({ids.size(0), row_bytes}, w.options());
  for (int64_t i = 0; i < ids.size(0); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "quant_interleaved_rows: row ", ip[i], " out of range for ", N, " rows");
    uint8_t* group = w.data_ptr<uint8_t>() + ip[i] / ilv::kRows * ilv::kRows * row_bytes;
    ilv::permute_row(out.data_ptr<uint8_t>() + i * row_bytes, ip[i] % ilv::kRows, nb, l, group, false);
  }
  return out;
}

// x: [M, K] float32; w: [N, bytes] interleaved by quant_interleave_rows -> [M, N] float32.
torch::Tensor quant_gemm_interleaved(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  if (qtype == ilv::kQ4K || qtype == ilv::kQ5K) return quant_gemm_q45k(x, w, qtype == ilv::kQ5K);
  if (qtype == ilv::kQ6K) return quant_gemm_q6k(x, w);
  const int64_t format = fine_scales_format(qtype);
  ilv::layout_of(format);  // checks the format
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_gemm_interleaved: x must be [M, K] float32");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0);
  int64_t M = x.size(0);
  ilv::check_weight(w, format, K);
  auto y = scratch_empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t group_bytes = ilv::kRows * w.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Whole panels of 16 rows first where they pay; the rows after them through the group kernels
  // (each output row's bits are the same either way).
  const int64_t in_panels = quant_gemm_interleaved_panels(xp, M, K, wp, N, qtype, yp);
  if (in_panels == M) return y;
  xp += in_panels * K;
  yp += in_panels * N;
  M -= in_panels;
  auto run = [&](auto format, const auto& act) {  // format: the GGUF type, as a compile-time constant
    at::parallel_for(0, N / ilv::kRows, 4, [&](int64_t g0, int64_t g1) {
      ilv::for_each_group_tile<true>(wp, group_bytes, g0, g1, M, yp,
                                     [&](auto lanes, auto mr, const uint8_t* gp, int64_t m, float* out) {
                                       ilv::run_group<decltype(format)::value, decltype(lanes), decltype(mr)::value>(
                                           gp, group_bytes, act, m, out, N);
                                     });
    });
  };
  if (qtype == ilv::Q8_0) {
    run(std::integral_constant<int64_t, ilv::Q8_0>{}, ilv::quantize_activations<int16_t, 32767>(xp, M, K, false));
    return y;
  }
  if (qtype > kFineScales) {
    const auto fine = ilv::quantize_activations<int8_t, 127, 16>(xp, M, K, true);
    switch (qtype - kFineScales) {
      case ilv::Q4_0: run(std::integral_constant<int64_t, kFineScales + ilv::Q4_0>{}, fine); break;
      case ilv::Q4_1: run(std::integral_constant<int64_t, kFineScales + ilv::Q4_1>{}, fine); break;
      case ilv::Q5_0: run(std::integral_constant<int64_t, kFineScales + ilv::Q5_0>{}, fine); break;
      default: run(std::integral_constant<int64_t, kFineScales + ilv::Q5_1>{}, fine); break;
    }
    return y;
  }
  const auto act = ilv::quantize_activations<int8_t, 127>(xp, M, K, true);
  switch (qtype) {
    case ilv::Q4_0: run(std::integral_constant<int64_t, ilv::Q4_0>{}, act); break;
    case ilv::Q4_1: run(std::integral_constant<int64_t, ilv::Q4_1>{}, act); break;
    case ilv::Q5_0: run(std::integral_constant<int64_t, ilv::Q5_0>{}, act); break;
    default: run(std::integral_constant<int64_t, ilv::Q5_1>{}, act); break;
  }
  return y;
}

PAGEDLLM_EXACT_FLOAT_END
