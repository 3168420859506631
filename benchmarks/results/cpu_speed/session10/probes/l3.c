// Does a "weights" buffer stay in L3 across a "KV" stream? ./l3 W_MB KV_MB MODE(0 plain, 1 NTA, 2 clflushopt, 3 T1+clflushopt)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static __m512i rd(char*b,size_t n,int mode){
  __m512i a=_mm512_setzero_si512();
  #pragma omp parallel
  { int id=omp_get_thread_num(),nt=omp_get_num_threads(); size_t lo=n*id/nt/4096*4096, hi=n*(id+1)/nt/4096*4096; __m512i x=_mm512_setzero_si512();
    for(size_t i=lo;i<hi;i+=64){
      if(mode==1) _mm_prefetch(b+i+2048,_MM_HINT_NTA);
      if(mode==3) _mm_prefetch(b+i+2048,_MM_HINT_T1);
      x=_mm512_xor_si512(x,_mm512_load_si512(b+i));
      if(mode==2||mode==3) _mm_clflushopt(b+i);
    }
    if(_mm512_reduce_add_epi32(x)==1234567) printf("x");
  }
  return a;
}
int main(int argc,char**argv){
  size_t wm=atol(argv[1])<<20, km=atol(argv[2])<<20; int mode=atoi(argv[3]);
  char*W=aligned_alloc(2<<20,wm),*K=aligned_alloc(2<<20,km); madvise(W,wm,MADV_HUGEPAGE);madvise(K,km,MADV_HUGEPAGE); memset(W,1,wm);memset(K,1,km);
  double tw=0,tk=0; int R=8;
  for(int r=0;r<R;r++){ double t=now(); rd(W,wm,0); double t1=now(); rd(K,km,mode); double t2=now(); if(r>=2){tw+=t1-t;tk+=t2-t1;} }
  printf("W %zu MB, KV %zu MB mode %d: W %.1f GB/s, KV %.1f GB/s, total %.1f ms/iter\n",wm>>20,km>>20,mode,wm*(R-2)/tw/1e9,km*(R-2)/tk/1e9,(tw+tk)/(R-2)*1e3);
}
