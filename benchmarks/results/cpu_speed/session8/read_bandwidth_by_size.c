// Sequential read rate of both threads over buffers of 2 MB .. 1 GB (huge pages), each read
// repeatedly: where the caches end for this process (session 8).
// gcc -O2 -mavx512f -fopenmp -o /tmp/rbw read_bandwidth_by_size.c && /tmp/rbw
// Session 8: 2 MB 327 GB/s, 8-64 MB 54-56, 128 MB 47, 256 MB 31, 1 GB 29: lscpu's 480 MiB L3 is
// shared with the host's other guests; ~100-128 MB of it behaves as ours.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){ long sizes[]={2<<20,8<<20,32<<20,64<<20,128<<20,256<<20,1L<<30};
 char* buf=aligned_alloc(1<<21,1L<<30); madvise(buf,1L<<30,MADV_HUGEPAGE); memset(buf,1,1L<<30);
 for(int si=0;si<7;si++){ long n=sizes[si]; int reps=(int)((4L<<30)/n); if(reps<3)reps=3; double best=0;
  for(int t=0;t<3;t++){ double t0=now(); long sink=0;
   #pragma omp parallel num_threads(2) reduction(|:sink)
   { __m512i acc=_mm512_setzero_si512(); int id=omp_get_thread_num(); for(int r=0;r<reps;r++){ for(long o=id*(n/2);o<(id+1)*(n/2);o+=256){ acc=_mm512_or_si512(acc,_mm512_load_si512(buf+o)); acc=_mm512_or_si512(acc,_mm512_load_si512(buf+o+64)); acc=_mm512_or_si512(acc,_mm512_load_si512(buf+o+128)); acc=_mm512_or_si512(acc,_mm512_load_si512(buf+o+192));} } sink|=_mm512_reduce_or_epi64(acc); }
   double dt=now()-t0; double bw=(double)n*reps/dt/1e9; if(bw>best)best=bw; volatile long x=sink;}
  printf("%4ld MB: %.1f GB/s\n", n>>20, best);}
}
