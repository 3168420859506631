// Read bandwidth by working-set size (L2 / L3 / DRAM): OMP_NUM_THREADS=2 ./bw MB REPS
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t mb=atol(argv[1]); size_t n=mb<<20; int reps=atoi(argv[2]);
  char*b=aligned_alloc(2<<20,n); memset(b,1,n);
  for(int r=0;r<reps;r++){
    double t=now(); __m512i acc=_mm512_setzero_si512();
    #pragma omp parallel reduction(+:t)
    {
      int id=omp_get_thread_num(),nt=omp_get_num_threads();
      size_t lo=n*id/nt, hi=n*(id+1)/nt; __m512i a=_mm512_setzero_si512();
      for(size_t i=lo;i<hi;i+=256){a=_mm512_xor_si512(a,_mm512_load_si512(b+i));a=_mm512_xor_si512(a,_mm512_load_si512(b+i+64));a=_mm512_xor_si512(a,_mm512_load_si512(b+i+128));a=_mm512_xor_si512(a,_mm512_load_si512(b+i+192));}
      if(_mm512_reduce_add_epi32(a)==12345) printf("x");
    }
    double dt=now()-t; printf("%zu MB rep %d: %.1f GB/s\n",mb,r,n/dt/1e9);
  }
}
