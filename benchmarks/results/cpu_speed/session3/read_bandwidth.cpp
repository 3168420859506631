// Per-thread read bandwidth of the access patterns paged attention makes (session 3 probe).
// g++ -O3 -march=native -fopenmp read_bandwidth.cpp -o rb && THP=1 ./rb THREADS CHUNK_BYTES PREFETCH_AHEAD MODE [HINT]
// MODE 0: read whole random chunks; 1: 2 of every 6 lines, 3 passes (one KV head of 3 per pass);
// 2 (session 8, the head-major cache of session 4): runs of RUN chunks (env, default 19: one
// sequence's blocks), each run read in 3 passes of one contiguous third of every chunk (one KV head
// per pass), prefetch ignored. PLACED=1 (env): chunks in order, as the block pool places them.
// Per-thread read bandwidth for access patterns of paged attention.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <cstdint>
#include <algorithm>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main(int argc, char** argv) {
  const size_t total = size_t(2) << 30;  // 2 GiB arena
  char* buf = (char*)aligned_alloc(1 << 21, total);
  if (getenv("THP")) madvise(buf, total, MADV_HUGEPAGE);
  memset(buf, 1, total);
  const int threads = atoi(argv[1]);
  const size_t chunk = atoi(argv[2]);        // bytes per random chunk
  const int pf = atoi(argv[3]);              // chunks ahead to prefetch (0 = none)
  const int stride_mode = atoi(argv[4]);     // 0: read all lines; 1: read 2 of every 6 lines, 3 passes (per-head)
  const int hint = argc > 5 ? atoi(argv[5]) : 1;
  const size_t nchunks = total / chunk;
  const size_t reads = (size_t(1) << 30) / chunk;  // 1 GiB worth of chunks per run
  std::vector<size_t> order(reads);
  std::mt19937_64 rng(1);
  for (auto& o : order) o = rng() % nchunks;
  if (getenv("PLACED"))
    for (size_t i = 0; i < reads; ++i) order[i] = i;
  const size_t run = getenv("RUN") ? atoi(getenv("RUN")) : 19;
  double best = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = now();
    __m512 accs[64];
#pragma omp parallel num_threads(threads)
    {
      __m512 acc = _mm512_setzero_ps();
      int tid = omp_get_thread_num();
      size_t lo = reads * tid / threads, hi = reads * (tid + 1) / threads;
      if (stride_mode == 2) {
        for (size_t r0 = lo; r0 < hi; r0 += run)
          for (int h = 0; h < 3; ++h)
            for (size_t i = r0; i < std::min(hi, r0 + run); ++i) {
              const char* p = buf + order[i] * chunk + h * (chunk / 3);
              for (size_t off = 0; off < chunk / 3; off += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + off)));
            }
      }
      for (size_t i = lo; i < hi && stride_mode != 2; ++i) {
        if (pf && i + pf < hi) {
          const char* p = buf + order[i + pf] * chunk;
          for (size_t off = 0; off < chunk; off += 64) {
            if (stride_mode == 1 && ((off / 64) % 6) >= 2) continue;
            if (hint == 1) _mm_prefetch(p + off, _MM_HINT_T1); else if (hint == 0) _mm_prefetch(p + off, _MM_HINT_T0); else _mm_prefetch(p + off, _MM_HINT_T2);
          }
        }
        const char* p = buf + order[i] * chunk;
        if (stride_mode == 0) {
          for (size_t off = 0; off < chunk; off += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + off)));
        } else {
          for (int h = 0; h < 3; ++h)
            for (size_t off = h * 128; off < chunk; off += 384) {
              acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + off)));
              acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + off + 64)));
            }
        }
      }
      accs[tid] = acc;
    }
    double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("threads %d chunk %zu pf %d mode %d hint %d: %.1f GB/s\n", threads, chunk, pf, stride_mode, hint, reads * chunk / best / 1e9);
}
