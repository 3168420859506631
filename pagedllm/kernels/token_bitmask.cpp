// Structured outputs: logits of disallowed tokens -> -inf, from llguidance's packed bitmask.
//
// A mask row has one bit per token (bit t of word t / 32 set: allowed). Constrained rows are
// mostly runs of all-allowed words (inside a JSON string) or all-banned ones (between values), so
// the kernel looks at a word at a time: -1 leaves 32 logits untouched, 0 writes 32 -infs without
// reading them, and only mixed words go bit by bit. torch's masked_fill over the unpacked mask
// reads and writes every logit.
#include "entry_points.h"

#include <limits>

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be float32 [R, V] with unit stride along V");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [n, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [n], one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = rows.size(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask: the bitmask covers fewer tokens than the logits");
  rows = rows.contiguous();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "apply_token_bitmask: row ", rp[i], " out of range");
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  float* lp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = lp + rp[i] * ld;
      const uint32_t* m = reinterpret_cast<const uint32_t*>(mp + i * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t t0 = w * 32, t1 = std::min<int64_t>(vocab, t0 + 32);
        for (int64_t t = t0; t < t1; ++t)
          if (!((bits >> (t - t0)) & 1u)) row[t] = kBanned;
      }
    }
  });
}
