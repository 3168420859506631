// What the kernels of weights repacked eight rows at a time share (quant_gemm_interleaved.cpp:
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0; quant_gemm_q4k_q5k.cpp: Q4_K / Q5_K; quant_gemm_q6k.cpp: Q6_K): the
// activation rows quantized once per call, broadcasts of activation bytes to every row lane, and
// the weight-stream prefetch.
#pragma once

#include "common.h"
#include "quant_activations.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_X8_AVX2 1
#else
#define PAGEDLLM_X8_AVX2 0
#endif
// VNNI on 256-bit registers (vpdpbusd: four u8 x s8 products summed into each int32 lane, no
// 16-bit intermediate): AVX512-VNNI (Zen 4 / 5, Ice Lake and later Intel), or AVX-VNNI, its VEX
// form on the Intel CPUs without AVX512 (Alder Lake and later clients, Sierra Forest).
#if PAGEDLLM_X8_AVX2 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define PAGEDLLM_X8_VNNI 1
#else
#define PAGEDLLM_X8_VNNI 0
#endif
// AVX512-VNNI on 512-bit registers: the panel kernels at many activation rows (quant_panels.h).
#if PAGEDLLM_X8_VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PAGEDLLM_X16_VNNI 1
#else
#define PAGEDLLM_X16_VNNI 0
#endif

// The build's -ffast-math lets gcc reassociate float arithmetic, intrinsics' included, and it
// does so differently for differently inlined copies of one expression: the 512-bit pair kernels
// and the panel kernels (quant_panels.h) and the group kernels then rounded the same output's
// scale products apart (9e-5).
// Kernels whose outputs must not depend on which copy ran (every row, whatever the batch) keep
// the written order between these two markers.
#define PAGEDLLM_EXACT_FLOAT_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-associative-math\")")
#define PAGEDLLM_EXACT_FLOAT_END _Pragma("GCC pop_options")

namespace {
namespace ilv {

constexpr int64_t kRows = 8;  // weight rows per group: the lanes of a 256-bit register

enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, kQ4K = 12, kQ5K = 13, kQ6K = 14 };  // GGUF types

// The 4- / 5-bit formats' constants: weights unsigned (0..15 / 0..31), Q4_0 / Q5_0 centred by
// subtracting kBias * sum(q_x), Q4_1 / Q5_1 adding their min.
template <int64_t QT>
struct Nibble {
  static constexpr bool kMin = QT == Q4_1 || QT == Q5_1, kFive = QT == Q5_0 || QT == Q5_1;
  static constexpr int32_t kBias = kMin ? 0 : kFive ? 16 : 8;
  static constexpr int64_t kHigh = kMin ? 32 : 16;          // offset of the fifth bits in a group's block
  static constexpr int64_t kQs = kHigh + (kFive ? 32 : 0);  // offset of the runs
  static constexpr int64_t kBlockBytes = (kQs + 128) / kRows;  // of one row (the GGUF block)
};


// Quantized activation rows of a call: q [M, K] (int8 for Q4_x, int16 for Q8_0), d [M, nb] and,
// for int8, s = sum(q) [M, nb]. Fine scales (int8, a scale per 16 values: see
// quantize_activations): d and s hold two entries per block of 32, ds = sum over the block's two
// halves of d * s [M, K / 32].
template <class Q>
struct Activations {
  const Q* q;
  const float* d;
  const int32_t* s;
  int64_t K, nb;
  const float* ds = nullptr;
};
using Activations8 = Activations<int8_t>;
using Activations16 = Activations<int16_t>;

template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// The call's activation rows, quantized once and shared by every thread (scratch kept per thread
// between calls); with_sums: also s = sum(q) per block (Q4_0's - 8, Q5_0's - 16 and the mins
// need it). kBlock 16 (fine scales, int8 only): a scale per 16 values, the two nibble halves of a
// Q4_x / Q5_x block (down_proj's input, whose SiLU x up products put a few large values in a
// block; see QuantizedLinear), plus ds per block of 32.
template <class Q, int kMax, int kBlock = 32>
Activations<Q> quantize_activations(const float* x, int64_t M, int64_t K, bool with_sums) {
  const int64_t nb = K / kBlock;
  static thread_local std::vector<Q> q;
  static thread_local std::vector<float> d, ds;
  static thread_local std::vector<int32_t> s;
  grow(q, M * K);
  grow(d, M * nb);
  if (with_sums) grow(s, M * nb);
  if (kBlock == 16) grow(ds, M * K / 32);
  Q* qp = q.data();
  float* dp = d.data();
  float* dsp = kBlock == 16 ? ds.data() : nullptr;
  int32_t* sp = with_sums ? s.data() : nullptr;
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      float* dm = dp + m * nb;
      auto on_block = [&](int64_t blk, int32_t sum) {
        if (sp != nullptr) sp[m * nb + blk] = sum;
        // the second half's d * s added to the first's, in this order whatever the batch
        if (dsp != nullptr && blk % 2 == 1)
          dsp[m * nb / 2 + blk / 2] = dm[blk - 1] * static_cast<float>(sp[m * nb + blk - 1]) +
                                      dm[blk] * static_cast<float>(sum);
      };
      quantize_row<Q, kMax, decltype(on_block), kBlock>(x + m * K, K, qp + m * K, dm, on_block);
    }
  });
  return {qp, dp, sp, K, nb, dsp};
}

// Super-block formats repacked eight rows at a time (Q4_K, Q5_K, Q6_K): a group's super-block s holds
// its eight rows' super-block s, laid out by the format's to_group(file_block, row, group_block).
inline void check_group_rows(const torch::Tensor& w, int64_t row_bytes_per_super, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), what,
              ": w must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(w.size(1) % row_bytes_per_super == 0, what, ": row bytes are not whole super-blocks");
  TORCH_CHECK(w.size(0) % kRows == 0, what, ": rows must be a multiple of 8, not ", w.size(0));
}

template <class ToGroup>
torch::Tensor repack_groups(const torch::Tensor& w, int64_t file_bytes, int64_t group_bytes, ToGroup to_group) {
  const int64_t nsb = w.size(1) / file_bytes, groups = w.size(0) / kRows;
  auto out = torch::empty({w.size(0), nsb * group_bytes / kRows}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t s = 0; s < nsb; ++s)
          to_group(src + ((g * kRows + r) * nsb + s) * file_bytes, r, dst + (g * nsb + s) * group_bytes);
  });
  return out;
}

// Rows `ids` of a repack_groups weight, back in the file's layout.
template <class FromGroup>
torch::Tensor group_rows(const torch::Tensor& w, torch::Tensor ids, int64_t file_bytes, int64_t group_bytes,
                         FromGroup from_group, const char* what) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, what, ": ids must be int64 [R]");
  ids = ids.contiguous();
  const int64_t nsb = w.size(1) * kRows / group_bytes, N = w.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  auto out = torch::empty({ids.size(0), nsb * file_bytes}, w.options());
  for (int64_t i = 0; i < ids.size(0); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, what, ": row ", ip[i], " out of range for ", N, " rows");
    const uint8_t* group = w.data_ptr<uint8_t>() + ip[i] / kRows * nsb * group_bytes;
    for (int64_t s = 0; s < nsb; ++s)
      from_group(group + s * group_bytes, ip[i] % kRows, out.data_ptr<uint8_t>() + (i * nsb + s) * file_bytes);
  }
  return out;
}

// Four bytes at p (four int8 or two int16 activations) as one int32, for a broadcast.
template <class T>
__attribute__((always_inline)) inline int32_t load4(const T* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if PAGEDLLM_X8_AVX2
inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(load4(p)); }

// Asks for the weight bytes kPrefetchDistance ahead of a block of kBytes (every cache line they
// span). The weights are read once per call and nothing else hides the memory latency: at one
// activation row the hardware prefetcher alone streamed a decode step's weights at ~14 GB/s,
// with this ~18 (alternating runs). A prefetch past the end of the weights is harmless.
constexpr int64_t kPrefetchDistance = 1024;

template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* block) {
  const char* p = reinterpret_cast<const char*>(block) + kPrefetchDistance;
  for (int64_t o = 0; o < kBytes + 63; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
#endif

}  // namespace ilv
}  // namespace
