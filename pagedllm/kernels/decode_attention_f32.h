// Paged decode attention for float32 queries on AVX2 + FMA + F16C (the float path of GGUF models,
// and of CPUs without AVX512, e.g. AMD Zen 3), over float32 / bf16 / fp16 / fp8 / int8 caches:
// paged_attention.cpp's decode_impl calls decode_f32_fast first. PAGEDLLM_AVX2_F32 says whether
// this build has it.
#pragma once

#include "common.h"
#include "decode_attention_f32_rows.h"
#include "paged_geometry.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

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
  // Chunk c of group gi: keys [t0, t1) of its longest (last) row; t1 <= t0: a row with nothing
  // visible. Every row of the group reads some of them: one plan of n chunks of `len` keys has
  // (n - 1) * len < each row's length.
  struct Span {
    int64_t t0, t1, last;
  };
  auto span = [&](int64_t gi, int64_t c) {
    const int64_t t0 = firsts[gf[gi]] + c * gp[gi].len, last = gf[gi + 1] - 1;
    return Span{t0, std::min(lens[last], t0 + gp[gi].len), last};
  };
  auto cost = [&](int64_t item) {
    int64_t gi, h, c;
    locate(item, gi, h, c);
    const Span x = span(gi, c);
    return x.t1 > x.t0 ? (x.last - gf[gi] + 1) * (x.t1 - x.t0 + 8) : 8;
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
        const int64_t rows = x.last - first + 1, Q = rows * G;
        qs.resize(Q);
        nq.resize(Q);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < G; ++j) {
            qs[r * G + j] = qp + (first + r) * g.q_stride + (h * G + j) * D;
            nq[r * G + j] = std::min(lens[first + r], x.t1) - x.t0;
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
        if (rows == 1) mx = recs + c * R, sum = mx + G, acc = mx + 2 * G;  // one row: straight into its record
        attend_f32_chunk<D>(g, qs.data(), nq.data(), Q, kp, vp, bt + x.last * MB, h, x.t0, x.t1, scale, S, ss, acc,
                            mx, sum, item + 1 < bounds[tid + 1] ? first_run(item + 1) : Run{nullptr, 0}, sc, KS);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t s = first + r;
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

}  // namespace
