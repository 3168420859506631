// y = x @ W^T (+ bias) on the CPU for every row count from a decode step of a few sequences to a
// 2048-token prefill chunk, with W packed once, at load time, in AMX B-tile order: W [N, K] ->
// [N/16][K/32][16 pair-rows][16 cols][2]. Each 16-column strip of W is one contiguous run that a
// thread streams front to back, and each 64-byte row of it (one k-pair of 16 columns) is also the
// B operand of an AVX512-BF16 dot product, so both paths below read the same copy:
//
// - AMX tiles (CPUs with AMX, more than kVecRows rows). A step computes a 32-column block (two B
//   tiles) against up to 32 rows (two A tiles) of x into four float C tiles; x is taken in chunks
//   of 256 rows that stay in L2 while the strips pass, and with several row blocks K goes in blocks
//   of 256 so that the pair's slice stays in L1 across them (hot, 200 rows: 808 -> 707 us per layer;
//   120 GEMMs from memory: 29.9 -> 26.1 ms at 200 rows, 65 -> 54 at 512). Measured on SmolLM2-135M's
//   120 layer GEMMs (212 MB of weights, caches flushed between passes; weights on huge pages): 16 rows
//   12.1 ms vs oneDNN's blocked kernel 27.2, 64 rows 19.7 vs 38.3, 256 rows 40.2 vs 63.1, 2048 rows
//   290 vs 288 (Intel Sapphire Rapids).
// - AVX512-BF16 dot products (every row count without AMX; up to kVecRows rows with it): a register
//   block of up to 6 rows x 4 strips (24 float accumulators) over all of K, one broadcast x pair per
//   row times 4 strip rows, no horizontal sums. On AMD Zen 4 (no AMX) the same 120 GEMMs take 10.4 ms
//   at 8 rows vs oneDNN's 16.1, 40.7 vs 58.6 at 64, 111 vs 120 at 200, 262 vs 285 at 512 (~97% of
//   the vdpbf16ps peak there).
//
// Epilogues: "none" rounds C (+ bias) to bf16; "silu_mul" takes a gate/up weight packed with gate
// and up strips interleaved (strip 2j = gate columns 16j.., strip 2j+1 = the same up columns) and
// writes silu(gate) * up, rounded as the unfused silu_and_mul kernel rounds its bf16 inputs;
// greedy decoding's argmax takes the largest bf16 logit per row without writing the logits.
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kStrip = 16;      // output columns of one B tile (one strip)
constexpr int64_t kKChunk = 32;     // K of one tile product
constexpr int64_t kTileElems = 512;  // bf16 elements of one B tile (16 x 32)
constexpr int64_t kRowChunk = 256;  // rows of x per pass over the weights (x chunk <= 768 KB)
enum class Epilogue { kNone, kSiluMul, kArgmax };

}  // namespace

#if PAGEDLLM_AVX512BF16
namespace {

// Greedy decoding's epilogue: per row, the largest logit (rounded to bf16, as the logits tensor
// would hold it) and its first column, over the columns one thread has seen so far.
struct RowBest {
  float value;
  int64_t index;
};

// Updates best[r] with the 32 columns col0.. of the block's rows; strictly greater only, so on
// ties the first column wins when blocks arrive in column order.
inline void argmax_block(const float* cbuf, int64_t rows, int64_t col0, RowBest* best) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = round_bf16x16(_mm512_loadu_ps(cbuf + r * 32));
    const __m512 hi = round_bf16x16(_mm512_loadu_ps(cbuf + r * 32 + 16));
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
    if (!(m > best[r].value)) continue;
    const __m512 mv = _mm512_set1_ps(m);
    const uint32_t in_lo = _mm512_cmp_ps_mask(lo, mv, _CMP_EQ_OQ);
    const int64_t at = in_lo ? __builtin_ctz(in_lo) : 16 + __builtin_ctz(_mm512_cmp_ps_mask(hi, mv, _CMP_EQ_OQ));
    best[r] = {m, col0 + at};
  }
}

// First output column of strip pair p: 32 columns each, or 16 after silu(gate) * up.
inline int64_t pair_out_col(int64_t p, Epilogue epi) { return epi == Epilogue::kSiluMul ? p * 16 : p * 32; }

inline void store_block(const float* cbuf, int64_t rows, uint16_t* y, int64_t ldy, int64_t col0, const float* bias,
                        Epilogue epi) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cbuf + r * 32;
    uint16_t* yr = y + r * ldy;
    if (epi == Epilogue::kNone) {
      __m512 lo = _mm512_loadu_ps(c), hi = _mm512_loadu_ps(c + 16);
      if (bias) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias + col0));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + col0 + 16));
      }
      store_float_as_bf16x16(yr + col0, lo);
      store_float_as_bf16x16(yr + col0 + 16, hi);
    } else {
      // Same rounding steps as silu_and_mul on a bf16 gate_up row.
      _mm256_storeu_si256((__m256i*)(yr + col0), silu_mul_bf16x16(_mm512_loadu_ps(c), _mm512_loadu_ps(c + 16)));
    }
  }
}

// The vector path. Row kp of a B tile holds the k-pair (2kp, 2kp+1) of 16 columns, so one
// broadcast x pair times that row adds to 16 outputs: no horizontal sums. NS strips per pass (4,
// or 2 at the end of a thread's share) share each x broadcast; `next` (the thread's next strip
// group) is requested into L2 as these strips are read, by the first row block that reads them.
constexpr int64_t kVecRows = 6;

template <int M, int NS>
inline void vec_strips(const uint16_t* x, int64_t K, const uint16_t* w, int64_t strip_elems, const uint16_t* next,
                       float* cbuf) {
  __m512 acc[M][NS];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NS; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x);
  const int64_t kpairs = K / 2;
  for (int64_t kq = 0; kq < kpairs; ++kq) {  // B-tile row kq % 16 of k-chunk kq / 16: offset kq * 32
    __m512bh b[NS];
    for (int j = 0; j < NS; ++j) {
      b[j] = (__m512bh)_mm512_loadu_si512(w + j * strip_elems + kq * 32);
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + j * strip_elems + kq * 32), _MM_HINT_T1);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xpairs[m * kpairs + kq]);
      for (int j = 0; j < NS; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  // cbuf: per strip pair, [M][32] floats (store_block's layout)
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NS; ++j) _mm512_storeu_ps(cbuf + (j / 2) * M * 32 + m * 32 + (j % 2) * 16, acc[m][j]);
}

template <int NS>
inline void vec_row_block(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t strip_elems,
                          const uint16_t* next, float* cbuf) {
  switch (rows) {
    case 1: vec_strips<1, NS>(x, K, w, strip_elems, next, cbuf); break;
    case 2: vec_strips<2, NS>(x, K, w, strip_elems, next, cbuf); break;
    case 3: vec_strips<3, NS>(x, K, w, strip_elems, next, cbuf); break;
    case 4: vec_strips<4, NS>(x, K, w, strip_elems, next, cbuf); break;
    case 5: vec_strips<5, NS>(x, K, w, strip_elems, next, cbuf); break;
    default: vec_strips<6, NS>(x, K, w, strip_elems, next, cbuf); break;
  }
  static_assert(kVecRows == 6, "the switch above covers 1..kVecRows rows");
}

// Each thread takes an equal share of the strip pairs (in column order, thread t's before t + 1's)
// and streams it once per chunk of kRowChunk rows, in groups of 4 strips that stay in L2 while the
// chunk's row blocks pass. sink(C [rows][32] floats, rows, first row, first output column, thread)
// takes every finished block of 32 columns.
template <typename Sink>
void vec_gemm(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t strips, Epilogue epi,
              int64_t nthreads, Sink&& sink) {
  const int64_t strip_elems = (K / kKChunk) * kTileElems, pairs = strips / 2;
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    alignas(64) float cbuf[2 * kVecRows * 32];
    for (int64_t tid = tb; tid < te; ++tid) {
      const int64_t s_begin = 2 * (pairs * tid / nthreads), s_end = 2 * (pairs * (tid + 1) / nthreads);
      for (int64_t mc = 0; mc < M; mc += kRowChunk) {
        const int64_t mc_end = std::min(M, mc + kRowChunk);
        for (int64_t s0 = s_begin; s0 < s_end; s0 += 4) {
          const int64_t ns = std::min<int64_t>(4, s_end - s0);
          const uint16_t* w = wp + s0 * strip_elems;
          const uint16_t* next = s0 + ns < s_end ? w + ns * strip_elems : nullptr;
          for (int64_t m0 = mc; m0 < mc_end; m0 += kVecRows) {
            const int64_t rows = std::min(kVecRows, mc_end - m0);
            const uint16_t* pf = m0 == mc ? next : nullptr;
            if (ns == 4)
              vec_row_block<4>(rows, xp + m0 * K, K, w, strip_elems, pf, cbuf);
            else
              vec_row_block<2>(rows, xp + m0 * K, K, w, strip_elems, pf, cbuf);
            for (int64_t pr = 0; pr < ns / 2; ++pr) sink(cbuf + pr * rows * 32, rows, m0, pair_out_col(s0 / 2 + pr, epi), tid);
          }
        }
      }
    }
  });
}

}  // namespace
#endif

#if PAGEDLLM_AMX
namespace {

// With several row blocks per strip pair, K in blocks of this many k-chunks: the pair's 16 KB slice
// stays in L1 while the row blocks pass, so only A streams from L2 (C is kept in L1 in between).
constexpr int64_t kKBlock = 8;
constexpr int64_t kMaxRowBlocks = kRowChunk / 32;
constexpr int64_t kPrefetchMinBlocks = 5;  // row blocks of 32 from which the next strip pair is prefetched

// One block: row tiles a0 (and a1: 16 rows each, row stride lda) against strips b0, b1 over kchunks
// k-chunks -> C in cbuf[32][32], added to what cbuf holds when `accumulate`; meanwhile pf_lines cache
// lines from `prefetch` on are requested into L2.
template <int MT>
inline void block_product(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                          int64_t kchunks, bool accumulate, const char* prefetch, int64_t pf_lines, float* cbuf) {
  if (accumulate) {
    _tile_loadd(4, cbuf, 32 * 4);
    _tile_loadd(5, cbuf + 16, 32 * 4);
    if constexpr (MT == 2) {
      _tile_loadd(6, cbuf + 16 * 32, 32 * 4);
      _tile_loadd(7, cbuf + 16 * 32 + 16, 32 * 4);
    }
  } else {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (MT == 2) {
      _tile_zero(6);
      _tile_zero(7);
    }
  }
  for (int64_t kt = 0; kt < kchunks; ++kt) {
    // This block's share of the next strip pair, spread over its k-chunks.
    for (int64_t l = pf_lines * kt / kchunks, le = pf_lines * (kt + 1) / kchunks; l < le; ++l)
      _mm_prefetch(prefetch + l * 64, _MM_HINT_T1);
    _tile_loadd(2, b0 + kt * kTileElems, 64);
    _tile_loadd(3, b1 + kt * kTileElems, 64);
    _tile_loadd(0, a0 + kt * kKChunk, lda * 2);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (MT == 2) {
      _tile_loadd(1, a1 + kt * kKChunk, lda * 2);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, cbuf, 32 * 4);
  _tile_stored(5, cbuf + 16, 32 * 4);
  if constexpr (MT == 2) {
    _tile_stored(6, cbuf + 16 * 32, 32 * 4);
    _tile_stored(7, cbuf + 16 * 32 + 16, 32 * 4);
  }
}

// The tile path (more than kVecRows rows): each thread streams its share of the strip pairs, in
// column order; sink(C [rows][32] floats, rows, first row, first output column, thread) takes
// every finished 32 x 32 block.
template <typename Sink>
void tile_gemm(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t strips, Epilogue epi,
               int64_t nthreads, Sink&& sink) {
  // Tile loads read 16 rows: a partial last row tile is read from a zero-padded copy instead.
  const int64_t full_tiles = M / 16, tail_rows = M % 16;
  std::vector<uint16_t> tail(tail_rows ? 16 * K : 0, 0);
  if (tail_rows) std::memcpy(tail.data(), xp + full_tiles * 16 * K, tail_rows * K * 2);
  auto row_tile = [&](int64_t t) { return t < full_tiles ? xp + t * 16 * K : tail.data(); };
  const int64_t pairs = strips / 2, pair_elems = 2 * (K / kKChunk) * kTileElems;
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
    configure_tiles();
    alignas(64) float cacc[kMaxRowBlocks][32 * 32];
    const int64_t kt_n = K / kKChunk;
    for (int64_t tid = tb; tid < te; ++tid) {
      const int64_t p_begin = pairs * tid / nthreads, p_end = pairs * (tid + 1) / nthreads;
      // Rows in chunks whose x stays in L2 while the thread's strips stream past it once per chunk.
      for (int64_t mc = 0; mc < M; mc += kRowChunk) {
        const int64_t mc_end = std::min(M, mc + kRowChunk);
        const int64_t blocks = (mc_end - mc + 31) / 32;
        const int64_t kblock = blocks > 1 ? kKBlock : kt_n, nkb = (kt_n + kblock - 1) / kblock;
        for (int64_t p = p_begin; p < p_end; ++p) {
          const uint16_t* b0 = wp + p * pair_elems;
          const uint16_t* b1 = b0 + pair_elems / 2;
          const char* next = reinterpret_cast<const char*>(b0 + pair_elems);
          // The weights stream from memory: with many row blocks each block product requests its
          // share of the next pair. With up to kPrefetchMinBlocks - 1 blocks (128 rows) the L2
          // streamer keeps up with the pair stream on its own and the explicit requests only took
          // line-fill buffers from the tile loads (AMX VM, SmolLM2-135M's 120 GEMMs from memory,
          // 16 / 64 / 128 rows: 14.0 / 21.1 / 28.6 -> 12.2 / 21.0 / 28.0 ms, 96 rows 25.5 -> 23.6;
          // but 160 / 200 rows 31.0 / 39.2 -> 33.4 / 40.6 without; small and noisy gains).
          const int64_t next_lines = p + 1 < p_end && blocks >= kPrefetchMinBlocks ? pair_elems * 2 / 64 : 0;
          const int64_t calls = nkb * blocks;
          const int64_t col0 = pair_out_col(p, epi);
          for (int64_t kb = 0, c = 0; kb < nkb; ++kb) {
            const int64_t k0 = kb * kblock, kc = std::min(kblock, kt_n - k0);
            for (int64_t m0 = mc, j = 0; m0 < mc_end; m0 += 32, ++j, ++c) {
              const int64_t rows = std::min<int64_t>(32, mc_end - m0);
              const int64_t l0 = next_lines * c / calls, l1 = next_lines * (c + 1) / calls;
              const uint16_t* a0 = row_tile(m0 / 16) + k0 * kKChunk;
              const uint16_t* bk0 = b0 + k0 * kTileElems;
              const uint16_t* bk1 = b1 + k0 * kTileElems;
              if (rows > 16)
                block_product<2>(a0, row_tile(m0 / 16 + 1) + k0 * kKChunk, K, bk0, bk1, kc, kb > 0, next + l0 * 64,
                                 l1 - l0, cacc[j]);
              else
                block_product<1>(a0, nullptr, K, bk0, bk1, kc, kb > 0, next + l0 * 64, l1 - l0, cacc[j]);
              if (kb == nkb - 1) sink(cacc[j], rows, m0, col0, tid);
            }
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace
#endif

bool packed_gemm_available() { return PAGEDLLM_AVX512BF16 != 0; }

bool amx_available() {
#if PAGEDLLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

static void check_operands(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(packed_gemm_available(), "packed_gemm: built without AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "packed_gemm: bf16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 32 && packed.size(1) * kKChunk == x.size(1),
              "packed_gemm: x [M, K] and packed [N/16, K/32, 16, 32], contiguous");
  TORCH_CHECK(packed.size(0) % 2 == 0, "packed_gemm: N must be a multiple of 32");
}

#if PAGEDLLM_AVX512BF16
// The GEMM of x [M, K] bf16 against the packed weight: AMX tiles where permitted and worth it,
// dot products otherwise. Both hand sink every 32-column block (see vec_gemm).
template <typename Sink>
static void run_gemm(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t strips, Epilogue epi,
                     int64_t nthreads, Sink&& sink) {
#if PAGEDLLM_AMX
  if (M > kVecRows && amx_permitted()) return tile_gemm(xp, M, K, wp, strips, epi, nthreads, sink);
#endif
  vec_gemm(xp, M, K, wp, strips, epi, nthreads, sink);
}

// Threads for `strips` strips: each gets at least one strip pair.
static int64_t gemm_threads(int64_t strips) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), strips / 2));
}
#endif

// x [M, K] bf16 contiguous; packed [N/16, K/32, 16, 32] bf16 (W [N, K] in B-tile order);
// bias: [N] or none (epilogue "none" only). Returns [M, N] ("none") or [M, N/2] ("silu_mul").
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          const std::string& epilogue) {
  check_operands(x, packed);
  TORCH_CHECK(epilogue == "none" || epilogue == "silu_mul", "packed_gemm: epilogue none or silu_mul");
  const Epilogue epi = epilogue == "none" ? Epilogue::kNone : Epilogue::kSiluMul;
  const int64_t M = x.size(0), K = x.size(1), strips = packed.size(0), N = strips * kStrip;
  TORCH_CHECK(!(bias.has_value() && bias->defined()) || epi == Epilogue::kNone, "packed_gemm: bias with silu_mul");
  const int64_t out_cols = epi == Epilogue::kNone ? N : N / 2;
  auto y = torch::empty({M, out_cols}, x.options());
#if PAGEDLLM_AVX512BF16
  if (M == 0) return y;
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_gemm: bias of N values");
    bias_f = bias->to(torch::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  run_gemm(xp, M, K, wp, strips, epi, gemm_threads(strips),
           [&](const float* c, int64_t rows, int64_t m0, int64_t col0, int64_t) {
             store_block(c, rows, yp + m0 * out_cols, out_cols, col0, bp, epi);
           });
#endif
  return y;
}

// Greedy decoding's LM head: for each row of x, the first column of the maximum of
// bf16(x @ W^T), the argmax of the logits packed_gemm would return, without writing those [M, N]
// logits and reading them back. Operands as packed_gemm's (no bias); returns int64 [M].
torch::Tensor packed_gemm_argmax(torch::Tensor x, torch::Tensor packed) {
  check_operands(x, packed);
  const int64_t M = x.size(0), K = x.size(1), strips = packed.size(0);
  auto out = torch::empty({M}, x.options().dtype(torch::kLong));
#if PAGEDLLM_AVX512BF16
  if (M == 0) return out;
  const int64_t nthreads = gemm_threads(strips);
  // Per thread over its own columns (each thread's are in order, thread t's before t + 1's).
  std::vector<RowBest> best(nthreads * M, RowBest{std::numeric_limits<float>::lowest(), 0});
  run_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
           strips, Epilogue::kArgmax, nthreads,
           [&](const float* c, int64_t rows, int64_t m0, int64_t col0, int64_t tid) {
             argmax_block(c, rows, col0, best.data() + tid * M + m0);
           });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    RowBest b = best[r];
    for (int64_t t = 1; t < nthreads; ++t)
      if (best[t * M + r].value > b.value) b = best[t * M + r];
    op[r] = b.index;
  }
#endif
  return out;
}
