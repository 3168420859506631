// What the paged attention kernels share about a call: the cache's geometry (paged_attention.cpp's
// decode paths, decode_attention_f32.h) and an int8 cache's scales.
#pragma once

#include "common.h"

#include <type_traits>

namespace {

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

}  // namespace
