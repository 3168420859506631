// Large float outputs of the layer kernels in recycled buffers.
//
// Why: glibc serves a block above its mmap threshold (32 MiB at most, however mallopt raises it;
// a thread's arena cannot hold more than 64 MiB either) with a fresh mmap and unmaps it when the
// tensor dies. A prefill step of a 1.7B model allocates its [2048, 12288] qkv, [2048, 16384]
// gate_up and [2048, 8192] silu outputs again in every layer, so the kernel maps and zeroes
// hundreds of MiB of new pages per layer: 17% of a served run's CPU time was page faults and
// unmaps. A tensor from scratch_empty hands its buffer back to a small pool when it dies, and the
// next layer's output of that size takes it again.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// Outputs below this many bytes come from torch::empty: glibc's heap keeps those (host_memory.py).
constexpr int64_t kScratchMinBytes = int64_t(4) << 20;

// An uninitialized float32 tensor of `sizes` (contiguous); large ones from the pool.
torch::Tensor scratch_empty(at::IntArrayRef sizes, const at::TensorOptions& options);
// Frees the pool's idle buffers (the engine's periodic heap release calls it); returns their bytes.
int64_t release_scratch();
// The bytes of the pool's idle buffers.
int64_t scratch_idle_bytes();
