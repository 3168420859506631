// Paged decode attention for the CPU: each query token attends to its sequence's keys and
// values read in place from the paged cache through the block table (no gather, no copy).
//
// q:            [num_seqs, num_heads, head_dim]            (float or bfloat16)
// k/v_cache:    [num_blocks, num_kv_heads, block_size, head_dim] (a head's keys of a block are contiguous)
// block_tables: [num_seqs, max_blocks] int64
// seq_lens:     [num_seqs] int64 (keys 0 .. seq_len-1 are visible)
// window:       a sliding window W > 0: only keys seq_len-W .. seq_len-1 are visible, and the blocks
//               before them are never read (they may be released); <= 0: none. The float32 AVX2
//               path and the portable path take it; a windowed bf16 step runs the portable path.
// out:          [num_seqs, num_heads, head_dim] (may be the first rows of a larger contiguous tensor)
// q's rows may be strided (a view into the fused qkv projection output).
//
// One work item is a (sequence, kv head) pair, so the keys and values of that head are read
// once for all query heads of its GQA group. Items are split between threads by their cost
// (sequence length), not by count: a ragged batch would otherwise leave one core idle.
// Scores, softmax and accumulation are in float. Decode attention is bound by memory traffic
// (every step reads the whole KV cache of every running sequence), so the bf16 paths read K/V
// as bf16 and multiply them without widening rows first: with AMX (block size a multiple of 16)
// q.k is one tile product per 16 keys for the whole GQA group and p.v uses AVX512-BF16 dot
// products on pairs of V rows (attend_bf16_amx); without AMX both use AVX512-BF16 (attend_bf16).
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Widens one K or V row to float. The bf16 case is written as a plain shift so the compiler
// vectorizes it (c10::BFloat16's conversion operator is not vectorized).
inline void load_row(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(s[i]);
}
// float16, float8 and int8 (its scales applied by the caller) through c10's conversions
template <typename KV>
inline void load_row(const KV* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// softmax numerator in place; returns 1 / sum. (No infinities anywhere: built with -ffast-math.)
inline float softmax_unnormalized(float* s, int64_t len) {
  float mx = s[0];
  for (int64_t t = 1; t < len; ++t) mx = s[t] > mx ? s[t] : mx;
  float sum = 0.f;
  // vectorized exp (glibc libmvec, enabled by -ffast-math): scalar expf dominated the kernel
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return 1.f / sum;
}

struct Geometry {
  int64_t num_heads, head_dim, block_size, num_kv_heads, group, max_blocks, head_stride, blk_stride, q_stride;
  // Offset of KV head h's block_size x head_dim run (rows contiguous) in physical block `block`.
  int64_t head_block(int64_t block, int64_t h) const { return block * blk_stride + h * head_stride; }
  // Index of that run's first row in an int8 cache's scales [blocks, kv heads, block_size, groups]
  // (times the groups per row: its first scale's offset).
  int64_t scale_block(int64_t block, int64_t h) const { return (block * num_kv_heads + h) * block_size; }
};

// An int8 cache's scales, K's and V's (pagedllm/attention/int8_kv.py); null for the other dtypes.
// A key's score is its scale times q . k (with a scale per group of values, common.h
// int8_scale_groups: the sum of each group's scale times its part of q . k); a value row enters
// the output times its probability and its (group's) scale: folded per key and group, so the rows
// themselves are only widened.
struct KvScales {
  const float *k = nullptr, *v = nullptr;
};
template <typename KV>
constexpr bool kScaled = std::is_same<KV, int8_t>::value;

// The blocks one work item reads, in order: its K blocks 0 .. nblk-1, then its V blocks, then the
// thread's next item starts on its first K block. at(pos) is block `pos` of that stream (null
// past its end): what to prefetch ahead of the block being read.
struct BlockStream {
  const Geometry& g;
  const uint16_t *kp, *vp;
  const int64_t* table;
  int64_t h, nblk;
  const uint16_t* next_k;
  const uint16_t* at(int64_t pos) const {
    if (pos < nblk) return kp + g.head_block(table[pos], h);
    if (pos < 2 * nblk) return vp + g.head_block(table[pos - nblk], h);
    return pos == 2 * nblk ? next_k : nullptr;
  }
};

// Portable path (any dtype, any head_dim): rows widened to float, compiler-vectorized loops.
// scalar_t: of q and out; kv_t: of the caches (kv_cache_dtype).
template <typename scalar_t, typename kv_t>
void attend_generic(const Geometry& g, int64_t s, int64_t h, int64_t first, int64_t end, const scalar_t* qp,
                    const kv_t* kp, const kv_t* vp, scalar_t* op, const int64_t* table, float scale, KvScales sc,
                    std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc,
                    std::vector<float>& row) {
  // keys first .. end - 1
  const int64_t D = g.head_dim, G = g.group, len = end - first;
  const int64_t ng = kScaled<kv_t> ? int8_scale_groups(D) : 1, gn = D / ng;  // int8: scale groups of gn values
  qf.resize(G * D);
  row.resize(D);
  for (int64_t j = 0; j < G; ++j)
    for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_f(qp[s * g.q_stride + (h * G + j) * D + d]) * scale;
  scores.resize(G * len);
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = first + i;
    const kv_t* kt = kp + g.head_block(table[t / g.block_size], h) + (t % g.block_size) * D;
    load_row(kt, row.data(), D);
    const float* ks = kScaled<kv_t> ? sc.k + (g.scale_block(table[t / g.block_size], h) + t % g.block_size) * ng : nullptr;
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = qf.data() + j * D;
      float dot = 0.f;
      for (int64_t c = 0; c < ng; ++c) {
        float part = 0.f;
#pragma omp simd reduction(+ : part)
        for (int64_t d = c * gn; d < (c + 1) * gn; ++d) part += qj[d] * row[d];
        if constexpr (kScaled<kv_t>) part *= ks[c];
        dot += part;
      }
      scores[j * len + i] = dot;
    }
  }
  std::vector<float> inv(G);
  for (int64_t j = 0; j < G; ++j) inv[j] = softmax_unnormalized(scores.data() + j * len, len);
  acc.assign(G * D, 0.f);
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = first + i;
    const kv_t* vt = vp + g.head_block(table[t / g.block_size], h) + (t % g.block_size) * D;
    load_row(vt, row.data(), D);
    const float* vs = kScaled<kv_t> ? sc.v + (g.scale_block(table[t / g.block_size], h) + t % g.block_size) * ng : nullptr;
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < ng; ++c) {
        float p = scores[j * len + i];
        if constexpr (kScaled<kv_t>) p *= vs[c];
        float* aj = acc.data() + j * D;
#pragma omp simd
        for (int64_t d = c * gn; d < (c + 1) * gn; ++d) aj[d] += p * row[d];
      }
  }
  for (int64_t j = 0; j < G; ++j)
    for (int64_t d = 0; d < D; ++d)
      op[(s * g.num_heads + h * G + j) * D + d] = static_cast<scalar_t>(acc[j * D + d] * inv[j]);
}

#if PAGEDLLM_AVX512BF16
// The 16 horizontal sums of a[0..15], in order, by a transpose-and-add tree (45 shuffles and adds
// instead of 16 horizontal reductions of ~8 each).
inline __m512 sum16(const __m512 a[16]) {
  __m512 x[8], z[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's sums of keys 4k .. 4k+3
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * k]), _mm512_castps_pd(x[2 * k + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * k]), _mm512_castps_pd(x[2 * k + 1]));
    z[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // Across the four 128-bit lanes: pairs of lanes, then the pairs' sums, keys in order.
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD));
}

// Blocks are scattered in memory (that is the point of paging), so the hardware prefetcher
// cannot run ahead across them: ask for the rows of this head two blocks ahead (into L2: the
// L1 has too few line-fill buffers to keep enough misses in flight; measured 1.3x). The rows of
// one head in a block are contiguous (head-major cache). The requests go out one row per row
// processed, not a block at a time: a burst of a block's 32 prefetches held the fill buffers that
// the rows in use then waited for (kernel alone 9-17% faster spread out).
inline void prefetch_head_rows(const uint16_t* p, int64_t rows, int64_t D) {
  for (int64_t off = 0; off < rows * D; off += 32) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T1);
}

struct PvArgs {
  const uint16_t* vp;
  const int64_t* table;
  const uint16_t* const* ahead;  // per V block: what to prefetch while reading it (null: nothing)
  const uint16_t* probs;         // [G][len2] bf16
  const float* inv;              // per query head: 1 / softmax denominator
  float* acc;                    // [G][D] out, head dims in order
  int64_t blk_stride, head_stride, h, bs, len, len2, nblk, j0;
  bool prefetch;
};

// p.v for query heads j0 .. j0+J-1: two keys per vdpbf16ps, the pair of V rows interleaved in
// registers (unpacklo/hi of 16-bit words), J x D/16 float accumulators in registers.
// One step of p.v: keys (t, t + 1) of rows r0 (n_left >= 1 rows from r0 on) for J query heads whose
// probabilities start at probs (row stride len2): two keys per vdpbf16ps, the pair of V rows
// interleaved in registers (unpacklo/hi of 16-bit words), into a[J][D/16].
template <int D, int J>
inline void pv_step(__m512 (&a)[J][D / 16], const uint16_t* r0, int64_t n_left, const uint16_t* probs, int64_t len2,
                    int64_t t) {
  constexpr int C = D / 32, V = D / 16;
  __m512i w[V];
  for (int c = 0; c < C; ++c) {
    const __m512i x0 = _mm512_loadu_si512(r0 + c * 32);
    // the key after the last is not read: its p is 0 but its row may hold anything
    const __m512i x1 = n_left > 1 ? _mm512_loadu_si512(r0 + D + c * 32) : _mm512_setzero_si512();
    w[2 * c] = _mm512_unpacklo_epi16(x0, x1);
    w[2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
  }
  for (int j = 0; j < J; ++j) {
    const __m512bh pp = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(probs + j * len2 + t));
    for (int v = 0; v < V; ++v) a[j][v] = _mm512_dpbf16_ps(a[j][v], pp, (__m512bh)w[v]);
  }
}

// pv_step's accumulator lanes (D/16 vectors of 16 floats) times `scale`, into head dims in order:
// lane 4k + e of accumulator (c, half) holds head dim 32c + 8k + 4 half + e.
template <int D>
inline void lanes_to_dims(const float* lanes, float scale, float* dims) {
  for (int v = 0; v < D / 16; ++v) {
    const int c = v / 2, half = v % 2;
    for (int k = 0; k < 4; ++k)
      for (int e = 0; e < 4; ++e) dims[32 * c + 8 * k + 4 * half + e] = lanes[v * 16 + 4 * k + e] * scale;
  }
}

// p.v for query heads j0 .. j0+J-1 over all V blocks, J x D/16 float accumulators in registers.
template <int D, int J>
void pv_pass(const PvArgs& x) {
  constexpr int V = D / 16;
  __m512 a[J][V];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) a[j][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nblk; ++b) {
    const uint16_t* vb = x.vp + x.table[b] * x.blk_stride + x.h * x.head_stride;
    const int64_t n = std::min(x.bs, x.len - b * x.bs);
    const uint16_t* ahead = x.prefetch ? x.ahead[b] : nullptr;
    for (int64_t i = 0; i < n; i += 2) {
      if (ahead != nullptr) prefetch_head_rows(ahead + i * D, 2, D);
      pv_step<D, J>(a, vb + i * D, n - i, x.probs + x.j0 * x.len2, x.len2, b * x.bs + i);
    }
    if (ahead != nullptr && n < x.bs) prefetch_head_rows(ahead + n * D, x.bs - n, D);
  }
  for (int j = 0; j < J; ++j) {
    alignas(64) float lanes[D];
    for (int v = 0; v < V; ++v) _mm512_store_ps(lanes + v * 16, a[j][v]);
    lanes_to_dims<D>(lanes, x.inv[x.j0 + j], x.acc + (x.j0 + j) * D);
  }
}

// p.v of all G query heads, as many heads per pass over V as keep their accumulators in registers.
template <int D>
void pv_all_heads(PvArgs args, int64_t G) {
  constexpr int V = D / 16;
  constexpr int JC = V >= 16 ? 1 : 16 / V;
  for (int64_t j0 = 0; j0 < G; j0 += JC) {
    args.j0 = j0;
    args.prefetch = j0 == 0;
    switch (std::min<int64_t>(JC, G - j0)) {
      case 1: pv_pass<D, 1>(args); break;
      case 2: if constexpr (JC >= 2) pv_pass<D, 2>(args); break;
      case 3: if constexpr (JC >= 3) pv_pass<D, 3>(args); break;
      case 4: if constexpr (JC >= 4) pv_pass<D, 4>(args); break;
      case 5: if constexpr (JC >= 5) pv_pass<D, 5>(args); break;
      case 6: if constexpr (JC >= 6) pv_pass<D, 6>(args); break;
      case 7: if constexpr (JC >= 7) pv_pass<D, 7>(args); break;
      default: if constexpr (JC >= 8) pv_pass<D, 8>(args); break;
    }
  }
}

// p.v of one (sequence, kv head) item's G query heads from their bf16 probabilities P [G][len2] and
// 1 / sums inv, then the output rows; both per-head paths end with it. V blocks 0 and 1 were asked
// for during the last K blocks; V block b asks for block nblk + b + 2 of the stream, so the next
// item's first K block comes during this item's last V blocks (cold otherwise: +2% with huge pages).
template <int D>
void pv_and_store(const Geometry& g, const BlockStream& stream, int64_t s, int64_t len, int64_t len2,
                  const uint16_t* P, const float* inv, uint16_t* op, std::vector<float>& acc,
                  std::vector<const uint16_t*>& ahead_buf) {
  const int64_t G = g.group, nblk = stream.nblk;
  ahead_buf.resize(nblk);
  for (int64_t b = 0; b < nblk; ++b) ahead_buf[b] = stream.at(nblk + b + 2);
  acc.resize(G * D);
  pv_all_heads<D>(PvArgs{stream.vp, stream.table, ahead_buf.data(), P, inv, acc.data(), g.blk_stride, g.head_stride,
                         stream.h, g.block_size, len, len2, nblk, 0, true},
                  G);
  for (int64_t j = 0; j < G; ++j) {
    uint16_t* o = op + (s * g.num_heads + stream.h * G + j) * D;
    for (int c = 0; c < D / 16; ++c) store_float_as_bf16x16(o + c * 16, _mm512_loadu_ps(acc.data() + j * D + c * 16));
  }
}

// Raw scores of one query (qv: D/32 registers) against 16 consecutive key rows k (row stride D),
// in registers throughout (a loop with a per-key bound kept the 16 sums on the stack and took
// ~2x the time); kPrefetch: also requests the same rows of `ahead` and `next` (either may be null).
template <int D, bool kPrefetch>
inline __m512 qk16(const uint16_t* k, const __m512bh* qv, const uint16_t* ahead, const uint16_t* next) {
  constexpr int C = D / 32;
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if constexpr (kPrefetch) {
      if (ahead != nullptr) prefetch_head_rows(ahead + i * D, 1, D);
      if (next != nullptr) prefetch_head_rows(next + i * D, 1, D);
    }
    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k + i * D));
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(k + i * D + c * 32));
    a[i] = s;
  }
  return sum16(a);
}

// bf16, head_dim D in {32, 64, 128, 256}, without AMX: q.k with vdpbf16ps straight from the cache
// (products of two bf16 are exact in float), 16 keys at a time summed by sum16; softmax in float;
// p.v as in the AMX path (pv_pass: two keys per vdpbf16ps, p rounded to bf16). Widening V to float
// and one FMA per key and 16 dims instead took ~2x the instructions (AMD Zen 4).
// Scratch (`scores`): raw scores [G][len] float, then probs [G][len2] bf16.
template <int D>
void attend_bf16(const Geometry& g, int64_t s, int64_t h, int64_t len, const uint16_t* qp, const uint16_t* kp,
                 const uint16_t* vp, uint16_t* op, const int64_t* table, float scale, std::vector<float>& scores,
                 std::vector<float>& acc, std::vector<const uint16_t*>& ahead_buf, const uint16_t* next_k) {
  constexpr int C = D / 32;
  const int64_t G = g.group, bs = g.block_size, len2 = (len + 1) / 2 * 2;
  // Scratch: scores, probs, then the G softmax normalizers (no stack array sized by a head count).
  const int64_t inv_at = G * len + (G * len2 + 1) / 2 + 16;
  scores.resize(inv_at + G);
  float* S = scores.data();
  uint16_t* P = reinterpret_cast<uint16_t*>(S + G * len);
  float* inv = S + inv_at;
  const uint16_t* q0 = qp + s * g.q_stride + h * G * D;  // the group's G query rows, adjacent
  const int64_t nblk = (len + bs - 1) / bs;
  const BlockStream stream{g, kp, vp, table, h, nblk, next_k};
  // Rows n .. bs-1 of the blocks prefetched row by row while a partial block of n rows was read.
  auto prefetch_rest = [&](const uint16_t* p, int64_t n) {
    if (p != nullptr && n < bs) prefetch_head_rows(p + n * D, bs - n, D);
  };
  // With blocks of a multiple of 16 rows every group of 16 keys lies in one block and all 16 rows
  // exist (rows past len are stale: their scores are not stored), so groups take qk16.
  const bool whole_groups = bs % 16 == 0;
  for (int64_t b = 0; b < nblk; ++b) {
    const uint16_t* kb = kp + g.head_block(table[b], h);
    const int64_t n = std::min(bs, len - b * bs);
    const uint16_t* ahead = stream.at(b + 2);
    const uint16_t* next = b == 0 ? stream.at(1) : nullptr;  // no earlier block asked for block 1
    for (int64_t j = 0; j < G; ++j) {
      __m512bh qv[C];
      for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q0 + j * D + c * 32);
      float* sj = S + j * len + b * bs;
      for (int64_t i0 = 0; i0 < n; i0 += 16) {  // 16 keys' dot products, summed by one transpose tree
        const int64_t m = std::min<int64_t>(16, n - i0);
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
        if (whole_groups) {
          // the first query head's pass requests the same rows of the blocks ahead
          const __m512 sc = j == 0 ? qk16<D, true>(kb + i0 * D, qv, ahead ? ahead + i0 * D : nullptr,
                                                    next ? next + i0 * D : nullptr)
                                   : qk16<D, false>(kb + i0 * D, qv, nullptr, nullptr);
          _mm512_mask_storeu_ps(sj + i0, mask, sc);
          continue;
        }
        __m512 a[16];
        for (int64_t i = 0; i < 16; ++i) {
          a[i] = _mm512_setzero_ps();
          if (i >= m) continue;
          if (j == 0) {
            if (ahead != nullptr) prefetch_head_rows(ahead + (i0 + i) * D, 1, D);
            if (next != nullptr) prefetch_head_rows(next + (i0 + i) * D, 1, D);
          }
          const uint16_t* kt = kb + (i0 + i) * D;
          for (int c = 0; c < C; ++c) a[i] = _mm512_dpbf16_ps(a[i], qv[c], (__m512bh)_mm512_loadu_si512(kt + c * 32));
        }
        _mm512_mask_storeu_ps(sj + i0, mask, sum16(a));
      }
    }
    const int64_t asked = whole_groups ? (n + 15) / 16 * 16 : n;  // rows of the blocks ahead requested so far
    prefetch_rest(ahead, asked);
    prefetch_rest(next, asked);
  }
  for (int64_t j = 0; j < G; ++j) inv[j] = probs_bf16(S + j * len, len, len2, scale, P + j * len2);
  pv_and_store<D>(g, stream, s, len, len2, P, inv, op, acc, ahead_buf);
}

// p.v of rows 0 .. n-1 of one block of one kv head for its J query heads, the accumulators (pv_step's
// lane order) kept in acc [J][D] between blocks; rows of `ahead` (may be null) requested meanwhile.
template <int D, int J>
inline void pv_block(const uint16_t* vb, int64_t n, const uint16_t* probs, int64_t len2, float* acc,
                     const uint16_t* ahead) {
  constexpr int V = D / 16;
  __m512 a[J][V];
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) a[j][v] = _mm512_loadu_ps(acc + (j * V + v) * 16);
  for (int64_t i = 0; i < n; i += 2) {
    if (ahead != nullptr) prefetch_head_rows(ahead + i * D, 2, D);
    pv_step<D, J>(a, vb + i * D, n - i, probs, len2, i);
  }
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (j * V + v) * 16, a[j][v]);
}

// One sequence, all its kv heads, block by block: each block's K (then V) rows of all heads are one
// contiguous run, and the block pool places a sequence's blocks one after another, so the reads
// are long sequential streams instead of one head's 2 KB out of every block (Zen 4, 200 sequences,
// kernel_ab: 1.76 -> 1.41 ms per layer with blocks placed so, 2.02 -> 1.89 scattered). While a
// block is read the same rows of the next block of the stream are requested (K blocks, V blocks,
// the next sequence's first K block): without that 1.47 -> 1.96 ms; two blocks ahead measured the
// same. Needs block_size a multiple of 16 and the group's accumulators in registers (G * D / 16 <= 16).
template <int D, int G>
void attend_seq_bf16(const Geometry& g, int64_t s, int64_t len, const uint16_t* qp, const uint16_t* kp,
                     const uint16_t* vp, uint16_t* op, const int64_t* table, float scale, std::vector<float>& scores,
                     std::vector<float>& acc, const uint16_t* next_k) {
  constexpr int C = D / 32, V = D / 16;
  const int64_t H = g.num_kv_heads, NH = g.num_heads, bs = g.block_size, len2 = (len + 1) / 2 * 2;
  // Scratch: scores, probs, then the NH softmax normalizers. NH is any number of query heads
  // (a fixed float[64] here overflowed the stack past 64).
  const int64_t inv_at = NH * len + (NH * len2 + 1) / 2 + 16;
  scores.resize(inv_at + NH);
  float* S = scores.data();
  uint16_t* P = reinterpret_cast<uint16_t*>(S + NH * len);
  float* inv = S + inv_at;
  const uint16_t* q0 = qp + s * g.q_stride;
  const int64_t nblk = (len + bs - 1) / bs;
  // the stream of whole blocks: K 0 .. nblk-1, V 0 .. nblk-1, then the next sequence's K block 0
  auto at = [&](int64_t pos) -> const uint16_t* {
    if (pos < nblk) return kp + table[pos] * g.blk_stride;
    if (pos < 2 * nblk) return vp + table[pos - nblk] * g.blk_stride;
    return pos == 2 * nblk ? next_k : nullptr;
  };
  for (int64_t b = 0; b < nblk; ++b) {
    const uint16_t* kb = kp + table[b] * g.blk_stride;
    const int64_t n = std::min(bs, len - b * bs);
    const uint16_t* ahead = at(b + 1);
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* kh = kb + h * g.head_stride;
      const uint16_t* ah = ahead ? ahead + h * g.head_stride : nullptr;
      for (int j = 0; j < G; ++j) {
        __m512bh qv[C];
        for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q0 + (h * G + j) * D + c * 32);
        float* sj = S + (h * G + j) * len + b * bs;
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
          const int64_t m = std::min<int64_t>(16, n - i0);
          const __m512 sc = j == 0 ? qk16<D, true>(kh + i0 * D, qv, ah ? ah + i0 * D : nullptr, nullptr)
                                   : qk16<D, false>(kh + i0 * D, qv, nullptr, nullptr);
          _mm512_mask_storeu_ps(sj + i0, static_cast<__mmask16>((1u << m) - 1), sc);
        }
      }
      if (ah != nullptr && (n + 15) / 16 * 16 < bs) prefetch_head_rows(ah + (n + 15) / 16 * 16 * D, bs - (n + 15) / 16 * 16, D);
    }
  }
  for (int64_t r = 0; r < NH; ++r) inv[r] = probs_bf16(S + r * len, len, len2, scale, P + r * len2);
  acc.assign(NH * D, 0.f);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint16_t* vb = vp + table[b] * g.blk_stride;
    const int64_t n = std::min(bs, len - b * bs);
    const uint16_t* ahead = at(nblk + b + 1);
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* ah = ahead ? ahead + h * g.head_stride : nullptr;
      pv_block<D, G>(vb + h * g.head_stride, n, P + h * G * len2 + b * bs, len2, acc.data() + h * G * D, ah);
      if (ah != nullptr && n < bs) prefetch_head_rows(ah + (n + 1) / 2 * 2 * D, bs - (n + 1) / 2 * 2, D);
    }
  }
  for (int64_t r = 0; r < NH; ++r) {
    alignas(64) float o[D];
    lanes_to_dims<D>(acc.data() + r * D, inv[r], o);
    uint16_t* out = op + (s * NH + r) * D;
    for (int v = 0; v < V; ++v) store_float_as_bf16x16(out + v * 16, _mm512_load_ps(o + v * 16));
  }
}

using SeqKernel = void (*)(const Geometry&, int64_t, int64_t, const uint16_t*, const uint16_t*, const uint16_t*,
                           uint16_t*, const int64_t*, float, std::vector<float>&, std::vector<float>&, const uint16_t*);

// attend_seq_bf16 for this group size, or null where its accumulators would not fit in registers.
template <int D>
SeqKernel seq_kernel_for(int64_t G) {
  constexpr int kMaxG = 256 / D;  // G * D / 16 <= 16 accumulators
  switch (G) {
    case 1: return attend_seq_bf16<D, 1>;
    case 2: if constexpr (kMaxG >= 2) return attend_seq_bf16<D, 2>; break;
    case 3: if constexpr (kMaxG >= 3) return attend_seq_bf16<D, 3>; break;
    case 4: if constexpr (kMaxG >= 4) return attend_seq_bf16<D, 4>; break;
    case 5: if constexpr (kMaxG >= 5) return attend_seq_bf16<D, 5>; break;
    case 6: if constexpr (kMaxG >= 6) return attend_seq_bf16<D, 6>; break;
    case 7: if constexpr (kMaxG >= 7) return attend_seq_bf16<D, 7>; break;
    case 8: if constexpr (kMaxG >= 8) return attend_seq_bf16<D, 8>; break;
    default: break;
  }
  return nullptr;
}

inline SeqKernel seq_kernel(int64_t D, int64_t G) {
  switch (D) {
    case 32: return seq_kernel_for<32>(G);
    case 64: return seq_kernel_for<64>(G);
    case 128: return seq_kernel_for<128>(G);
    default: return seq_kernel_for<256>(G);
  }
}
#endif

#if PAGEDLLM_AMX
// Tiles of the decode kernel's q.k product (its own configuration, loaded per thread per call):
// tile 0 = A, 16 keys x 32 dims of K read in place (row stride D); tiles 2, 3 = B, the group's
// G query rows for 32 dims in pair-interleaved form (16 pair-rows x G x 2); tile 4 = C, 16 keys
// x G scores. One product does the G queries' dot products with 16 keys: no horizontal sums.
inline TileConfig decode_tiles(int64_t G) {
  TileConfig cfg;
  for (int t : {0, 2, 3, 4}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(t == 0 ? 64 : 4 * G);
  }
  return cfg;
}

// bf16, D in {32, 64, 128, 256}, G <= 16, block size a multiple of 16. q.k on AMX tiles (above);
// softmax in float; p.v with vdpbf16ps on pairs of V rows interleaved in registers (two keys per
// product), p rounded to bf16 as HF's bf16 attention rounds its probabilities before p @ v. The
// pair interleave permutes the head dims inside each accumulator; the epilogue puts them back.
// Scratch (`scores`): scores [len16][G] float, probs [G][len2] bf16, then each head's scores [G][len16].
template <int D>
void attend_bf16_amx(const Geometry& g, int64_t s, int64_t h, int64_t len, const uint16_t* qp, const uint16_t* kp,
                     const uint16_t* vp, uint16_t* op, const int64_t* table, float scale, std::vector<float>& scores,
                     std::vector<float>& acc, std::vector<float>& qt_buf, std::vector<const uint16_t*>& ahead_buf,
                     const uint16_t* next_k) {
  constexpr int C = D / 32;
  const int64_t G = g.group, bs = g.block_size;
  const int64_t len16 = (len + 15) / 16 * 16, len2 = (len + 1) / 2 * 2;
  const int64_t nblk = (len + bs - 1) / bs;
  const uint16_t* q0 = qp + s * g.q_stride + h * G * D;
  // B operands: qt[c][i][j] = dims (32c + 2i, 32c + 2i + 1) of query head j, as one 32-bit pair.
  qt_buf.resize(C * 16 * G);
  uint32_t* qt = reinterpret_cast<uint32_t*>(qt_buf.data());
  for (int64_t j = 0; j < G; ++j) {
    const uint32_t* qj = reinterpret_cast<const uint32_t*>(q0 + j * D);
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 16; ++i) qt[(c * 16 + i) * G + j] = qj[c * 16 + i];
  }
  // scores [len16][G] float, then probs [G][len2] bf16 behind them in the same buffer
  const int64_t prob_floats = (G * len2 + 1) / 2 + 16;
  scores.resize(2 * len16 * G + prob_floats);
  float* S = scores.data();
  uint16_t* P = reinterpret_cast<uint16_t*>(S + len16 * G);
  const BlockStream stream{g, kp, vp, table, h, nblk, next_k};
  if constexpr (C <= 2) {  // the query tiles stay loaded for the whole item (tiles 2 and 3)
    _tile_loadd(2, qt, G * 4);
    if constexpr (C == 2) _tile_loadd(3, qt + 16 * G, G * 4);
  }
  // Keys in groups of 16 (block_size is a multiple of 16, so a group lies in one block). (Two
  // groups at a time in separate tiles measured no different: the products wait on their loads
  // and latencies, not on the tile unit's throughput.) Rows past len in the last group are stale
  // rows of its block: their scores land in rows >= len of S, which nothing reads.
  const int64_t ngroups = len16 / 16;
  auto group_rows = [&](int64_t gi) { return kp + g.head_block(table[gi * 16 / bs], h) + gi * 16 % bs * D; };
  // While reading a group, the same rows two blocks ahead in the stream are asked for (and block 1
  // during block 0); the last group also asks for the rest of those blocks.
  auto prefetch_group = [&](int64_t gi) {
    const int64_t b = gi * 16 / bs, r = gi * 16 % bs, rows = gi + 1 == ngroups ? bs - r : 16;
    if (const uint16_t* ahead = stream.at(b + 2)) prefetch_head_rows(ahead + r * D, rows, D);
    if (b == 0 && nblk > 1) prefetch_head_rows(stream.at(1) + r * D, rows, D);
  };
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    prefetch_group(gi);
    const uint16_t* k0 = group_rows(gi);
    _tile_zero(4);
    for (int c = 0; c < C; ++c) {
      if constexpr (C > 2) _tile_loadd(2, qt + c * 16 * G, G * 4);
      _tile_loadd(0, k0 + c * 32, D * 2);
      if (C > 2 || c == 0)
        _tile_dpbf16ps(4, 0, 2);
      else
        _tile_dpbf16ps(4, 0, 3);
    }
    _tile_stored(4, S + gi * 16 * G, G * 4);
  }
  // Softmax per query head: the strided scores gathered 16 keys at a time into a row of their
  // own (ST [G][len16]), then probs_bf16 on that row.
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(G)));
  float* ST = reinterpret_cast<float*>(P) + prob_floats;
  float inv[16];
  for (int64_t j = 0; j < G; ++j) {
    float* sj = ST + j * len16;
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 mk = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
      _mm512_storeu_ps(sj + t, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, S + t * G + j, 4));
    }
    inv[j] = probs_bf16(sj, len, len2, scale, P + j * len2);
  }
  pv_and_store<D>(g, stream, s, len, len2, P, inv, op, acc, ahead_buf);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_AVX2_F32 1
// float32 on AVX2 + FMA (the float path of CPUs without AVX512, e.g. AMD Zen 3).
//
// A work item is one chunk of keys of one kv head for one row, or for a group of rows of one
// sequence at consecutive positions (a float32 prefill chunk or a verifying pass, attended as
// decode rows, whose chunks fall alike): each key of the chunk is then read and widened once for
// a pass of kQkHeads of the group's queries. A long row's keys are split into chunks so that a
// batch of one (num_kv_heads items: 3 for 2 threads) still balances; the split depends on the
// row's length alone (never on the batch, its group or the thread count), and its chunks are
// merged in order, so a row's output is the same bits however it is batched: alone, in a group,
// as a decode or as a prefill row. Per chunk: q.k of 8 keys at
// a time (8 accumulators, one transpose-and-add tree for their 8 sums), softmax in float (two
// passes over the chunk's scores, kept in thread-local scratch), then p.v with the accumulators
// of up to 3 queries x 32 dims in registers.

// Chunks of about kChunkKeys keys (a multiple of 16, so groups of 8 keys stay aligned to blocks
// of 8 or 16 rows), all of a row's the same size but the last. Smaller chunks balance better but
// cost a (max, sum, acc) merge each.
constexpr int64_t kChunkKeys = 128;

struct ChunkPlan {
  int64_t n, len;  // number of chunks; keys per chunk (the last may be shorter)
  bool operator==(const ChunkPlan& o) const { return n == o.n && len == o.len; }
};
inline ChunkPlan chunk_plan(int64_t len) {
  int64_t n = std::max<int64_t>(1, (len + kChunkKeys - 1) / kChunkKeys);
  const int64_t per = std::max<int64_t>(16, ((len + n - 1) / n + 15) / 16 * 16);
  n = std::max<int64_t>(1, (len + per - 1) / per);  // rounding up per may leave the last chunk empty
  return {n, per};
}
// Queries (rows x query heads) of one work item at most.
constexpr int64_t kItemQueries = 24;

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

// Rows of one kv head contiguous in one block.
template <typename KV>
struct F32Run {
  const KV* p;
  int64_t rows;
};

// One chunk [t0, t1) of the keys of kv head h for G queries (rows qs[j], unscaled; query j sees
// the chunk's first nq[j] >= 1 keys, the longest all of them). Leaves the unnormalized p.v in
// acc [G][D], each query's scaled max score in mx and its sum of e^(s - max) in sum: per query
// the same operations in the same order whichever queries come with it. S: scratch [G][ss],
// ss >= t1 - t0 + 8. next: the first K run of the thread's
// next item (null: none), asked for during this item's last V runs. int8: sc its scales, and
// KS: scratch [2][ss] for the chunk's K and V scales in key order.
template <int D, typename KV>
void attend_f32_chunk(const Geometry& g, const float* const* qs, const int64_t* nq, int64_t G, const KV* kp,
                      const KV* vp, const int64_t* table, int64_t h, int64_t t0, int64_t t1, float scale, float* S,
                      int64_t ss, float* acc, float* mx, float* sum, F32Run<KV> next, KvScales sc, float* KS) {
  using Run = F32Run<KV>;
  const int64_t bs = g.block_size, n = t1 - t0;
  // int8 scaled per group of values (NG per row) rather than per row: the groups' scales are
  // applied inside the dots (qk8_grouped) and per group of dims in p.v (pv_run), not per key
  constexpr int NG = kScaled<KV> ? static_cast<int>(int8_scale_groups(D)) : 1;
  constexpr bool kGrouped = NG > 1;
  scale *= kLoadScale<KV>;  // the scores of keys read at 1 / kLoadScale
  // The chunk's keys as nr runs; run k starts at key tk (t - t0 into the scores).
  const int64_t b0 = t0 / bs, nr = (t1 - 1) / bs - b0 + 1;
  auto run_key = [&](int64_t k) { return k == 0 ? t0 : (b0 + k) * bs; };
  auto run_of = [&](const KV* base, int64_t k) {
    const int64_t t = run_key(k);
    return Run{base + g.head_block(table[b0 + k], h) + t % bs * D, std::min(bs - t % bs, t1 - t)};
  };
  // The runs in the order they are read (K runs, V runs, the next item's first K run): what to
  // ask for two runs ahead of the one being read.
  auto stream = [&](int64_t pos) {
    if (pos < nr) return run_of(kp, pos);
    if (pos < 2 * nr) return run_of(vp, pos - nr);
    return pos == 2 * nr ? next : Run{nullptr, 0};
  };
  // The chunk's scales (a line per run), asked for now and read after the K runs below: its
  // blocks are scattered, so each line is a miss of its own; unasked, the 16 x 8k decode of the
  // 1.7B shape took 31.4 ms instead of 26.6 (Zen 5).
  if constexpr (kScaled<KV>) {
    for (int64_t k = 0; k < nr; ++k) {
      const int64_t t = run_key(k), at = (g.scale_block(table[b0 + k], h) + t % bs) * NG;
      if constexpr (kGrouped) {  // every line of the run's scales (16 per line)
        const int64_t end = at + std::min(bs - t % bs, t1 - t) * NG;
        for (int64_t x = at & ~int64_t{15}; x < end; x += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(sc.k + x), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(sc.v + x), _MM_HINT_T0);
        }
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(sc.k + at), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sc.v + at), _MM_HINT_T0);
      }
    }
  }
  for (int64_t k = 0; k < nr; ++k) {
    const Run run = run_of(kp, k), ahead = stream(k + 2), second = k == 0 ? stream(1) : Run{nullptr, 0};
    const int64_t r = run_key(k) % bs, at = run_key(k) - t0, m = run.rows;
    // Heads kQkHeads at a time where the keys are not scaled per group: one widening of each key
    // for all of them (qk8_heads), the rest one by one.
    int64_t j = 0;
    if constexpr (!kGrouped && kQkHeads > 1) {
      for (; j + kQkHeads <= G; j += kQkHeads) {
        const float* const* qj = qs + j;
        for (int64_t i0 = 0; i0 < m; i0 += 8) {
          if (j == 0) {  // the first pass asks for the rows ahead, spread over its groups
            if (ahead.p != nullptr) prefetch_rows<D>(ahead.p, i0, std::min(i0 + 8, ahead.rows));
            if (second.p != nullptr) prefetch_rows<D>(second.p, i0, std::min(i0 + 8, second.rows));
          }
          __m256 x[kQkHeads];
          if (r + i0 + 8 <= bs) qk8_heads<D, true>(run.p + i0 * D, qj, 8, x);
          else qk8_heads<D, false>(run.p + i0 * D, qj, static_cast<int>(m - i0), x);
          for (int u = 0; u < kQkHeads; ++u) _mm256_storeu_ps(S + (j + u) * ss + at + i0, x[u]);
        }
      }
    }
    for (; j < G; ++j) {
      const float* qj = qs[j];
      float* sj = S + j * ss + at;
      // 8 lanes stored per group: the lanes past the run are overwritten by the next run, or are
      // the padding past the chunk. Rows past the run but inside the block are read (stale rows
      // of the last block, or the next chunk's); a group reaching past the block is not.
      for (int64_t i0 = 0; i0 < m; i0 += 8) {
        if (j == 0) {  // the first head's pass asks for the rows ahead, spread over its groups
          if (ahead.p != nullptr) prefetch_rows<D>(ahead.p, i0, std::min(i0 + 8, ahead.rows));
          if (second.p != nullptr) prefetch_rows<D>(second.p, i0, std::min(i0 + 8, second.rows));
        }
        __m256 x;
        if constexpr (kGrouped) {
          const float* ks = sc.k + (g.scale_block(table[b0 + k], h) + r + i0) * NG;
          x = r + i0 + 8 <= bs ? qk8_grouped<D, true>(run.p + i0 * D, qj, 8, ks)
                               : qk8_grouped<D, false>(run.p + i0 * D, qj, static_cast<int>(m - i0), ks);
        } else {
          x = r + i0 + 8 <= bs ? qk8<D, true>(run.p + i0 * D, qj, 8)
                               : qk8<D, false>(run.p + i0 * D, qj, static_cast<int>(m - i0));
        }
        _mm256_storeu_ps(sj + i0, x);
      }
    }
    const int64_t asked = (m + 7) / 8 * 8;  // rows of the runs ahead asked for so far
    if (ahead.p != nullptr && ahead.rows > asked) prefetch_rows<D>(ahead.p, asked, ahead.rows);
    if (second.p != nullptr && second.rows > asked) prefetch_rows<D>(second.p, asked, second.rows);
  }
  float *ksc = KS, *vsc = KS + ss;  // int8: the chunk's K and V scales, key t - t0 at t - t0
  if constexpr (kScaled<KV> && !kGrouped) {
    for (int64_t k = 0; k < nr; ++k) {
      const int64_t t = run_key(k), rows = std::min(bs - t % bs, t1 - t);
      const int64_t at = g.scale_block(table[b0 + k], h) + t % bs;
      std::copy(sc.k + at, sc.k + at + rows, ksc + (t - t0));
      std::copy(sc.v + at, sc.v + at + rows, vsc + (t - t0));
    }
    std::fill(ksc + n, ksc + (n + 7) / 8 * 8, 0.f);  // the lanes past the chunk
    std::fill(vsc + n, vsc + (n + 7) / 8 * 8, 0.f);
  }
  const __m256 vscale = _mm256_set1_ps(scale), vunit = _mm256_set1_ps(kLoadScale<KV>);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < G; ++j) {
    float* sj = S + j * ss;
    const int64_t nj = nq[j];  // this query's keys: the first nj of the chunk
    __m256 vm = _mm256_set1_ps(-3.0e38f);
    for (int64_t t = 0; t < nj; t += 8) {
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nj - t)), iota));
      __m256 x = _mm256_loadu_ps(sj + t);
      if constexpr (kScaled<KV> && !kGrouped) {  // the score: the key's scale times q . k
        x = _mm256_mul_ps(x, _mm256_loadu_ps(ksc + t));
        _mm256_storeu_ps(sj + t, x);
      }
      vm = _mm256_max_ps(vm, _mm256_blendv_ps(_mm256_set1_ps(-3.0e38f), x, live));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4) * scale;
    const __m256 vmx = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (int64_t t = 0; t < nj; t += 8) {
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nj - t)), iota));
      const __m256 e = _mm256_and_ps(exp8(_mm256_fmsub_ps(_mm256_loadu_ps(sj + t), vscale, vmx)), live);
      if constexpr (kScaled<KV> && !kGrouped)
        _mm256_storeu_ps(sj + t, _mm256_mul_ps(e, _mm256_loadu_ps(vsc + t)));  // p.v reads V unscaled
      else
        _mm256_storeu_ps(sj + t, kLoadScale<KV> == 1.f ? e : _mm256_mul_ps(e, vunit));  // V is read at 1 / kLoadScale
      vs = _mm256_add_ps(vs, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    mx[j] = m;
    sum[j] = _mm_cvtss_f32(s4);
    // p.v runs over the chunk's n keys for every query: a shorter query's keys past its own
    // weigh exactly 0 (its sums are its own keys' alone, as had it run alone)
    for (int64_t t = (nj + 7) / 8 * 8; t < n; ++t) sj[t] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t k = 0; k < nr; ++k) {
    const Run run = stream(nr + k), ahead = stream(nr + k + 2);
    const float* pr = S + run_key(k) - t0;
    const int64_t m = run.rows;
    // the first pass over the run asks for the run two ahead, a row per row read
    const KV* pf = ahead.p;
    constexpr int W = D >= 32 ? 4 : D / 8;
    // int8 per group: the run's V scales, and the group of dim c
    const float* vs = kGrouped ? sc.v + (g.scale_block(table[b0 + k], h) + run_key(k) % bs) * NG : nullptr;
    constexpr int GroupDims = D / NG;
    if (D >= 64 && G == 1) {  // one head: 8 accumulators (64 dims) for enough independent FMA chains
      for (int c = 0; c < D; c += 64) {
        pv_run<D, (D >= 64 ? 8 : W), 1, KV, NG>(run.p + c, m, pr, ss, acc + c, pf, ahead.rows, vs, c / GroupDims);
        pf = nullptr;
      }
    } else {
      for (int c = 0; c < D; c += 8 * W) {
        // heads 3 at a time (12 accumulators, 3 broadcasts, 1 V vector: the 16 registers), a
        // remainder of 1 taken as 2 + 2 from the last 4 so no pass has only W chains
        for (int64_t j0 = 0; j0 < G;) {
          const int64_t left = G - j0, J = left == 4 ? 2 : std::min<int64_t>(3, left);
          const float* pj = pr + j0 * ss;
          float* aj = acc + j0 * D + c;
          if (J == 3) pv_run<D, W, 3, KV, NG>(run.p + c, m, pj, ss, aj, pf, ahead.rows, vs, c / GroupDims);
          else if (J == 2) pv_run<D, W, 2, KV, NG>(run.p + c, m, pj, ss, aj, pf, ahead.rows, vs, c / GroupDims);
          else pv_run<D, W, 1, KV, NG>(run.p + c, m, pj, ss, aj, pf, ahead.rows, vs, c / GroupDims);
          pf = nullptr;
          j0 += J;
        }
      }
    }
    if (ahead.p != nullptr && ahead.rows > m) prefetch_rows<D>(ahead.p, m, ahead.rows);
  }
}

// Per chunk record of a split (sequence, kv head): mx [G], sum [G], acc [G][D].
inline int64_t chunk_record(int64_t G, int64_t D) { return G * (D + 2); }

// Output rows of G heads from the records of a (sequence, kv head)'s nch chunks, merged in order.
inline void merge_chunks(const float* rec, int64_t nch, int64_t G, int64_t D, float* out) {
  const int64_t R = chunk_record(G, D);
  for (int64_t j = 0; j < G; ++j) {
    float M = rec[j];
    for (int64_t c = 1; c < nch; ++c) M = std::max(M, rec[c * R + j]);
    float L = 0.f;
    float* o = out + j * D;
    for (int64_t c = 0; c < nch; ++c) {
      const float* rc = rec + c * R;
      const float w = std::exp(rc[j] - M);
      L += w * rc[G + j];
      const float* a = rc + 2 * G + j * D;
      if (c == 0) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = w * a[d];
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
    }
    const float inv = 1.f / L;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

template <int D, typename KV>
void decode_f32_avx2(const Geometry& g, int64_t num_seqs, const float* qp, const KV* kp, const KV* vp, float* op,
                     const int64_t* bt, const int64_t* lens, const int64_t* firsts, float scale, KvScales sc) {
  using Run = F32Run<KV>;
  const int64_t H = g.num_kv_heads, G = g.group, R = chunk_record(G, D), bs = g.block_size, MB = g.max_blocks;
  // Rows per group: enough for the group's queries to fill whole passes of kQkHeads (each key
  // widened once per pass), no more: a larger group widens as often and balances worse.
  const int64_t max_rows = G % kQkHeads == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(kQkHeads, kItemQueries / G));
  const int64_t ss = kChunkKeys + 8;
  // Row s's keys are firsts[s] .. lens[s] - 1 (a sliding window's start, or 0), in the chunks of plan(s).
  auto plan = [&](int64_t s) { return chunk_plan(lens[s] - firsts[s]); };
  // Groups of rows: s joins the group of s - 1 when it is the next position of the same sequence
  // (one more key, the same blocks), neither has a window and their chunks fall alike (the same
  // plan). gfirst: each group's first row.
  static thread_local std::vector<int64_t> gfirst, gitem;
  static thread_local std::vector<ChunkPlan> gplan;  // each group's (each of its rows') chunks
  gfirst.clear();
  gplan.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const ChunkPlan p = plan(s);
    const bool joins = s > 0 && s - gfirst.back() < max_rows && firsts[s] == 0 && firsts[s - 1] == 0 &&
                       lens[s - 1] > 0 && lens[s] == lens[s - 1] + 1 && p == gplan.back() &&
                       std::equal(bt + (s - 1) * MB, bt + (s - 1) * MB + (lens[s - 1] + bs - 1) / bs, bt + s * MB);
    if (!joins) {
      gfirst.push_back(s);
      gplan.push_back(p);
    }
  }
  const int64_t ngroups = static_cast<int64_t>(gfirst.size());
  gfirst.push_back(num_seqs);
  const int64_t* gf = gfirst.data();
  const ChunkPlan* gp = gplan.data();
  auto nch = [&](int64_t gi) { return gp[gi].n; };
  // Items (group, kv head, chunk) in that order: a (group, kv head)'s chunks are adjacent, so they
  // mostly land on one thread, which merges them itself.
  gitem.resize(ngroups + 1);
  gitem[0] = 0;
  for (int64_t gi = 0; gi < ngroups; ++gi) gitem[gi + 1] = gitem[gi] + H * nch(gi);
  const int64_t items = gitem[ngroups];
  const int64_t* gi_at = gitem.data();
  auto locate = [&](int64_t item, int64_t& gi, int64_t& h, int64_t& c) {
    gi = std::upper_bound(gi_at, gi_at + ngroups + 1, item) - gi_at - 1;
    const int64_t rel = item - gi_at[gi], n = gp[gi].n;
    h = rel / n;
    c = rel - h * n;
  };
  // Chunk c of group gi: keys [t0, t1) (t1 <= t0: a row with nothing visible), read by its rows
  // from s_lo on (the group's rows are at consecutive lengths: those longer than t0; with one plan,
  // all but where the shortest ends at t0).
  struct Span {
    int64_t t0, t1, s_lo, last;
  };
  auto span = [&](int64_t gi, int64_t c) {
    const int64_t first = gf[gi], last = gf[gi + 1] - 1, t0 = firsts[first] + c * gp[gi].len;
    Span x{t0, std::min(lens[last], t0 + gp[gi].len), first, last};
    while (x.s_lo < last && lens[x.s_lo] <= x.t0) ++x.s_lo;
    return x;
  };
  auto cost = [&](int64_t item) {
    int64_t gi, h, c;
    locate(item, gi, h, c);
    const Span x = span(gi, c);
    return x.t1 > x.t0 ? (x.last - x.s_lo + 1) * (x.t1 - x.t0 + 8) : 8;
  };
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds = balanced_split(items, nthreads, cost);
  auto out_rows = [&](int64_t s, int64_t h) { return op + (s * g.num_heads + h * G) * D; };
  auto first_run = [&](int64_t item) {  // an item's first K run
    int64_t gi, h, c;
    locate(item, gi, h, c);
    const Span x = span(gi, c);
    if (x.t1 <= x.t0) return Run{nullptr, 0};
    const int64_t* table = bt + x.last * MB;
    return Run{kp + g.head_block(table[x.t0 / bs], h) + x.t0 % bs * D, std::min(bs - x.t0 % bs, x.t1 - x.t0)};
  };
  // Each (group, kv head)'s records [rows][chunks][R]: in a thread's own scratch where all its
  // items are that thread's; else (a thread boundary inside its items) in a slot of `split`,
  // merged after the threads are done.
  struct Split {
    int64_t gi, h, at;
  };
  std::vector<Split> split;
  int64_t split_floats = 0;
  for (int64_t k = 1; k < nthreads; ++k) {
    if (bounds[k] >= items) break;
    int64_t gi, h, c;
    locate(bounds[k], gi, h, c);
    if (c == 0 || (!split.empty() && split.back().gi == gi && split.back().h == h)) continue;
    split.push_back({gi, h, split_floats});
    split_floats += (gf[gi + 1] - gf[gi]) * nch(gi) * R;
  }
  static thread_local std::vector<float> split_records;
  if (split_floats > 0) split_records.resize(split_floats);
  float* shared = split_records.data();

  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    static thread_local std::vector<float> scratch, own;
    static thread_local std::vector<const float*> qs;
    static thread_local std::vector<int64_t> nq;
    for (int64_t tid = tb; tid < te; ++tid) {
      for (int64_t item = bounds[tid]; item < bounds[tid + 1]; ++item) {
        int64_t gi, h, c;
        locate(item, gi, h, c);
        const Span x = span(gi, c);
        const int64_t first = gf[gi], n_chunks = nch(gi);
        if (x.t1 <= x.t0) {  // nothing visible: zeros rather than 0 / 0 (a group of that one row)
          for (int64_t s = first; s <= x.last; ++s) std::fill(out_rows(s, h), out_rows(s, h) + G * D, 0.f);
          continue;
        }
        const int64_t rows = x.last - x.s_lo + 1, Q = rows * G;
        qs.resize(Q);
        nq.resize(Q);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < G; ++j) {
            qs[r * G + j] = qp + (x.s_lo + r) * g.q_stride + (h * G + j) * D;
            nq[r * G + j] = std::min(lens[x.s_lo + r], x.t1) - x.t0;
          }
        // where this (group, kv head)'s records go
        const int64_t gh_first = gi_at[gi] + h * n_chunks;
        const bool whole = gh_first >= bounds[tid] && gh_first + n_chunks <= bounds[tid + 1];
        float* recs;
        if (whole) {
          const size_t floats = static_cast<size_t>((x.last - first + 1) * n_chunks * R);
          if (own.size() < floats) own.resize(floats);
          recs = own.data();
        } else {
          const Split* sp = &split[0];
          while (sp->gi != gi || sp->h != h) ++sp;
          recs = shared + sp->at;
        }
        const size_t need = static_cast<size_t>(Q * (ss + D + 2) + (kScaled<KV> ? 2 * ss : 0));
        if (scratch.size() < need) scratch.resize(need);
        float *S = scratch.data(), *acc = S + Q * ss, *mx = acc + Q * D, *sum = mx + Q, *KS = sum + Q;
        float* rec0 = recs + ((x.s_lo - first) * n_chunks + c) * R;
        if (rows == 1) mx = rec0, sum = rec0 + G, acc = rec0 + 2 * G;  // one row: straight into its record
        attend_f32_chunk<D>(g, qs.data(), nq.data(), Q, kp, vp, bt + x.last * MB, h, x.t0, x.t1, scale, S, ss, acc,
                            mx, sum, item + 1 < bounds[tid + 1] ? first_run(item + 1) : Run{nullptr, 0}, sc, KS);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = x.s_lo + r;
          if (rows > 1) {
            float* rec = recs + ((s - first) * n_chunks + c) * R;
            std::copy(mx + r * G, mx + r * G + G, rec);
            std::copy(sum + r * G, sum + r * G + G, rec + G);
            std::copy(acc + r * G * D, acc + (r + 1) * G * D, rec + 2 * G);
          }
          // the row's last chunk, all of them this thread's: merged now
          if (whole && c == n_chunks - 1) merge_chunks(recs + (s - first) * n_chunks * R, n_chunks, G, D, out_rows(s, h));
        }
      }
    }
  });
  // The (group, kv head)s whose chunks were on more than one thread.
  for (const Split& sp : split) {
    const int64_t first = gf[sp.gi], n_chunks = nch(sp.gi);
    for (int64_t s = first; s < gf[sp.gi + 1]; ++s)
      merge_chunks(shared + sp.at + (s - first) * n_chunks * R, n_chunks, G, D, out_rows(s, sp.h));
  }
}

// decode_f32_avx2 for this head_dim; false where there is none.
template <typename KV>
inline bool decode_f32_fast(const Geometry& g, int64_t num_seqs, const float* qp, const KV* kp, const KV* vp,
                            float* op, const int64_t* bt, const int64_t* lens, const int64_t* firsts, float scale,
                            KvScales sc) {
  switch (g.head_dim) {
    case 16: decode_f32_avx2<16, KV>(g, num_seqs, qp, kp, vp, op, bt, lens, firsts, scale, sc); return true;
    case 32: decode_f32_avx2<32, KV>(g, num_seqs, qp, kp, vp, op, bt, lens, firsts, scale, sc); return true;
    case 64: decode_f32_avx2<64, KV>(g, num_seqs, qp, kp, vp, op, bt, lens, firsts, scale, sc); return true;
    case 128: decode_f32_avx2<128, KV>(g, num_seqs, qp, kp, vp, op, bt, lens, firsts, scale, sc); return true;
    case 256: decode_f32_avx2<256, KV>(g, num_seqs, qp, kp, vp, op, bt, lens, firsts, scale, sc); return true;
    default: return false;
  }
}
#else
#define PAGEDLLM_AVX2_F32 0
#endif

// scalar_t: of q and out; kv_t: of the caches (scalar_t, or bf16 / fp16 / fp8 / int8 under float32 q;
// int8 with its scales sc).
template <typename scalar_t, typename kv_t = scalar_t>
void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                 KvScales sc = {}) {
  Geometry g;
  const int64_t num_seqs = q.size(0);
  g.num_heads = q.size(1);
  g.head_dim = q.size(2);
  g.num_kv_heads = k_cache.size(1);
  g.block_size = k_cache.size(2);
  g.group = g.num_heads / g.num_kv_heads;
  g.max_blocks = block_tables.size(1);
  g.head_stride = g.block_size * g.head_dim;
  g.blk_stride = g.num_kv_heads * g.head_stride;
  g.q_stride = q.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  std::vector<int64_t> firsts(num_seqs, 0);  // each sequence's first visible key
  if (window > 0)
    for (int64_t s = 0; s < num_seqs; ++s) firsts[s] = std::max<int64_t>(0, lens[s] - window);
#if PAGEDLLM_AVX2_F32
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (decode_f32_fast(g, num_seqs, qp, kp, vp, op, bt, lens, firsts.data(), fscale, sc)) return;
  }
#endif
  bool fast = false, amx = false;
#if PAGEDLLM_AVX512BF16
  fast = window <= 0 && std::is_same<scalar_t, at::BFloat16>::value && std::is_same<kv_t, scalar_t>::value &&
         g.group <= 64 &&
         (g.head_dim == 32 || g.head_dim == 64 || g.head_dim == 128 || g.head_dim == 256);
#endif
#if PAGEDLLM_AMX
  amx = fast && g.group <= 16 && g.block_size % 16 == 0 && amx_permitted();
  const TileConfig tiles = decode_tiles(g.group);
#endif

#if PAGEDLLM_AVX512BF16
  // Without AMX a sequence (all its kv heads) is one work item, where that still splits evenly: no
  // sequence more than half of a thread's share (else the (sequence, kv head) items below).
  int64_t total_cost = 0, max_cost = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    total_cost += lens[s] + 8;
    max_cost = std::max(max_cost, lens[s] + 8);
  }
  const bool seqs_balance = 2 * max_cost * at::get_num_threads() <= total_cost;
  const SeqKernel per_seq =
      fast && !amx && g.block_size % 16 == 0 && seqs_balance ? seq_kernel(g.head_dim, g.group) : nullptr;
  if (per_seq != nullptr) {
    const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), num_seqs);
    std::vector<int64_t> bounds = balanced_split(num_seqs, nthreads, [&](int64_t s) { return lens[s] + 8; });
    const auto* q16 = reinterpret_cast<const uint16_t*>(qp);
    const auto* k16 = reinterpret_cast<const uint16_t*>(kp);
    const auto* v16 = reinterpret_cast<const uint16_t*>(vp);
    auto* o16 = reinterpret_cast<uint16_t*>(op);
    at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
      std::vector<float> scores, acc;
      for (int64_t tid = tb; tid < te; ++tid)
        for (int64_t s = bounds[tid]; s < bounds[tid + 1]; ++s) {
          const uint16_t* next_k = s + 1 < bounds[tid + 1] ? k16 + bt[(s + 1) * g.max_blocks] * g.blk_stride : nullptr;
          per_seq(g, s, lens[s], q16, k16, v16, o16, bt + s * g.max_blocks, fscale, scores, acc, next_k);
        }
    });
    return;
  }
#endif
  // Cost-balanced split of the (sequence, kv head) items over the threads.
  const int64_t items = num_seqs * g.num_kv_heads;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds = balanced_split(items, nthreads, [&](int64_t it) { return lens[it / g.num_kv_heads] + 8; });

  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> qf, scores, acc, row;
    std::vector<const uint16_t*> ahead;
#if PAGEDLLM_AMX
    if (amx) {
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the config's stores before ldtilecfg reads it
      _tile_loadconfig(&tiles);
    }
#endif
    for (int64_t tid = tb; tid < te; ++tid) {
      for (int64_t item = bounds[tid]; item < bounds[tid + 1]; ++item) {
        const int64_t s = item / g.num_kv_heads, h = item % g.num_kv_heads;
        const int64_t* table = bt + s * g.max_blocks;
        if (fast) {
#if PAGEDLLM_AVX512BF16
          const auto* q16 = reinterpret_cast<const uint16_t*>(qp);
          const auto* k16 = reinterpret_cast<const uint16_t*>(kp);
          const auto* v16 = reinterpret_cast<const uint16_t*>(vp);
          auto* o16 = reinterpret_cast<uint16_t*>(op);
          const uint16_t* next_k = nullptr;
          if (item + 1 < bounds[tid + 1]) {
            const int64_t ns = (item + 1) / g.num_kv_heads, nh = (item + 1) % g.num_kv_heads;
            next_k = k16 + g.head_block(bt[ns * g.max_blocks], nh);
          }
#if PAGEDLLM_AMX
          if (amx) {
            switch (g.head_dim) {
              case 32: attend_bf16_amx<32>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, qf, ahead, next_k); break;
              case 64: attend_bf16_amx<64>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, qf, ahead, next_k); break;
              case 128: attend_bf16_amx<128>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, qf, ahead, next_k); break;
              default: attend_bf16_amx<256>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, qf, ahead, next_k); break;
            }
            continue;
          }
#endif
          switch (g.head_dim) {
            case 32: attend_bf16<32>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, ahead, next_k); break;
            case 64: attend_bf16<64>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, ahead, next_k); break;
            case 128: attend_bf16<128>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, ahead, next_k); break;
            default: attend_bf16<256>(g, s, h, lens[s], q16, k16, v16, o16, table, fscale, scores, acc, ahead, next_k); break;
          }
#endif
        } else {
          attend_generic(g, s, h, firsts[s], lens[s], qp, kp, vp, op, table, fscale, sc, qf, scores, acc, row);
        }
      }
    }
#if PAGEDLLM_AMX
    if (amx) _tile_release();
#endif
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  // q may be a row slice of the fused qkv projection: rows strided, heads contiguous within a row.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous(),
              "paged_decode_attention: bad layout (heads of a row must be contiguous; caches and out contiguous)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out must be like q");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2) &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() ||
                   (q.scalar_type() == torch::kFloat && narrow_kv_cache(k_cache.scalar_type()))),
              "paged_decode_attention: q [seqs, heads, head_dim] and caches [blocks, kv_heads, block_size, head_dim] "
              "of q's dtype, or bfloat16 / float16 / float8 / int8 under float32 q");
  const KvScales sc{int8_cache_scales("paged_decode_attention", k_cache, k_scales),
                    int8_cache_scales("paged_decode_attention", v_cache, v_scales)};
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == q.size(0),
              "paged_decode_attention: one block table row and one length per sequence");
  if (q.size(0) == 0) return;
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  {
    const int64_t* btp = bt.data_ptr<int64_t>();
    const int64_t* lp = sl.data_ptr<int64_t>();
    for (int64_t s = 0; s < q.size(0); ++s)
      check_block_table_row("paged_decode_attention", s, btp + s * bt.size(1), bt.size(1), lp[s], k_cache.size(0),
                            k_cache.size(2), window > 0 ? std::max<int64_t>(0, lp[s] - window) : 0);
  }
  if (q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16) {
    decode_impl<float, at::BFloat16>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else if (q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kHalf) {
    decode_impl<float, at::Half>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else if (q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat8_e4m3fn) {
    decode_impl<float, at::Float8_e4m3fn>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else if (q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat8_e5m2) {
    decode_impl<float, at::Float8_e5m2>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else if (q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kChar) {
    decode_impl<float, int8_t>(out, q, k_cache, v_cache, bt, sl, scale, window, sc);
  } else if (q.scalar_type() == torch::kFloat) {
    decode_impl<float>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<at::BFloat16>(out, q, k_cache, v_cache, bt, sl, scale, window);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}
