// Causal prefill attention for the CPU (AMX tiles, or AVX512-BF16 without AMX), all prefill chunks
// of a step in one call.
//
// q:            [T, num_heads, head_dim] bf16 (rows may be strided: a view of the fused qkv output)
// out:          [T, num_heads, head_dim] bf16, contiguous; only the prefill rows are written
// k/v_cache:    [num_blocks, num_kv_heads, block_size, head_dim] bf16, already holding the chunk's K/V
// block_tables: [num_seqs, max_blocks] int64; query_starts / query_lens / context_lens: [num_seqs] int64
// Sequence i's queries are rows query_starts[i] .. + query_lens[i] of q, at positions
// context_lens[i] .. context_lens[i] + query_lens[i] - 1; each sees keys 0 .. its own position, or
// with a sliding window W > 0 only the last W of them (its own included): a sequence's blocks
// before its first query's window are never read (they may be released).
//
// head_dim 64 or 128, block_size a multiple of 16. torch's flash SDPA, called once per sequence, ran at 170-430 GFLOP/s on the prompt lengths of a
// chat workload (it is overhead-bound below ~400 tokens). Here one work item is a (sequence, KV
// head): its keys are transposed and its values pair-interleaved once into the layouts AMX's B
// operand wants, then every 16-query tile of each query head of the group is two tile products:
// S = Q K^T (float), an exact row softmax in float (all keys of a row at once, no online rescaling),
// and O = P V with P rounded to bf16 (as flash attention does on GPUs). Without AMX (AMD Zen 4) the
// same layouts feed vdpbf16ps: a K^T row of 16 keys times a broadcast query pair gives 16 scores,
// a V pair row times a broadcast probability pair 16 output dims (SDPA there: ~50 GFLOP/s).
#include "common.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if PAGEDLLM_AVX512BF16
namespace {

constexpr int TILE = 16;  // query rows per tile (an AMX tile's rows)


struct Work {
  std::vector<uint32_t> kt;   // K^T as bf16 pairs: [D/2][keys_pad]
  std::vector<uint16_t> vv;   // V pair-interleaved: [keys_pad/2][D][2]
  std::vector<float> s;       // scores of one query tile: [16][keys_pad]
  std::vector<uint16_t> p;    // probabilities, bf16: [16][keys_pad]
  std::vector<uint16_t> qpad; // a query tile with fewer than 16 rows, zero-padded
  float o[TILE * 128];        // output tile, float
  int64_t window = 0;         // sliding window of this call (<= 0: none)
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// K^T and V of KV head h of one sequence (seq_len keys, read through its block table), once for
// all query tiles and all G query heads; padding keys are zero. Sizes w.s and w.p for a tile.
template <int D>
void head_layouts(const uint16_t* kc, const uint16_t* vc, int64_t blk_stride, int64_t head_stride, int64_t bs,
                  const int64_t* table, int64_t h, int64_t seq_len, Work& w) {
  const int64_t kpad = round_up(seq_len, 32);
  w.kt.assign(D / 2 * kpad, 0u);
  w.vv.assign(kpad * D, 0);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t off = table[t / bs] * blk_stride + h * head_stride + (t % bs) * D;
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(kc + off);
    for (int dp = 0; dp < D / 2; ++dp) w.kt[dp * kpad + t] = kr[dp];
    const uint16_t* vr = vc + off;
    uint16_t* dst = w.vv.data() + (t / 2) * D * 2 + (t & 1);
    for (int d = 0; d < D; ++d) dst[d * 2] = vr[d];
  }
  w.s.resize(TILE * kpad);
  w.p.resize(TILE * kpad);
}

// Row softmax of a tile's raw scores S [16][kpad] (rows >= `rows` are padding): row r sees keys
// 0 .. first_pos + r (the last `window` of them when window > 0); P = 0 elsewhere up to nk32 (the
// 32-key chunk boundary); inv = 1 / row sum.
inline void softmax_rows(const float* S, int64_t kpad, int64_t rows, int64_t first_pos, int64_t nk32, float scale,
                         uint16_t* P, float* inv, int64_t window) {
  for (int64_t r = 0; r < TILE; ++r) {
    uint16_t* pr = P + r * kpad;
    if (r >= rows) {
      std::fill(pr, pr + nk32, 0);
      inv[r] = 0.f;
      continue;
    }
    const int64_t vis = first_pos + r + 1;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, vis - window) : 0;
    std::fill(pr, pr + lo, 0);
    inv[r] = probs_bf16(S + r * kpad + lo, vis - lo, vis - lo, scale, pr + lo);
    std::fill(pr + vis, pr + nk32, 0);
  }
}

// Without AMX: the same item with vdpbf16ps. S: per 16-key group, each K^T pair row is loaded once
// and used by all 16 query rows (16 accumulators, query pairs broadcast from memory). O: per key
// pair, the V pair row (D/16 vectors) is used by kRows query rows at once.
template <int D>
void attend_prefill_avx512(const uint16_t* q, int64_t q_row, uint16_t* out, const uint16_t* kc, const uint16_t* vc,
                           int64_t blk_stride, int64_t head_stride, int64_t bs, const int64_t* table, int64_t h,
                           int64_t G, int64_t num_heads, int64_t q0row, int64_t qlen, int64_t ctx, float scale,
                           Work& w) {
  constexpr int V = D / 16, kRows = D == 64 ? 4 : 2;  // O accumulators: kRows x V = 16 registers
  const int64_t seq_len = ctx + qlen, kpad = round_up(seq_len, 32);
  head_layouts<D>(kc, vc, blk_stride, head_stride, bs, table, h, seq_len, w);
  w.qpad.assign(TILE * D, 0);
  for (int64_t j = 0; j < G; ++j) {
    const int64_t head = h * G + j;
    for (int64_t r0 = 0; r0 < qlen; r0 += TILE) {
      const int64_t rows = std::min<int64_t>(TILE, qlen - r0);
      const int64_t nk = std::min(seq_len, ctx + r0 + rows);  // keys the tile's last query sees
      const int64_t nk32 = round_up(nk, 32);
      const uint16_t* qt = q + (q0row + r0) * q_row + head * D;
      int64_t qstride = q_row;
      if (rows < TILE) {  // never read past the sequence's rows
        for (int64_t r = 0; r < rows; ++r) std::memcpy(w.qpad.data() + r * D, qt + r * q_row, D * 2);
        std::fill(w.qpad.begin() + rows * D, w.qpad.end(), 0);
        qt = w.qpad.data();
        qstride = D;
      }
      float* S = w.s.data();
      const uint32_t* KT = w.kt.data();
      for (int64_t k0 = 0; k0 < nk; k0 += 16) {
        __m512 acc[TILE];
        for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
        for (int dp = 0; dp < D / 2; ++dp) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(KT + dp * kpad + k0);
          for (int r = 0; r < TILE; ++r) {
            const int32_t qpair = reinterpret_cast<const int32_t*>(qt + r * qstride)[dp];
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qpair), kv);
          }
        }
        for (int r = 0; r < TILE; ++r) _mm512_storeu_ps(S + r * kpad + k0, acc[r]);
      }
      float inv[TILE];
      softmax_rows(S, kpad, rows, ctx + r0, nk32, scale, w.p.data(), inv, w.window);
      const uint16_t* P = w.p.data();
      for (int64_t rb = 0; rb < rows; rb += kRows) {
        __m512 acc[kRows][V];
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
        for (int64_t kp2 = 0; kp2 < nk32 / 2; ++kp2) {
          const uint16_t* vk = w.vv.data() + kp2 * D * 2;
          __m512bh vv[V];
          for (int v = 0; v < V; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vk + v * 32);
          for (int r = 0; r < kRows; ++r) {  // rows past `rows` have P = 0 (they are not stored)
            const int32_t ppair = reinterpret_cast<const int32_t*>(P + (rb + r) * kpad)[kp2];
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(ppair);
            for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
          }
        }
        for (int r = 0; r < kRows && rb + r < rows; ++r) {
          uint16_t* o = out + ((q0row + r0 + rb + r) * num_heads + head) * D;
          const __m512 sc = _mm512_set1_ps(inv[rb + r]);
          for (int v = 0; v < V; ++v) store_float_as_bf16x16(o + v * 16, _mm512_mul_ps(acc[r][v], sc));
        }
      }
    }
  }
}

#if PAGEDLLM_AMX
// D = 64 or 128: q.k in 32-dim chunks (query tiles 0..D/32-1), P.V in 64-dim passes of four
// 16-dim output tiles (4..7).
template <int D>
void attend_prefill(const uint16_t* q, int64_t q_row, uint16_t* out, const uint16_t* kc, const uint16_t* vc,
                    int64_t blk_stride, int64_t head_stride, int64_t bs, const int64_t* table, int64_t h, int64_t G,
                    int64_t num_heads, int64_t q0row, int64_t qlen, int64_t ctx, float scale, Work& w) {
  static_assert(D == 64 || D == 128, "tiles are assigned for head_dim 64 or 128");
  const int64_t seq_len = ctx + qlen, kpad = round_up(seq_len, 32);
  head_layouts<D>(kc, vc, blk_stride, head_stride, bs, table, h, seq_len, w);
  w.qpad.resize(TILE * D);
  for (int64_t j = 0; j < G; ++j) {
    const int64_t head = h * G + j;
    for (int64_t r0 = 0; r0 < qlen; r0 += TILE) {
      const int64_t rows = std::min<int64_t>(TILE, qlen - r0);
      const int64_t nk = std::min(seq_len, ctx + r0 + rows);  // keys the tile's last query sees
      const int64_t nkt = (nk + TILE - 1) / TILE, nk32 = round_up(nk, 32);
      const uint16_t* qt = q + (q0row + r0) * q_row + head * D;
      int64_t qstride = q_row * 2;
      if (rows < TILE) {  // never load past the sequence's rows
        std::fill(w.qpad.begin(), w.qpad.end(), 0);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(w.qpad.data() + r * D, qt + r * q_row, D * 2);
        qt = w.qpad.data();
        qstride = D * 2;
      }
      // Tiles 0..D/32-1: the query tile's 32-dim chunks; 4, 5: the matching K^T tiles; 7: scores.
      _tile_loadd(0, qt, qstride);
      _tile_loadd(1, qt + 32, qstride);
      if constexpr (D == 128) {
        _tile_loadd(2, qt + 64, qstride);
        _tile_loadd(3, qt + 96, qstride);
      }
      float* S = w.s.data();
      const uint32_t* KT = w.kt.data();
      for (int64_t kt = 0; kt < nkt; ++kt) {
        _tile_zero(7);
        _tile_loadd(4, KT + kt * TILE, kpad * 4);
        _tile_loadd(5, KT + TILE * kpad + kt * TILE, kpad * 4);
        _tile_dpbf16ps(7, 0, 4);
        _tile_dpbf16ps(7, 1, 5);
        if constexpr (D == 128) {
          _tile_loadd(4, KT + 2 * TILE * kpad + kt * TILE, kpad * 4);
          _tile_loadd(5, KT + 3 * TILE * kpad + kt * TILE, kpad * 4);
          _tile_dpbf16ps(7, 2, 4);
          _tile_dpbf16ps(7, 3, 5);
        }
        _tile_stored(7, S + kt * TILE, kpad * 4);
      }
      float inv[TILE];
      softmax_rows(S, kpad, rows, ctx + r0, nk32, scale, w.p.data(), inv, w.window);
      // O = P V in 64-dim passes: tile 0 = 32 keys of P, tile 1 = their V pairs for 16 dims,
      // tiles 4..7 = O for the pass's 4 x 16 dims.
      for (int dh = 0; dh < D; dh += 64) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k0 = 0; k0 < nk32; k0 += 32) {
          _tile_loadd(0, w.p.data() + k0, kpad * 2);
          const uint16_t* vk = w.vv.data() + (k0 / 2) * D * 2 + dh * 2;
          _tile_loadd(1, vk, D * 4);
          _tile_dpbf16ps(4, 0, 1);
          _tile_loadd(1, vk + 32, D * 4);
          _tile_dpbf16ps(5, 0, 1);
          _tile_loadd(1, vk + 64, D * 4);
          _tile_dpbf16ps(6, 0, 1);
          _tile_loadd(1, vk + 96, D * 4);
          _tile_dpbf16ps(7, 0, 1);
        }
        _tile_stored(4, w.o + dh, D * 4);
        _tile_stored(5, w.o + dh + 16, D * 4);
        _tile_stored(6, w.o + dh + 32, D * 4);
        _tile_stored(7, w.o + dh + 48, D * 4);
      }
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* o = out + ((q0row + r0 + r) * num_heads + head) * D;
        const __m512 sc = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < D / 16; ++c) store_float_as_bf16x16(o + c * 16, _mm512_mul_ps(_mm512_loadu_ps(w.o + r * D + c * 16), sc));
      }
    }
  }
}

#endif  // PAGEDLLM_AMX

}  // namespace
#endif  // PAGEDLLM_AVX512BF16

bool prefill_attention_available(int64_t head_dim, int64_t block_size) {
#if PAGEDLLM_AVX512BF16
  return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0;
#else
  (void)head_dim, (void)block_size;
  return false;
#endif
}

void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                             torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                  k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16,
              "paged_prefill_attention: bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() && out.sizes() == q.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "paged_prefill_attention: bad layout");
  const int64_t num_heads = q.size(1), D = q.size(2), hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(num_heads % hkv == 0 && k_cache.size(3) == D, "paged_prefill_attention: head geometry");
  TORCH_CHECK(prefill_attention_available(D, bs), "paged_prefill_attention: not available here");
#if PAGEDLLM_AVX512BF16
  bool amx = false;
#if PAGEDLLM_AMX
  amx = amx_permitted();
#endif
  auto bt = block_tables.contiguous();
  auto qs = query_starts.contiguous(), ql = query_lens.contiguous(), cl = context_lens.contiguous();
  const int64_t nseq = qs.size(0), max_blocks = bt.size(1), G = num_heads / hkv;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t *qsp = qs.data_ptr<int64_t>(), *qlp = ql.data_ptr<int64_t>(), *clp = cl.data_ptr<int64_t>();
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) >= nseq && ql.size(0) == nseq && cl.size(0) == nseq,
              "paged_prefill_attention: one block table row, query length and context length per sequence");
  for (int64_t i = 0; i < nseq; ++i) {
    TORCH_CHECK(qsp[i] >= 0 && qlp[i] >= 0 && qsp[i] + qlp[i] <= q.size(0) && clp[i] >= 0 &&
                    (clp[i] + qlp[i] + bs - 1) / bs <= max_blocks,
                "paged_prefill_attention: sequence ", i, " out of range");
    check_block_table_row("paged_prefill_attention", i, btp + i * max_blocks, max_blocks, clp[i] + qlp[i],
                          k_cache.size(0), bs, window > 0 ? std::max<int64_t>(0, clp[i] - window + 1) : 0);
  }
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t head_stride = bs * D, blk_stride = hkv * head_stride;
  const int64_t items = nseq * hkv;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  // Cost of an item ~ its query tiles x keys.
  std::vector<int64_t> bounds = balanced_split(items, nthreads, [&](int64_t it) {
    const int64_t i = it / hkv;
    return (qlp[i] + 16) * (clp[i] + qlp[i]) / 16 + 64;
  });
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
#if PAGEDLLM_AMX
    if (amx) configure_tiles();
#endif
    Work w;
    w.window = window;
    for (int64_t tid = tb; tid < te; ++tid)
      for (int64_t it = bounds[tid]; it < bounds[tid + 1]; ++it) {
        const int64_t i = it / hkv, h = it % hkv;
        if (qlp[i] == 0) continue;
        // With a window, keys from the block where the first query's window starts: positions
        // shift by whole blocks, so the causal and window masks see the same differences.
        const int64_t skip = window > 0 ? std::max<int64_t>(0, clp[i] - window + 1) / bs : 0;
        const int64_t* table = btp + i * max_blocks + skip;
        const float sc = static_cast<float>(scale);
        auto run = [&](auto attend) {
          attend(qp, q.stride(0), op, kp, vp, blk_stride, head_stride, bs, table, h, G, num_heads, qsp[i], qlp[i],
                 clp[i] - skip * bs, sc, w);
        };
#if PAGEDLLM_AMX
        if (amx) {
          D == 64 ? run(attend_prefill<64>) : run(attend_prefill<128>);
          continue;
        }
#endif
        D == 64 ? run(attend_prefill_avx512<64>) : run(attend_prefill_avx512<128>);
      }
#if PAGEDLLM_AMX
    if (amx) _tile_release();
#endif
  });
#endif
}
