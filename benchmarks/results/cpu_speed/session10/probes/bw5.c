// KV-like per-head read pattern with compute between chunks: SEQS seqs x NB blocks x 3 heads x 2 KB, K and V.
// ./bw5 PF_BLOCKS NDP(32 x vdpbf16ps per line) HINT SPREAD [hot]  (hot: 16 sequences, in L2)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define H 3
#define HB 2048
static int NDP, PFH, SPREAD;
static inline void pfchunk(const char*pf,long n){ if(!pf)return; for(long o=0;o<n;o+=64){ if(PFH==1)_mm_prefetch(pf+o,_MM_HINT_T1); else if(PFH==0)_mm_prefetch(pf+o,_MM_HINT_T0); else _mm_prefetch(pf+o,_MM_HINT_T2);} }
static inline __m512i rd(const char*p,long n,__m512i a,const char*pf,__m512*acc){
  __m512bh x=(__m512bh)_mm512_set1_epi32(0x3f803f80);
  if(!SPREAD) pfchunk(pf,n);
  for(long o=0;o<n;o+=64){ if(SPREAD&&pf)pfchunk(pf+o,64); __m512i v=_mm512_load_si512(p+o); a=_mm512_xor_si512(a,v);
    for(int i=0;i<NDP/32;i++) acc[i&7]=_mm512_dpbf16_ps(acc[i&7],x,x); }
  return a;}
int main(int argc,char**argv){
  int pfd=atoi(argv[1]); NDP=atoi(argv[2]); PFH=atoi(argv[3]); SPREAD=atoi(argv[4]); long SEQS=200*8,NB=19; long blk=H*HB; long n=SEQS*NB*blk;
  int hot=argc>5;
  if(hot) SEQS=16;
  n=SEQS*NB*blk;
  char*K=aligned_alloc(2<<20,n),*V=aligned_alloc(2<<20,n); madvise(K,n,MADV_HUGEPAGE); madvise(V,n,MADV_HUGEPAGE); memset(K,1,n);memset(V,1,n);
  double best=1e9; float sink=0;
  for(int r=0;r<(hot?200:8);r++){
    double t=now();
    #pragma omp parallel reduction(+:sink)
    { int id=omp_get_thread_num(),nt=omp_get_num_threads(); __m512i a=_mm512_setzero_si512(); __m512 acc[8]; for(int i=0;i<8;i++)acc[i]=_mm512_setzero_ps();
      for(long s=SEQS*id/nt;s<SEQS*(id+1)/nt;s++){
        char*k=K+s*NB*blk,*v=V+s*NB*blk;
          for(int h=0;h<H;h++){
            for(long b=0;b<NB;b++) a=rd(k+b*blk+h*HB,HB,a,pfd&&b+pfd<NB?k+(b+pfd)*blk+h*HB:(pfd?v+(b+pfd-NB)*blk+h*HB:0),acc);
            for(long b=0;b<NB;b++) a=rd(v+b*blk+h*HB,HB,a,pfd&&b+pfd<NB?v+(b+pfd)*blk+h*HB:(pfd&&h+1<H&&b+pfd-NB<NB?k+(b+pfd-NB)*blk+(h+1)*HB:0),acc);
          }
      }
      for(int i=1;i<8;i++)acc[0]=_mm512_add_ps(acc[0],acc[i]); sink+=_mm512_reduce_add_ps(acc[0]);
      if(_mm512_reduce_add_epi32(a)==12345) printf("x");
    }
    double dt=now()-t; if(dt<best)best=dt;
  }
  printf("pf %d ndp/line %d hint %d spread %d %s: %.2f ms per 8 layers-equiv (%.1f GB/s)\n",pfd,NDP/32,PFH,SPREAD,hot?"HOT":"",best*1e3*(hot?100:1),2*n/best/1e9, sink>1e30?0.0:0.0);
}
