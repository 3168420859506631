// y = x @ W^T (+ bias) for a handful of rows of x: the decode steps of one or a few sequences.
//
// There every weight is used once per step, so the matmul is a stream over the weights: oneDNN's
// blocked kernels (built for large M) spend more time in setup and reorders than in the stream
// (41 us vs 10 us for a 960x576 layer at M=1 on this machine kind). This reads W [N, K] bf16
// row-major once, 4 output features at a time against up to 4 rows of x, with AVX512-BF16 dot
// products (exact bf16 products, float accumulation) and one rounding to bf16 at the end.
#include "common.h"

#if PAGEDLLM_AVX512BF16

namespace {

constexpr int64_t kRowsPerTile = 4;  // of W (output features)
constexpr int64_t kMaxM = 4;         // rows of x per pass over a W tile
constexpr int64_t kPrefetchTiles = 4;

template <int M>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n, int64_t nrows, const float* bias,
                 uint16_t* y, int64_t N) {
  __m512 acc[M][kRowsPerTile];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRowsPerTile; ++r) acc[m][r] = _mm512_setzero_ps();
  // The weights stream from memory once per step: keep enough of them in flight (the L1's
  // line-fill buffers alone cap one core near 10 GB/s), by prefetching a few tiles ahead into L2.
  const uint16_t* ahead = w + (n + kPrefetchTiles * kRowsPerTile) * K;
  const bool prefetch = n + (kPrefetchTiles + 1) * kRowsPerTile <= N;
  for (int64_t k = 0; k < K; k += 32) {
    if (prefetch)
      for (int r = 0; r < kRowsPerTile; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T1);
    __m512bh wv[kRowsPerTile];
    for (int r = 0; r < kRowsPerTile; ++r)
      wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + (r < nrows ? r : 0)) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kRowsPerTile; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < nrows; ++r) {
      float v = _mm512_reduce_add_ps(acc[m][r]);
      if (bias) v += bias[n + r];
      y[m * N + n + r] = c10::BFloat16(v).x;
    }
}

}  // namespace

torch::Tensor small_gemm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "small_gemm: bf16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && x.size(1) == weight.size(1),
              "small_gemm: x [M, K] and weight [N, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 32 == 0, "small_gemm: K must be a multiple of 32");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  // ~64 KB of weights per task: big layers use both cores, tiny ones stay on one.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kRowsPerTile * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n = t * kRowsPerTile, nrows = std::min(kRowsPerTile, N - n);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const uint16_t* xm = xp + m0 * K;
        uint16_t* ym = yp + m0 * N;
        switch (std::min(kMaxM, M - m0)) {
          case 1: tile<1>(xm, K, wp, n, nrows, bp, ym, N); break;
          case 2: tile<2>(xm, K, wp, n, nrows, bp, ym, N); break;
          case 3: tile<3>(xm, K, wp, n, nrows, bp, ym, N); break;
          default: tile<4>(xm, K, wp, n, nrows, bp, ym, N); break;
        }
      }
    }
  });
  return y;
}

bool small_gemm_available() { return true; }

#else

torch::Tensor small_gemm(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "small_gemm: built without AVX512-BF16");
}

bool small_gemm_available() { return false; }

#endif
