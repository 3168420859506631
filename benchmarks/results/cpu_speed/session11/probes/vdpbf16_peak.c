// Peak of AVX512-BF16 dot products on this machine: 12 independent vdpbf16ps chains per thread,
// 2 threads. Session 11 (AMD EPYC Zen 4): ~214 GFLOP/s per core (64 FLOP per instruction).
//   gcc -O2 -march=native -fopenmp vdpbf16_peak.c -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main() {
#pragma omp parallel num_threads(2)
  {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(0.f);
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double t0 = omp_get_wtime();
    const long n = 200000000 / 12;
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
    }
    const double t = omp_get_wtime() - t0;
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
#pragma omp critical
    printf("thread %d: %.1f GFLOP/s (%g)\n", omp_get_thread_num(), n * 12 * 64.0 / t / 1e9, s);
  }
}
