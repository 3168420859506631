// The pool behind scratch_empty (scratch_buffers.h): idle buffers by size, reused by the next
// request that fits in one without wasting more than half of it.
#include "scratch_buffers.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

namespace {

constexpr size_t kAlign = size_t(2) << 20;  // whole huge pages: a buffer can be backed by them
// Idle buffers kept beyond this are freed at once: a step's outputs alive together stay well
// below it (the largest model step here holds ~0.3 GiB of them).
constexpr size_t kMaxIdleBytes = size_t(2) << 30;

struct Pool {
  std::mutex mu;
  std::vector<std::pair<size_t, void*>> idle;  // (capacity, buffer)
  size_t idle_bytes = 0;

  void* take(size_t bytes, size_t* capacity) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto best = idle.end();
      for (auto it = idle.begin(); it != idle.end(); ++it)
        if (it->first >= bytes && it->first <= 2 * bytes && (best == idle.end() || it->first < best->first)) best = it;
      if (best != idle.end()) {
        *capacity = best->first;
        void* p = best->second;
        idle_bytes -= best->first;
        idle.erase(best);
        return p;
      }
    }
    const size_t cap = (bytes + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, cap);
    TORCH_CHECK(p != nullptr, "scratch_empty: out of memory allocating ", cap, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(p, cap, MADV_HUGEPAGE);  // fewer faults and TLB misses where THP is "madvise"
#endif
    *capacity = cap;
    return p;
  }

  void give(void* p, size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (idle_bytes + capacity <= kMaxIdleBytes) {
        idle.emplace_back(capacity, p);
        idle_bytes += capacity;
        return;
      }
    }
    std::free(p);
  }

  int64_t release() {
    std::vector<std::pair<size_t, void*>> freed;
    {
      std::lock_guard<std::mutex> lock(mu);
      freed.swap(idle);
      idle_bytes = 0;
    }
    size_t bytes = 0;
    for (auto& [cap, p] : freed) {
      bytes += cap;
      std::free(p);
    }
    return static_cast<int64_t>(bytes);
  }
};

// Never destroyed: tensors may die after static destructors ran (at interpreter exit).
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

}  // namespace

torch::Tensor scratch_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_CHECK(options.dtype() == torch::kFloat32, "scratch_empty: float32 only");
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(sizeof(float));
  if (bytes < kScratchMinBytes) return torch::empty(sizes, options);
  size_t capacity = 0;
  void* p = pool().take(static_cast<size_t>(bytes), &capacity);
  return torch::from_blob(
      p, sizes, [capacity](void* q) { pool().give(q, capacity); }, options);
}

int64_t release_scratch() { return pool().release(); }

int64_t scratch_idle_bytes() {
  std::lock_guard<std::mutex> lock(pool().mu);
  return static_cast<int64_t>(pool().idle_bytes);
}
