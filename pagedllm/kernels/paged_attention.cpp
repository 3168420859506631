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
// float32 queries (GGUF models, CPUs without AVX512) take decode_attention_f32.h's path first.
#include "common.h"
#include "decode_attention_f32.h"
#include "paged_geometry.h"

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
