// y = x @ W^T for Q4_0 / Q4_1 weights repacked eight rows at a time, with int8 activations.
//
// The row-at-a-time kernel (quant_gemm.cpp) spends a conversion, a multiply and an FMA per
// output per block of 32: at many activation rows that float work, not the integer dot products,
// bounds it. Here the eight outputs of a row group sit in the eight 32-bit lanes of one register,
// as in llama.cpp's repacked Q4_0_8x8: each lane sums its block's whole integer dot product, and
// one conversion + FMA then scales eight outputs at once. Activations are int8 blocks of 32
// (d = amax / 127; llama.cpp's q8_0 / q8_1 scheme), and the 4-bit x int8 products (vpmaddubsw) of
// a whole block sum in 16 bits. (Q8_0 gains nothing from this: 8-bit x 8-bit products do not sum
// in 16 bits, so its lanes need as many vpmaddwd + adds as the row-at-a-time kernel.)
//
// Layout of one group of eight rows, per block b (the same bytes as the rows' eight GGUF blocks,
// permuted; repacking is in place):
//     [d of rows 0..7 (fp16)] [Q4_1: m of rows 0..7 (fp16)] [run 0..3: rows 0..7 x qs bytes 4c..4c+3]
// A GGUF qs byte j holds element j (low nibble) and element j + 16
// (high nibble), so run c unpacks to elements 4c..4c+3 and 16+4c..19+4c of each row, which meet the
// activation bytes at the same offsets broadcast to every lane.
//
// Per output and block, in this order whatever the number of activation rows:
//     i = sum(q_w * q_x) [Q4_0: - 8 * sum(q_x)]        (exact integers)
//     acc = fma(float(i), d_w * d_x, acc)
//     Q4_1: acc = fma(m_w, d_x * float(sum(q_x)), acc)
// so an output is bit-identical whether its activation row comes alone or with 300 others.
#include "entry_points.h"
#include "quant_activations.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_X8_AVX2 1
#else
#define PAGEDLLM_X8_AVX2 0
#endif

namespace {

enum : int64_t { Q4_0 = 2, Q4_1 = 3 };
constexpr int64_t kRows = 8;  // weight rows per group: the lanes of a 256-bit register

// fp16 fields at the head of a GGUF block (d; Q4_1: d, m), before its 16 qs bytes.
int64_t fields_of(int64_t qtype) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1, "interleaved quant_gemm: only Q4_0 and Q4_1, not type ", qtype);
  return qtype == Q4_1 ? 2 : 1;
}
inline int64_t block_bytes(int64_t qtype) { return 2 * fields_of(qtype) + 16; }

// Eight GGUF rows (nb blocks each) <-> one interleaved group (`to_group` picks the direction).
void permute_group(uint8_t* rows, int64_t row_bytes, int64_t nb, int64_t qtype, uint8_t* group, bool to_group) {
  const int64_t fields = fields_of(qtype), bb = block_bytes(qtype), sb = 2 * fields * kRows;
  auto move = [to_group](uint8_t* g, uint8_t* r, int64_t n) { to_group ? std::memcpy(g, r, n) : std::memcpy(r, g, n); };
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* dst = group + b * kRows * bb;
    for (int64_t r = 0; r < kRows; ++r) {
      uint8_t* src = rows + r * row_bytes + b * bb;
      for (int64_t f = 0; f < fields; ++f) move(dst + 16 * f + 2 * r, src + 2 * f, 2);
      for (int64_t c = 0; c < 4; ++c) move(dst + sb + 32 * c + 4 * r, src + 2 * fields + 4 * c, 4);
    }
  }
}

// Quantized activation rows of a call: q [M, K], d and s = sum(q) [M, nb].
struct Activations8 {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t K, nb;
};

#if PAGEDLLM_X8_AVX2
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One group of eight weight rows x activation rows m0 .. m0 + MR - 1 -> y[:, 0:8].
template <int MR, bool kQ41>
inline void group_kernel(const uint8_t* group, const Activations8& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = kQ41 ? 20 : 18, sb = kQ41 ? 32 : 16;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = group + b * kRows * bb;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256i sums[MR];
    for (int c = 0; c < 4; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + sb + 32 * c));
      const __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xb = a.q + (m0 + m) * a.K + 32 * b;
        // <= 2 * 15 * 127 per product pair, two pairs per chunk, four chunks: 30480 < 2^15
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xb + 4 * c)),
                                           _mm256_maddubs_epi16(hi, broadcast4(xb + 16 + 4 * c)));
        sums[m] = c == 0 ? p : _mm256_add_epi16(sums[m], p);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * a.nb + b;
      __m256i dot = _mm256_madd_epi16(sums[m], ones);
      if (!kQ41) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * a.s[at]));
      const float dx = a.d[at];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[m]);
      if (kQ41) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
        acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx * static_cast<float>(a.s[at])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y + (m0 + m) * ldy, acc[m]);
}

#else
// Portable: the same integers and the same float operations, one lane at a time.
template <int MR, bool kQ41>
inline void group_kernel(const uint8_t* group, const Activations8& a, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t bb = kQ41 ? 20 : 18, sb = kQ41 ? 32 : 16;
  for (int m = 0; m < MR; ++m) {
    float acc[kRows] = {};
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = group + b * kRows * bb;
      const int64_t at = (m0 + m) * a.nb + b;
      const int8_t* xb = a.q + (m0 + m) * a.K + 32 * b;
      const float dx = a.d[at];
      for (int64_t r = 0; r < kRows; ++r) {
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t v = blk[sb + 32 * c + 4 * r + j];
            dot += (v & 0xF) * xb[4 * c + j] + (v >> 4) * xb[16 + 4 * c + j];
          }
        if (!kQ41) dot -= 8 * a.s[at];
        acc[r] = std::fma(static_cast<float>(dot), h2f(blk + 2 * r) * dx, acc[r]);
        if (kQ41) acc[r] = std::fma(h2f(blk + 16 + 2 * r), dx * static_cast<float>(a.s[at]), acc[r]);
      }
    }
    std::memcpy(y + (m0 + m) * ldy, acc, sizeof(acc));
  }
}

#endif

// Every activation row times groups [g0, g1): four activation rows per pass, the rest one to three.
template <bool kQ41>
void groups_times_activations(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, int64_t N,
                              const Activations8& a, int64_t M, float* y) {
  constexpr int64_t kTile = 4;  // groups whose weights stay in L1 while every activation row passes
  for (int64_t t0 = g0; t0 < g1; t0 += kTile) {
    const int64_t t1 = std::min(g1, t0 + kTile);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (int64_t g = t0; g < t1; ++g) group_kernel<4, kQ41>(w + g * group_bytes, a, m, y + g * kRows, N);
    for (int64_t g = t0; g < t1; ++g) {
      const uint8_t* gp = w + g * group_bytes;
      float* out = y + g * kRows;
      switch (M - m) {
        case 3: group_kernel<3, kQ41>(gp, a, m, out, N); break;
        case 2: group_kernel<2, kQ41>(gp, a, m, out, N); break;
        case 1: group_kernel<1, kQ41>(gp, a, m, out, N); break;
        default: break;
      }
    }
  }
}

template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "interleaved quant_gemm: w must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * block_bytes(qtype),
              "interleaved quant_gemm: weight row bytes do not match K = ", K);
  TORCH_CHECK(w.size(0) % kRows == 0, "interleaved quant_gemm: rows must be a multiple of 8, not ", w.size(0));
}

}  // namespace

void quant_interleave_rows(torch::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_interleave_rows: bad w");
  const int64_t row_bytes = w.size(1), nb = row_bytes / block_bytes(qtype);
  check_weight(w, qtype, nb * 32);
  uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t group_bytes = kRows * row_bytes;
  at::parallel_for(0, w.size(0) / kRows, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(static_cast<size_t>(group_bytes));
    for (int64_t g = g0; g < g1; ++g) {
      std::memcpy(rows.data(), p + g * group_bytes, group_bytes);
      permute_group(rows.data(), row_bytes, nb, qtype, p + g * group_bytes, true);
    }
  });
}

torch::Tensor quant_deinterleave_rows(torch::Tensor w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_deinterleave_rows: bad w");
  const int64_t row_bytes = w.size(1), nb = row_bytes / block_bytes(qtype);
  check_weight(w, qtype, nb * 32);
  auto out = torch::empty_like(w);
  const int64_t group_bytes = kRows * row_bytes;
  for (int64_t g = 0; g < w.size(0) / kRows; ++g)
    permute_group(out.data_ptr<uint8_t>() + g * group_bytes, row_bytes, nb, qtype, w.data_ptr<uint8_t>() + g * group_bytes,
                  false);
  return out;
}

// x: [M, K] float32; w: [N, bytes] interleaved by quant_interleave_rows -> [M, N] float32.
torch::Tensor quant_gemm_interleaved(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  fields_of(qtype);  // checks the format
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_gemm_interleaved: x must be [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), nb = K / 32;
  check_weight(w, qtype, K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t group_bytes = kRows * w.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  static thread_local std::vector<float> dx;
  grow(dx, M * nb);
  float* dxp = dx.data();
  const int64_t grain = std::max<int64_t>(1, 4096 / K);
  static thread_local std::vector<int8_t> qx;
  static thread_local std::vector<int32_t> sx;
  grow(qx, M * K);
  grow(sx, M * nb);
  int8_t* qxp = qx.data();
  int32_t* sxp = sx.data();
  at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_q8(xp + m * K, K, qxp + m * K, dxp + m * nb, sxp + m * nb);
  });
  const Activations8 act{qxp, dxp, sxp, K, nb};
  at::parallel_for(0, N / kRows, 4, [&](int64_t g0, int64_t g1) {
    if (qtype == Q4_1) {
      groups_times_activations<true>(wp, group_bytes, g0, g1, N, act, M, yp);
    } else {
      groups_times_activations<false>(wp, group_bytes, g0, g1, N, act, M, yp);
    }
  });
  return y;
}
