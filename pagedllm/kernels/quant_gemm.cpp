// y = x @ W^T with W kept in its GGUF (llama.cpp) quantized blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K.
//
// Activations are quantized on the fly to int16 blocks of 32 with one float scale per block
// (d = amax / 32767). llama.cpp uses int8 blocks (q8_0 / q8_1); with one output per accumulator,
// as here, 16 bits cost the same on AVX2 (one vpmaddwd does 16 multiply-adds, as does maddubs +
// madd for 32 int8 ones) and keep the activations' rounding 256x smaller. Q4_0 / Q4_1 / Q8_0
// weights repacked eight rows at a time run in quant_gemm_interleaved.cpp instead (Q4_x with int8
// activations: there the integer sums stay in 16 bits per block), 1.5-3x faster; so do Q5_0 /
// Q5_1, which come here only where a layer's rows are not a multiple of 8.
//
// Every weight block is seen as 32 signed integers, a scale for each half (Q6_K has 16-element
// sub-blocks; every other format one scale per 32) and an additive offset per block (Q4_1's and
// Q5_1's min, the K-quants' -dmin * m; Q4_0's "- 8" and Q5_0's "- 16" are folded into its integers):
//     w[i] = s[i / 16] * q[i] + off  =>  dot(w_blk, x_blk) = dx * (s . idot) + off * dx * sum(qx)
// The offset terms of an output are one FMA chain over its blocks in block order (explicit
// intrinsics: -ffast-math may not reorder them), then added to the output: beside the dot
// products for a few activation rows, in a pass of their own (activation rows in vector lanes,
// the same chain per lane) for more.
//
// The micro-kernel takes 2 weight rows x up to 4 activation rows per pass (8 accumulators), so a
// weight block is unpacked once per 4 activation rows and an activation block loaded once per 2
// weight rows. With 4 or more activation rows each 16-row weight tile is first decoded into int16
// (L1-resident) and reused by every activation row; with fewer, Q4_0 / Q4_1 / Q8_0 are unpacked
// straight from the file's blocks (a decoded copy would cost as much as the dot products). Both
// yield the same integers and the same float operations in the same order, so each output is
// bit-identical whatever the number of rows in the call: a sequence's tokens do not depend on the
// batch it runs in.
#include "entry_points.h"
#include "quant_activations.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // F16C's _cvtsh_ss may be there without AVX2
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_QAVX2 1
#else
#define PAGEDLLM_QAVX2 0
#endif

namespace {

// GGMLQuantizationType values (gguf-py / ggml.h).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t block_elems, block_bytes;
};

bool format_of(int64_t qtype, Format* f) {
  switch (qtype) {
    case Q4_0: *f = {32, 18}; return true;
    case Q4_1: *f = {32, 20}; return true;
    case Q5_0: *f = {32, 22}; return true;
    case Q5_1: *f = {32, 24}; return true;
    case Q8_0: *f = {32, 34}; return true;
    case Q4_K: *f = {256, 144}; return true;
    case Q5_K: *f = {256, 176}; return true;
    case Q6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

inline bool has_offsets(int64_t qtype) { return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K; }
inline bool two_scales(int64_t qtype) { return qtype == Q6_K; }
inline bool direct_format(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }


// llama.cpp's get_scale_min_k4: 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row of GGUF blocks -> K int16 values q, two scales per block of 32 (sc[2b] for elements
// 0-15, sc[2b + 1] for 16-31) and one offset per block.
void decode_row(int64_t qtype, const uint8_t* src, int64_t K, int16_t* q, float* sc, float* off) {
  const int64_t nb = K / 32;
  switch (qtype) {
    case Q8_0:
      for (int64_t b = 0; b < nb; ++b, src += 34, q += 32) {
        const int8_t* v = reinterpret_cast<const int8_t*>(src + 2);
        for (int l = 0; l < 32; ++l) q[l] = v[l];
        sc[2 * b] = sc[2 * b + 1] = h2f(src);
        off[b] = 0.f;
      }
      break;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      const bool min = qtype == Q4_1 || qtype == Q5_1, five = qtype == Q5_0 || qtype == Q5_1;
      const int bias = min ? 0 : five ? 16 : 8;
      const int64_t head = min ? 4 : 2, bytes = head + (five ? 4 : 0) + 16;
      for (int64_t b = 0; b < nb; ++b, src += bytes, q += 32) {
        uint32_t h = 0;  // Q5_x: bit l is element l's fifth bit
        if (five) std::memcpy(&h, src + head, 4);
        const uint8_t* qs = src + bytes - 16;
        for (int l = 0; l < 16; ++l) {  // branch-free: gcc vectorizes it (variable shifts)
          q[l] = static_cast<int16_t>(((qs[l] & 0xF) | (((h >> l) & 1) << 4)) - bias);
          q[l + 16] = static_cast<int16_t>(((qs[l] >> 4) | (((h >> (l + 16)) & 1) << 4)) - bias);
        }
        sc[2 * b] = sc[2 * b + 1] = h2f(src);
        off[b] = min ? h2f(src + 2) : 0.f;
      }
      break;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = qtype == Q5_K;
      for (int64_t sb = 0; sb < nb / 8; ++sb, src += five ? 176 : 144) {
        const float d = h2f(src), dmin = h2f(src + 2);
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K only
        const uint8_t* qs = src + (five ? 48 : 16);
        for (int c = 0; c < 4; ++c) {
          for (int half = 0; half < 2; ++half) {
            const int is = 2 * c + half;
            int s, m;
            scale_min_k4(is, scales, &s, &m);
            const int64_t b = 8 * sb + is;
            int16_t* qb = q + 32 * b;
            const uint8_t* ql = qs + 32 * c;
            const int shift = 4 * half;
            const uint8_t hbit = static_cast<uint8_t>(1u << is);  // u1 = 1 << 2c, u2 = 2 << 2c
            for (int l = 0; l < 32; ++l) {
              int v = (ql[l] >> shift) & 0xF;
              if (five && (qh[l] & hbit)) v += 16;
              qb[l] = static_cast<int16_t>(v);
            }
            sc[2 * b] = sc[2 * b + 1] = d * s;
            off[b] = -dmin * m;
          }
        }
      }
      break;
    }
    case Q6_K:
      for (int64_t sb = 0; sb < nb / 8; ++sb, src += 210) {
        const uint8_t* ql0 = src;
        const uint8_t* qh0 = src + 128;
        const int8_t* s = reinterpret_cast<const int8_t*>(src + 192);
        const float d = h2f(src + 208);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = ql0 + 64 * h;
          const uint8_t* qh = qh0 + 32 * h;
          for (int k = 0; k < 4; ++k) {
            const int64_t b = 8 * sb + 4 * h + k;
            int16_t* qb = q + 32 * b;
            const uint8_t* lo = ql + (k & 1) * 32;
            const int lshift = (k >> 1) * 4, hshift = 2 * k;
            for (int l = 0; l < 32; ++l) {
              qb[l] = static_cast<int16_t>((((lo[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32);
            }
            sc[2 * b] = d * s[8 * h + 2 * k];
            sc[2 * b + 1] = d * s[8 * h + 2 * k + 1];
            off[b] = 0.f;
          }
        }
      }
      break;
    default:
      TORCH_CHECK(false, "quant_gemm: unsupported quantization type ", qtype);
  }
}

// Quantized activations of a call: q [M, K] int16, d and ds [M, nb]; ds_t: ds transposed [nb, M]
// (where the offsets take their own pass).
struct Activations {
  const int16_t* q;
  const float* d;
  const float* ds;
  const float* ds_t;
  int64_t K, nb, M;
};

// Weight rows of one tile as the micro-kernel reads them.
struct DecodedTile {  // decoded into int16 (any format)
  const int16_t* q;   // [rows, K]
  const float* sc;    // [rows, 2 nb]
  const float* off;   // [rows, nb]
  int64_t K, nb;
};
template <int64_t QT>
struct FileTile {  // Q4_0 / Q4_1 / Q8_0 straight from the GGUF blocks (the format is a template
  const uint8_t* rows;  // argument: a run-time switch inside the block loop halved its speed)
  int64_t row_bytes;
};

// One weight row of a tile: what the micro-kernel's loop reads, looked up once per pass.
struct DecodedRowRef {
  const int16_t* q;
  const float* sc;
  const float* off;
};
inline DecodedRowRef row_of(const DecodedTile& t, int64_t i) {
  return {t.q + i * t.K, t.sc + i * 2 * t.nb, t.off + i * t.nb};
}
template <int64_t QT>
struct FileRowRef {
  const uint8_t* p;
};
template <int64_t QT>
inline FileRowRef<QT> row_of(const FileTile<QT>& t, int64_t i) { return {t.rows + i * t.row_bytes}; }

#if PAGEDLLM_QAVX2
inline void load_block(const DecodedRowRef& r, int64_t b, __m256i* lo, __m256i* hi, float* slo, float* shi,
                       float* off) {
  const int16_t* p = r.q + 32 * b;
  *lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  *slo = r.sc[2 * b];
  *shi = r.sc[2 * b + 1];
  *off = r.off[b];
}

// The same integers decode_row produces, unpacked in registers.
template <int64_t QT>
inline void load_block(const FileRowRef<QT>& r, int64_t b, __m256i* lo, __m256i* hi, float* slo, float* shi,
                       float* off) {
  const uint8_t* row = r.p;
  *off = 0.f;
  if (QT == Q8_0) {
    const uint8_t* blk = row + 34 * b;
    *slo = *shi = h2f(blk);
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
    return;
  }
  constexpr bool q41 = QT == Q4_1;
  const uint8_t* blk = row + (q41 ? 20 : 18) * b;
  if (q41) {  // d and m side by side: one load, one conversion
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    *slo = *shi = _mm_cvtss_f32(f);
    *off = _mm_cvtss_f32(_mm_movehdup_ps(f));
  } else {
    *slo = *shi = h2f(blk);
  }
  // byte j -> int16 lane j: its low nibble is element j, its high nibble element j + 16
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (q41 ? 4 : 2))));
  __m256i l = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
  __m256i h = _mm256_srli_epi16(v, 4);
  if (!q41) {
    const __m256i eight = _mm256_set1_epi16(8);
    l = _mm256_sub_epi16(l, eight);
    h = _mm256_sub_epi16(h, eight);
  }
  *lo = l;
  *hi = h;
}

// decode_row for the formats FileTile reads, with the same unpacking (so the same integers).
template <int64_t QT>
void decode_rows_simd(const FileTile<QT>& t, int64_t nt, int64_t nb, int16_t* q, float* sc, float* off) {
  const int64_t K = 32 * nb;
  for (int64_t i = 0; i < nt; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo, hi;
      float sl, sh;
      load_block(row_of(t, i), b, &lo, &hi, &sl, &sh, off + i * nb + b);
      int16_t* p = q + i * K + 32 * b;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), hi);
      sc[(i * nb + b) * 2] = sl;
      sc[(i * nb + b) * 2 + 1] = sh;
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Outputs (rows i0 .. i0 + NR - 1 of the tile) x (activation rows m0 .. m0 + MR - 1). Only the
// first `rows` of the NR are written (the others re-read row i0: same code, same order for every
// output). kOffsets: the format has additive offsets (Q4_1, Q4_K, Q5_K).
template <int NR, int MR, bool kTwoScales, bool kOffsets, class Tile>
inline void micro_kernel(const Tile& tile, int64_t i0, int64_t rows, const Activations& a, int64_t m0, float* y,
                         int64_t ldy) {
  __m256 acc[NR][MR];
  __m128 oacc[NR][MR];  // offset terms, lane 0
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      oacc[r][m] = _mm_setzero_ps();
    }
  decltype(row_of(tile, 0)) wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = row_of(tile, r < rows ? i0 + r : i0);
  const int16_t* xr[MR];
  const float *dr[MR], *dsr[MR];
  for (int m = 0; m < MR; ++m) {
    xr[m] = a.q + (m0 + m) * a.K;
    dr[m] = a.d + (m0 + m) * a.nb;
    dsr[m] = a.ds + (m0 + m) * a.nb;
  }
  const int64_t nb = a.nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wl[NR], wh[NR];
    float sl[NR], sh[NR], ol[NR];
    for (int r = 0; r < NR; ++r) load_block(wr[r], b, &wl[r], &wh[r], &sl[r], &sh[r], &ol[r]);
    for (int m = 0; m < MR; ++m) {
      if (kOffsets) {
        const __m128 vds = _mm_set_ss(dsr[m][b]);
        for (int r = 0; r < NR; ++r) oacc[r][m] = _mm_fmadd_ss(_mm_set_ss(ol[r]), vds, oacc[r][m]);
      }
      const int16_t* xp = xr[m] + 32 * b;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16));
      const __m256 vdx = _mm256_set1_ps(dr[m][b]);
      for (int r = 0; r < NR; ++r) {
        const __m256i pl = _mm256_madd_epi16(wl[r], xl), ph = _mm256_madd_epi16(wh[r], xh);
        if (kTwoScales) {
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), _mm256_mul_ps(_mm256_set1_ps(sl[r]), vdx), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), _mm256_mul_ps(_mm256_set1_ps(sh[r]), vdx), acc[r][m]);
        } else {
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(pl, ph)),
                                      _mm256_mul_ps(_mm256_set1_ps(sl[r]), vdx), acc[r][m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      if (r < rows) {
        float v = hsum(acc[r][m]);
        if (kOffsets) v += _mm_cvtss_f32(oacc[r][m]);  // as add_offsets adds its lanes
        y[(m0 + m) * ldy + i0 + r] = v;
      }
}
#else
inline void load_block(const DecodedRowRef& r, int64_t b, const int16_t** q, float* slo, float* shi, float* off) {
  *q = r.q + 32 * b;
  *slo = r.sc[2 * b];
  *shi = r.sc[2 * b + 1];
  *off = r.off[b];
}

// Portable: one output at a time, integer sums per half block, the same float order for every M.
template <int NR, int MR, bool kTwoScales, bool kOffsets, class Tile>
inline void micro_kernel(const Tile& tile, int64_t i0, int64_t rows, const Activations& a, int64_t m0, float* y,
                         int64_t ldy) {
  for (int r = 0; r < std::min<int64_t>(NR, rows); ++r) {
    for (int m = 0; m < MR; ++m) {
      float acc = 0.f, oacc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const int16_t* w;
        float sl, sh, o;
        load_block(row_of(tile, i0 + r), b, &w, &sl, &sh, &o);
        if (kOffsets) oacc = std::fma(o, a.ds[(m0 + m) * a.nb + b], oacc);
        const int16_t* x = a.q + (m0 + m) * a.K + 32 * b;
        int32_t lo = 0, hi = 0;
        for (int l = 0; l < 16; ++l) lo += int32_t(w[l]) * x[l];
        for (int l = 16; l < 32; ++l) hi += int32_t(w[l]) * x[l];
        const float dx = a.d[(m0 + m) * a.nb + b];
        if (kTwoScales) {
          acc += static_cast<float>(lo) * (sl * dx);
          acc += static_cast<float>(hi) * (sh * dx);
        } else {
          acc += static_cast<float>(lo + hi) * (sl * dx);
        }
      }
      y[(m0 + m) * ldy + i0 + r] = acc + oacc;
    }
  }
}
#endif

// rows [0, nt) of a tile x every activation row -> y[:, 0:nt] (ldy = N). Four activation rows x
// two weight rows per pass; a lone activation row (decode) takes four weight rows.
template <bool kTwoScales, bool kOffsets, class Tile>
void tile_times_activations(const Tile& tile, int64_t nt, const Activations& a, int64_t M, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int64_t i = 0; i < nt; i += 2) micro_kernel<2, 4, kTwoScales, kOffsets>(tile, i, nt - i, a, m, y, ldy);
  const int64_t rest = M - m;
  if (rest == 1) {
    for (int64_t i = 0; i < nt; i += 4) micro_kernel<4, 1, kTwoScales, kOffsets>(tile, i, nt - i, a, m, y, ldy);
    return;
  }
  for (int64_t i = 0; i < nt; i += 2) {
    if (rest == 3) micro_kernel<2, 3, kTwoScales, kOffsets>(tile, i, nt - i, a, m, y, ldy);
    if (rest == 2) micro_kernel<2, 2, kTwoScales, kOffsets>(tile, i, nt - i, a, m, y, ldy);
  }
}

#if PAGEDLLM_QAVX2
// y[m, i] += sum_b off[i, b] * ds[m, b] for a decoded tile, eight activation rows per vector: each
// lane runs the FMA chain micro_kernel runs for one output, so the sums are the same.
void add_offsets(const float* off, int64_t nt, const Activations& a, float* y, int64_t ldy) {
  constexpr int R = 4;  // weight rows at once: independent FMA chains (one alone is latency-bound)
  for (int64_t i0 = 0; i0 < nt; i0 += R) {
    const int64_t rows = std::min<int64_t>(R, nt - i0);
    const float* o[R];
    for (int r = 0; r < R; ++r) o[r] = off + (i0 + (r < rows ? r : 0)) * a.nb;
    int64_t m = 0;
    for (; m + 8 <= a.M; m += 8) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < a.nb; ++b) {
        const __m256 ds = _mm256_loadu_ps(a.ds_t + b * a.M + m);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(o[r][b]), ds, acc[r]);
      }
      for (int r = 0; r < rows; ++r) {
        alignas(32) float s[8];
        _mm256_store_ps(s, acc[r]);
        for (int l = 0; l < 8; ++l) y[(m + l) * ldy + i0 + r] += s[l];
      }
    }
    for (; m < a.M; ++m) {
      for (int r = 0; r < rows; ++r) {
        __m128 acc = _mm_setzero_ps();
        for (int64_t b = 0; b < a.nb; ++b) acc = _mm_fmadd_ss(_mm_set_ss(o[r][b]), _mm_set_ss(a.ds_t[b * a.M + m]), acc);
        y[m * ldy + i0 + r] += _mm_cvtss_f32(acc);
      }
    }
  }
}
#endif

template <class Tile>
void tile_times_activations(const Tile& tile, int64_t nt, const Activations& a, int64_t M, float* y, int64_t ldy,
                            bool two_scales, bool offsets) {
  if (two_scales) {  // Q6_K: no offsets
    tile_times_activations<true, false>(tile, nt, a, M, y, ldy);
  } else if (offsets) {
    tile_times_activations<false, true>(tile, nt, a, M, y, ldy);
  } else {
    tile_times_activations<false, false>(tile, nt, a, M, y, ldy);
  }
}

template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

constexpr int64_t kWeightTile = 16;  // weight rows per tile: decoded, ~K * 32 bytes stay in L1
// Below this many activation rows the direct formats skip decoding (the micro-kernel's MR).
constexpr int64_t kDecodeFromRows = 4;

}  // namespace

bool quant_gemm_supports(int64_t qtype) {
  switch (qtype - kInterleaved) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    case kFineScales + Q4_0: case kFineScales + Q4_1: case kFineScales + Q5_0: case kFineScales + Q5_1: return true;
    default: break;
  }
  Format f;
  return format_of(qtype, &f);
}

bool quant_gemm_simd() { return PAGEDLLM_QAVX2; }

// x: [M, K] float32; w: [N, K / block_elems * block_bytes] uint8 (the GGUF rows, in order) -> [M, N] float32.
// Interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K (qtype kInterleaved + type) go to
// quant_gemm_interleaved.cpp.
torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  if (qtype >= kInterleaved) return quant_gemm_interleaved(x, w, qtype - kInterleaved);
  Format f;
  TORCH_CHECK(format_of(qtype, &f), "quant_gemm: unsupported quantization type ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_gemm: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_gemm: w must be uint8 [N, bytes]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % f.block_elems == 0 && w.size(1) == K / f.block_elems * f.block_bytes,
              "quant_gemm: weight row bytes do not match K = ", K);
  const int64_t nb = K / 32;
  auto y = scratch_empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  // Activations: quantized once, shared by every thread. Scratch is per thread and kept between
  // calls: at batch size 1 a call is ~10-100 us and fresh buffers were a visible part of it.
  static thread_local std::vector<int16_t> qx;
  static thread_local std::vector<float> dx, ds;
  grow(qx, M * K);
  grow(dx, M * nb);
  grow(ds, M * nb);
  const float* xp = x.data_ptr<float>();
  int16_t* qxp = qx.data();
  float *dxp = dx.data(), *dsp = ds.data();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_q16(xp + m * K, K, qxp + m * K, dxp + m * nb, dsp + m * nb);
  });
  const bool direct = PAGEDLLM_QAVX2 && direct_format(qtype) && M < kDecodeFromRows;
  const bool offsets = has_offsets(qtype), two = two_scales(qtype);
  static thread_local std::vector<float> ds_t;
  if (PAGEDLLM_QAVX2 && offsets && !direct) {
    grow(ds_t, M * nb);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) ds_t[b * M + m] = dsp[m * nb + b];
  }
  const Activations act{qxp, dxp, dsp, ds_t.data(), K, nb, M};

  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data_ptr<float>();
  // Output columns split across threads, a tile of weight rows at a time.
  const int64_t tiles = (N + kWeightTile - 1) / kWeightTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    static thread_local std::vector<int16_t> q;  // a decoded tile
    static thread_local std::vector<float> sc, off;
    if (!direct) {
      grow(q, kWeightTile * K);
      grow(sc, kWeightTile * nb * 2);
      grow(off, kWeightTile * nb);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kWeightTile, nt = std::min(kWeightTile, N - n0);
      const uint8_t* src = wp + n0 * row_bytes;
      float* out = yp + n0;
#if PAGEDLLM_QAVX2
      if (direct_format(qtype)) {
        auto run = [&](auto tile) {
          if (direct) {
            tile_times_activations(tile, nt, act, M, out, N, false, offsets);
          } else {
            decode_rows_simd(tile, nt, nb, q.data(), sc.data(), off.data());
            tile_times_activations(DecodedTile{q.data(), sc.data(), off.data(), K, nb}, nt, act, M, out, N, false,
                                   false);
            if (offsets) add_offsets(off.data(), nt, act, out, N);
          }
        };
        if (qtype == Q4_0) run(FileTile<Q4_0>{src, row_bytes});
        if (qtype == Q4_1) run(FileTile<Q4_1>{src, row_bytes});
        if (qtype == Q8_0) run(FileTile<Q8_0>{src, row_bytes});
        continue;
      }
#endif
      for (int64_t i = 0; i < nt; ++i)
        decode_row(qtype, src + i * row_bytes, K, q.data() + i * K, sc.data() + i * 2 * nb, off.data() + i * nb);
#if PAGEDLLM_QAVX2
      tile_times_activations(DecodedTile{q.data(), sc.data(), off.data(), K, nb}, nt, act, M, out, N, two, false);
      if (offsets) add_offsets(off.data(), nt, act, out, N);
#else
      tile_times_activations(DecodedTile{q.data(), sc.data(), off.data(), K, nb}, nt, act, M, out, N, two, offsets);
#endif
    }
  });
  return y;
}

// The float values of quantized rows w [R, bytes] -> [R, K] float32 (embedding lookups, tests).
torch::Tensor quant_dequantize(torch::Tensor w, int64_t qtype, int64_t K) {
  Format f;
  TORCH_CHECK(format_of(qtype, &f), "quant_dequantize: unsupported quantization type ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_dequantize: bad w");
  TORCH_CHECK(K % f.block_elems == 0 && w.size(1) == K / f.block_elems * f.block_bytes, "quant_dequantize: bad K");
  const int64_t R = w.size(0), nb = K / 32;
  auto y = torch::empty({R, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    std::vector<int16_t> q(static_cast<size_t>(K));
    std::vector<float> sc(static_cast<size_t>(nb * 2)), off(static_cast<size_t>(nb));
    for (int64_t r = b; r < e; ++r) {
      decode_row(qtype, wp + r * w.size(1), K, q.data(), sc.data(), off.data());
      float* out = yp + r * K;
      for (int64_t i = 0; i < K; ++i) out[i] = sc[i / 16] * q[i] + off[i / 32];
    }
  });
  return y;
}
