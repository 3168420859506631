// Host page-aging tax: what the hypervisor charges per huge page in use per second of wall.
// On KVM/Firecracker guests the first touch of a 2 MiB page after the host has aged it stalled the
// vCPU ~135 us (Intel Sapphire Rapids VM, 2026-11-30); on the AMD Zen 4 VMs it was 1-2 us.
// benchmarks/results/cpu_speed/run_speed.sh runs it before every throughput round.
//   gcc -O2 -o /tmp/page_aging page_aging.c && /tmp/page_aging [SECONDS_PER_TEST=4]
// 1. Idle test: touch all 1024 huge pages of a 2 GiB buffer, wait (spinning, nothing else
//    touched), touch one line of each page again: how many are slow and what one costs.
// 2. Tax test: keep N pages in use (touch each every 20 / 100 ms, as an engine touches its weights
//    and live KV every step) and report the time spent touching, per page per second of wall.
// The guest's own counters (minor faults, sys time) do not move: the cost is on the host side.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <x86intrin.h>

static double ghz;  // TSC rate, calibrated against CLOCK_MONOTONIC

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static void spin_ms(double ms) {
  const uint64_t end = __rdtsc() + (uint64_t)(ms * ghz * 1e6);
  while (__rdtsc() < end) {
  }
}
static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? atof(argv[1]) : 4.0;
  const double t0 = now_s();
  const uint64_t c0 = __rdtsc();
  while (now_s() - t0 < 0.2) {
  }
  ghz = (__rdtsc() - c0) / (now_s() - t0) / 1e9;

  const size_t huge = 2u << 20, bytes = (size_t)2 << 30, pages = bytes / huge;
  volatile char* x = aligned_alloc(huge, bytes);
  madvise((void*)x, bytes, MADV_HUGEPAGE);
  memset((void*)x, 0, bytes);
  double* cost = malloc(pages * sizeof(double));

  const double waits_ms[] = {0, 50, 200, 1000};
  for (int w = 0; w < 4; ++w) {
    for (size_t p = 0; p < pages; ++p) x[p * huge] = 1;
    spin_ms(waits_ms[w]);
    double total = 0;
    int slow = 0;
    for (size_t p = 0; p < pages; ++p) {
      const uint64_t a = __rdtsc();
      x[p * huge + 37 * 4096 + 5 * 64] = 2;
      _mm_mfence();
      cost[p] = (__rdtsc() - a) / ghz;
      total += cost[p];
      slow += cost[p] > 20000;
    }
    qsort(cost, pages, sizeof(double), cmp_double);
    printf("idle %4.0f ms: %4d of %zu pages slow (>20 us) on the next touch, p99 %6.0f us, total %6.1f ms\n",
           waits_ms[w], slow, pages, cost[pages * 99 / 100] / 1e3, total / 1e6);
  }

  const int in_use[] = {128, 1024};
  const double period_ms[] = {20, 100};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const int n = in_use[i];
      const int cycles = (int)(seconds * 1000 / period_ms[j]);
      double touching = 0;
      for (int c = 0; c < cycles; ++c) {
        const uint64_t a = __rdtsc();
        for (int p = 0; p < n; ++p) x[(size_t)p * huge + ((size_t)c * 64) % huge] = (char)c;
        touching += (__rdtsc() - a) / ghz;
        spin_ms(period_ms[j]);
      }
      const double wall = cycles * period_ms[j] / 1000;
      printf("%4d pages in use, touched every %3.0f ms: %6.1f ms per s of wall = %4.0f us per page per s\n", n,
             period_ms[j], touching / 1e6 / wall, touching / 1e3 / wall / n);
    }
  return 0;
}
