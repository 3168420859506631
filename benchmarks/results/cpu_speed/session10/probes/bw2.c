// One core's read bandwidth with software prefetch: ./bw2 MB REPS DIST_BYTES HINT(0=T0,1=T1,2=NTA) STREAMS
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t mb=atol(argv[1]); size_t n=mb<<20; int reps=atoi(argv[2]); long dist=atol(argv[3]); int hint=atoi(argv[4]); int streams=atoi(argv[5]);
  char*b=aligned_alloc(2<<20,n); memset(b,1,n);
  double best=0;
  for(int r=0;r<reps;r++){
    double t=now();
    #pragma omp parallel
    {
      int id=omp_get_thread_num(),nt=omp_get_num_threads();
      size_t lo=n*id/nt, hi=n*(id+1)/nt; __m512i a=_mm512_setzero_si512();
      size_t len=(hi-lo)/streams;
      for(size_t i=0;i<len;i+=256){
        for(int s=0;s<streams;s++){ char*p=b+lo+s*len+i;
        if(dist){ if(hint==1){_mm_prefetch(p+dist,_MM_HINT_T1);_mm_prefetch(p+dist+64,_MM_HINT_T1);_mm_prefetch(p+dist+128,_MM_HINT_T1);_mm_prefetch(p+dist+192,_MM_HINT_T1);}
                  else if(hint==0){_mm_prefetch(p+dist,_MM_HINT_T0);_mm_prefetch(p+dist+64,_MM_HINT_T0);_mm_prefetch(p+dist+128,_MM_HINT_T0);_mm_prefetch(p+dist+192,_MM_HINT_T0);}
                  else {_mm_prefetch(p+dist,_MM_HINT_NTA);_mm_prefetch(p+dist+64,_MM_HINT_NTA);_mm_prefetch(p+dist+128,_MM_HINT_NTA);_mm_prefetch(p+dist+192,_MM_HINT_NTA);} }
        a=_mm512_xor_si512(a,_mm512_load_si512(p));a=_mm512_xor_si512(a,_mm512_load_si512(p+64));a=_mm512_xor_si512(a,_mm512_load_si512(p+128));a=_mm512_xor_si512(a,_mm512_load_si512(p+192));}
      }
      if(_mm512_reduce_add_epi32(a)==12345) printf("x");
    }
    double dt=now()-t; double g=n/dt/1e9; if(g>best)best=g;
  }
  printf("dist %ld hint %d streams %d: best %.1f GB/s\n",dist,hint,streams,best);
}
