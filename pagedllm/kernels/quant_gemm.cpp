// y = x @ W^T with W kept in its GGUF (llama.cpp) quantized blocks: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.
//
// The scheme is llama.cpp's: activations are quantized on the fly to int8 blocks of 32 with one
// scale per block (q8_0; the scale stays fp32 here, llama.cpp rounds it to fp16), and each output
// is a sum over blocks of integer dot products times the two blocks' scales. Weight blocks are
// first decoded, a tile of rows at a time, into one common form: 32 signed int8 values per block,
// a scale for each half (K-quants' Q6_K has 16-element sub-blocks; every other format has one
// scale per 32) and an additive offset (Q4_1's min, K-quants' -dmin * m), so that
//     w[i] = s[i / 16] * q[i] + off   and   dot(w_blk, x_blk) = dx * (s . idot) + off * dx * sum(qx).
// Decoding a tile once serves every activation row, so the same code runs 1-row decode and
// multi-hundred-row prefill (Q4_0 / Q4_1 / Q8_0 skip the decoded copy: see dot_direct). AVX2
// integer dot products (maddubs / madd) where the CPU has them, plain C++ elsewhere; the tests
// compare both against dequantize-then-matmul.
#include "common.h"

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
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
  int64_t block_elems, block_bytes;
};

bool format_of(int64_t qtype, Format* f) {
  switch (qtype) {
    case Q4_0: *f = {32, 18}; return true;
    case Q4_1: *f = {32, 20}; return true;
    case Q8_0: *f = {32, 34}; return true;
    case Q4_K: *f = {256, 144}; return true;
    case Q5_K: *f = {256, 176}; return true;
    case Q6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// One decoded row: nb blocks of 32 int8 values, 8 scales per block (elements 4i..4i+3 of a block
// use sv[8b + i]: the lane order of the AVX2 dot product below) and one offset per block.
struct DecodedRow {
  int8_t* q;
  float* sv;
  float* off;
};

inline void set_scales(float* sv, float lo, float hi) {
  for (int i = 0; i < 4; ++i) sv[i] = lo;
  for (int i = 4; i < 8; ++i) sv[i] = hi;
}

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

// Low / high nibbles of 16 bytes -> 32 values (low nibbles first), minus `bias`.
inline void nibbles(const uint8_t* qs, int8_t bias, int8_t* out) {
#if PAGEDLLM_QAVX2
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF), b = _mm_set1_epi8(bias);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_sub_epi8(_mm_and_si128(v, mask), b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), b));
#else
  for (int j = 0; j < 16; ++j) {
    out[j] = static_cast<int8_t>((qs[j] & 0xF) - bias);
    out[j + 16] = static_cast<int8_t>((qs[j] >> 4) - bias);
  }
#endif
}

void decode_row(int64_t qtype, const uint8_t* src, int64_t K, const DecodedRow& r) {
  const int64_t nb = K / 32;
  switch (qtype) {
    case Q8_0:
      for (int64_t b = 0; b < nb; ++b, src += 34) {
        const float d = h2f(src);
        std::memcpy(r.q + 32 * b, src + 2, 32);
        set_scales(r.sv + 8 * b, d, d);
        r.off[b] = 0.f;
      }
      break;
    case Q4_0:
      for (int64_t b = 0; b < nb; ++b, src += 18) {
        const float d = h2f(src);
        nibbles(src + 2, 8, r.q + 32 * b);
        set_scales(r.sv + 8 * b, d, d);
        r.off[b] = 0.f;
      }
      break;
    case Q4_1:
      for (int64_t b = 0; b < nb; ++b, src += 20) {
        const float d = h2f(src);
        nibbles(src + 4, 0, r.q + 32 * b);
        set_scales(r.sv + 8 * b, d, d);
        r.off[b] = h2f(src + 2);
      }
      break;
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
            int sc, m;
            scale_min_k4(is, scales, &sc, &m);
            const int64_t b = 8 * sb + is;
            int8_t* q = r.q + 32 * b;
            const uint8_t* ql = qs + 32 * c;
            const int shift = 4 * half;
            const uint8_t hbit = static_cast<uint8_t>(1u << is);  // u1 = 1 << 2c, u2 = 2 << 2c
            for (int l = 0; l < 32; ++l) {
              int v = (ql[l] >> shift) & 0xF;
              if (five && (qh[l] & hbit)) v += 16;
              q[l] = static_cast<int8_t>(v);
            }
            set_scales(r.sv + 8 * b, d * sc, d * sc);
            r.off[b] = -dmin * m;
          }
        }
      }
      break;
    }
    case Q6_K:
      for (int64_t sb = 0; sb < nb / 8; ++sb, src += 210) {
        const uint8_t* ql0 = src;
        const uint8_t* qh0 = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = h2f(src + 208);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = ql0 + 64 * h;
          const uint8_t* qh = qh0 + 32 * h;
          for (int k = 0; k < 4; ++k) {
            const int64_t b = 8 * sb + 4 * h + k;
            int8_t* q = r.q + 32 * b;
            const uint8_t* lo = ql + (k & 1) * 32;
            const int lshift = (k >> 1) * 4, hshift = 2 * k;
            for (int l = 0; l < 32; ++l) {
              q[l] = static_cast<int8_t>((((lo[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32);
            }
            set_scales(r.sv + 8 * b, d * sc[8 * h + 2 * k], d * sc[8 * h + 2 * k + 1]);
            r.off[b] = 0.f;
          }
        }
      }
      break;
    default:
      TORCH_CHECK(false, "quant_gemm: unsupported quantization type ", qtype);
  }
}

// One activation row -> int8 blocks of 32: d = amax / 127, q = round(x * 127 / amax) (llama.cpp's
// quantize_row_q8_0), and ds = d * sum(q) for the weights' additive offsets.
void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
#if PAGEDLLM_QAVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // sum of the 32 int values, then pack int32 -> int8 (packs interleave 128-bit lanes: permute back)
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    ds[b] = d[b] * static_cast<float>(_mm_cvtsi128_si32(s4));
    const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
      sum += q[i];
    }
    ds[b] = d[b] * static_cast<float>(sum);
#endif
  }
}

// sum over the row's blocks of dx * (sv . idot) + off * ds.
inline float dot_row(const DecodedRow& w, const int8_t* qx, const float* dx, const float* ds, int64_t nb) {
  float off_acc = 0.f;
#if PAGEDLLM_QAVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i vw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + 32 * b));
    const __m256i vx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * b));
    // |w| * sign(w) x: maddubs multiplies unsigned by signed bytes (llama.cpp's q8_0 x q8_0 trick)
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw));
    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
    acc = _mm256_fmadd_ps(p, _mm256_mul_ps(_mm256_loadu_ps(w.sv + 8 * b), _mm256_broadcast_ss(dx + b)), acc);
    off_acc += w.off[b] * ds[b];
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s) + off_acc;
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = w.q + 32 * b;
    const int8_t* x = qx + 32 * b;
    float blk = 0.f;
    for (int i = 0; i < 8; ++i) {
      int s = 0;
      for (int j = 0; j < 4; ++j) s += q[4 * i + j] * x[4 * i + j];
      blk += w.sv[8 * b + i] * static_cast<float>(s);
    }
    acc += dx[b] * blk;
    off_acc += w.off[b] * ds[b];
  }
  return acc + off_acc;
#endif
}

// Q4_0 / Q4_1 / Q8_0 straight from the file's blocks (llama.cpp's ggml_vec_dot_q4_1_q8_1 and
// friends): nibbles are unsigned, so maddubs takes them as they are and Q4_0's "- 8" becomes an
// offset of -8 d like Q4_1's min. No decoded copy: at one activation row that copy cost as much as
// the dot product itself.
inline bool direct_format(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

inline float dot_direct(int64_t qtype, const uint8_t* src, const int8_t* qx, const float* dx, const float* ds,
                        int64_t nb) {
  float off_acc = 0.f;
#if PAGEDLLM_QAVX2
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i vx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * b));
    __m256i p16;
    float d;
    if (qtype == Q8_0) {
      const uint8_t* blk = src + 34 * b;
      d = h2f(blk);
      const __m256i vw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(vx, vw));
    } else {
      const bool q41 = qtype == Q4_1;
      const uint8_t* blk = src + (q41 ? 20 : 18) * b;
      d = h2f(blk);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (q41 ? 4 : 2)));
      const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask);
      p16 = _mm256_maddubs_epi16(nib, vx);
      off_acc += (q41 ? h2f(blk + 2) : -8.f * d) * ds[b];
    }
    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
    acc = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx[b]), acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s) + off_acc;
#else
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* x = qx + 32 * b;
    int isum = 0;
    float d;
    if (qtype == Q8_0) {
      const uint8_t* blk = src + 34 * b;
      d = h2f(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) isum += q[i] * x[i];
    } else {
      const bool q41 = qtype == Q4_1;
      const uint8_t* blk = src + (q41 ? 20 : 18) * b;
      d = h2f(blk);
      const uint8_t* qs = blk + (q41 ? 4 : 2);
      for (int i = 0; i < 16; ++i) isum += (qs[i] & 0xF) * x[i] + (qs[i] >> 4) * x[i + 16];
      off_acc += (q41 ? h2f(blk + 2) : -8.f * d) * ds[b];
    }
    acc += static_cast<float>(isum) * d * dx[b];
  }
  return acc + off_acc;
#endif
}

constexpr int64_t kWeightTile = 16;  // weight rows decoded together (~K * 16 bytes: stays in L1/L2)

}  // namespace

bool quant_gemm_supports(int64_t qtype) {
  Format f;
  return format_of(qtype, &f);
}

bool quant_gemm_simd() { return PAGEDLLM_QAVX2; }

// x: [M, K] float32; w: [N, K / block_elems * block_bytes] uint8 (the GGUF rows, in order) -> [M, N] float32.
torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  Format f;
  TORCH_CHECK(format_of(qtype, &f), "quant_gemm: unsupported quantization type ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_gemm: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_gemm: w must be uint8 [N, bytes]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % f.block_elems == 0 && w.size(1) == K / f.block_elems * f.block_bytes,
              "quant_gemm: weight row bytes do not match K = ", K);
  const int64_t nb = K / 32;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  // Activations: quantized once, shared by every thread.
  std::vector<int8_t> qx(static_cast<size_t>(M * K));
  std::vector<float> dx(static_cast<size_t>(M * nb)), ds(static_cast<size_t>(M * nb));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row_q8(xp + m * K, K, qx.data() + m * K, dx.data() + m * nb, ds.data() + m * nb);
  });

  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data_ptr<float>();
  // Output columns split across threads; each decodes its weight rows a tile at a time.
  const int64_t tiles = (N + kWeightTile - 1) / kWeightTile;
  const bool direct = direct_format(qtype);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int8_t> q(static_cast<size_t>(direct ? 0 : kWeightTile * K));
    std::vector<float> sv(static_cast<size_t>(direct ? 0 : kWeightTile * nb * 8));
    std::vector<float> off(static_cast<size_t>(direct ? 0 : kWeightTile * nb));
    DecodedRow rows[kWeightTile];
    for (int64_t i = 0; i < kWeightTile; ++i) rows[i] = {q.data() + i * K, sv.data() + i * nb * 8, off.data() + i * nb};
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kWeightTile, nt = std::min(kWeightTile, N - n0);
      if (direct) {
        for (int64_t m = 0; m < M; ++m) {
          float* out = yp + m * N + n0;
          for (int64_t i = 0; i < nt; ++i) {
            out[i] = dot_direct(qtype, wp + (n0 + i) * row_bytes, qx.data() + m * K, dx.data() + m * nb,
                                ds.data() + m * nb, nb);
          }
        }
        continue;
      }
      for (int64_t i = 0; i < nt; ++i) decode_row(qtype, wp + (n0 + i) * row_bytes, K, rows[i]);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xq = qx.data() + m * K;
        const float* xd = dx.data() + m * nb;
        const float* xs = ds.data() + m * nb;
        float* out = yp + m * N + n0;
        for (int64_t i = 0; i < nt; ++i) out[i] = dot_row(rows[i], xq, xd, xs, nb);
      }
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
    std::vector<int8_t> q(static_cast<size_t>(K));
    std::vector<float> sv(static_cast<size_t>(nb * 8)), off(static_cast<size_t>(nb));
    const DecodedRow row{q.data(), sv.data(), off.data()};
    for (int64_t r = b; r < e; ++r) {
      decode_row(qtype, wp + r * w.size(1), K, row);
      float* out = yp + r * K;
      for (int64_t i = 0; i < K; ++i) out[i] = sv[8 * (i / 32) + (i % 32) / 4] * q[i] + off[i / 32];
    }
  });
  return y;
}
