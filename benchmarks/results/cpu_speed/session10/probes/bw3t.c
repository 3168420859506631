// KV-like read patterns: SEQS seqs, NB blocks each, 3 heads x 2 KB per block, K and V caches.
// ./bw3t MODE(0 per head, 1 whole block, 2 per head with K by tile loads) PF_BLOCKS
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/mman.h>
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define H 3
#define HB 2048
static inline __m512i rd(const char*p,long n,__m512i a,const char*pf){for(long o=0;o<n;o+=64){if(pf)_mm_prefetch(pf+o,_MM_HINT_T1);a=_mm512_xor_si512(a,_mm512_load_si512(p+o));}return a;}
static inline void rdt(const char*p,const char*pf){ if(pf){for(long o=0;o<HB;o+=64)_mm_prefetch(pf+o,_MM_HINT_T1);} _tile_loadd(0,p,128); _tile_loadd(1,p+64,128);}
int main(int argc,char**argv){ syscall(SYS_arch_prctl, 0x1023, 18);
  int mode=atoi(argv[1]); int pfd=atoi(argv[2]); long SEQS=200*8,NB=19; long blk=H*HB; long n=SEQS*NB*blk;
  char*K=aligned_alloc(2<<20,n),*V=aligned_alloc(2<<20,n); madvise(K,n,MADV_HUGEPAGE); madvise(V,n,MADV_HUGEPAGE); memset(K,1,n);memset(V,1,n);
  double best=1e9;
  for(int r=0;r<8;r++){
    double t=now();
    #pragma omp parallel
    { cfg_t cfg; memset(&cfg,0,sizeof cfg); cfg.palette_id=1; for(int t=0;t<8;t++){cfg.rows[t]=16;cfg.colsb[t]=64;} _tile_loadconfig(&cfg);
      int id=omp_get_thread_num(),nt=omp_get_num_threads(); __m512i a=_mm512_setzero_si512();
      for(long s=SEQS*id/nt;s<SEQS*(id+1)/nt;s++){
        char*k=K+s*NB*blk,*v=V+s*NB*blk;
        if(mode==2){
          for(int h=0;h<H;h++){
            for(long b=0;b<NB;b++) rdt(k+b*blk+h*HB,pfd&&b+pfd<NB?k+(b+pfd)*blk+h*HB:(pfd?v+(b+pfd-NB)*blk+h*HB:0));
            for(long b=0;b<NB;b++) a=rd(v+b*blk+h*HB,HB,a,pfd&&b+pfd<NB?v+(b+pfd)*blk+h*HB:0);
          }
        } else
        if(mode==0){ // per head: strided 2KB chunks
          for(int h=0;h<H;h++){
            for(long b=0;b<NB;b++) a=rd(k+b*blk+h*HB,HB,a,pfd&&b+pfd<NB?k+(b+pfd)*blk+h*HB:(pfd?v+(b+pfd-NB)*blk+h*HB:0));
            for(long b=0;b<NB;b++) a=rd(v+b*blk+h*HB,HB,a,pfd&&b+pfd<NB?v+(b+pfd)*blk+h*HB:0);
          }
        } else { // whole block
          for(long b=0;b<NB;b++) a=rd(k+b*blk,blk,a,pfd&&b+pfd<NB?k+(b+pfd)*blk:(pfd?v+(b+pfd-NB)*blk:0));
          for(long b=0;b<NB;b++) a=rd(v+b*blk,blk,a,pfd&&b+pfd<NB?v+(b+pfd)*blk:0);
        }
      }
      if(_mm512_reduce_add_epi32(a)==12345) printf("x");
    }
    double dt=now()-t; if(dt<best)best=dt;
  }
  printf("mode %d pf %d: %.2f ms, %.1f GB/s\n",mode,pfd,best*1e3,2*n/best/1e9);
}
