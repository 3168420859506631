// Paged decode attention for the CPU: each query token attends to its sequence's keys and
// values read in place from the paged cache through the block table (no gather, no copy).
//
// q:            [num_seqs, num_heads, head_dim]            (float or bfloat16)
// k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
// block_tables: [num_seqs, max_blocks] int64
// seq_lens:     [num_seqs] int64 (keys 0 .. seq_len-1 are visible)
// out:          [num_seqs, num_heads, head_dim]
//
// One work item is a (sequence, kv head) pair, so the keys and values of that head are read
// once for all query heads of its GQA group. Scores, softmax and accumulation are in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Widens one K or V row to float. The bf16 case is written as a plain shift so the compiler
// vectorizes it (c10::BFloat16's conversion operator is not vectorized).
static inline void load_row(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
static inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
}

template <typename scalar_t>
static void decode_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t tok_stride = num_kv_heads * head_dim;       // between tokens in a block
  const int64_t blk_stride = block_size * tok_stride;      // between blocks
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, acc, row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens[s];
      qf.assign(group * head_dim, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = to_f(qp[(s * num_heads + h * group + g) * head_dim + d]) * fscale;
      scores.assign(group * len, 0.f);
      const int64_t* table = bt + s * max_blocks;
      // scores = q . k for every visible key
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* kt = kp + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + h * head_dim;
        load_row(kt, row.data(), head_dim);
        const float* kr = row.data();
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kr[d];
          scores[g * len + t] = dot;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        // (no infinities anywhere: the kernel is built with -ffast-math, see cpu_kernels.py)
        float mx = sg[0];
        for (int64_t t = 1; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        // vectorized exp (glibc libmvec, enabled by -ffast-math): scalar expf dominated the kernel
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      // out = p . v
      acc.assign(group * head_dim, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* vt = vp + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + h * head_dim;
        load_row(vt, row.data(), head_dim);
        const float* vr = row.data();
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vr[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          op[(s * num_heads + h * group + g) * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d]);
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  if (q.scalar_type() == torch::kFloat) {
    decode_impl<float>(out, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<at::BFloat16>(out, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
