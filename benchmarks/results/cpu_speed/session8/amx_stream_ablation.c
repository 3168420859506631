// One thread, one 2x2-tile GEMM pass over 100 MB of K=576 weights (from memory, huge pages, caches
// flushed), M rows of packed A: which part of the kernel costs the time (session 8).
// gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16 -o /tmp/amx_ab amx_stream_ablation.c
// /tmp/amx_ab M PREFETCH(0/1/2) DISTANCE(pairs) DROP   DROP bit 1: no tile products, bit 2: no A loads.
// Session 8, M=224, prefetch 1, distance 1: full 21.2 ms; no products (loads only) 17.2; no A loads
// 9.5; neither 7.4. The A tiles re-read from L2 for every strip pair, not the products, set the time.
// (Results are not meaningful numbers: A and W are constant; only the timing is.)
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <time.h>
typedef struct { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void cfg(){ cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;} _tile_loadconfig(&c);}
int main(int argc,char**argv){ syscall(SYS_arch_prctl,0x1023,18); cfg();
 int M=atoi(argv[1]); int K=576; int pf=atoi(argv[2]); int notdp=argc>4?atoi(argv[4]):0; int dist=argc>3?atoi(argv[3]):1;
 long W=100L<<20; int kt_n=K/32, blocks=(M+31)/32; long pe=2*kt_n*512; long pairs=W/2/pe;
 uint16_t* w=aligned_alloc(1<<21, W); madvise(w,W,MADV_HUGEPAGE); memset(w,1,W);
 uint16_t* a=aligned_alloc(4096, (size_t)blocks*kt_n*2048); memset(a,1,(size_t)blocks*kt_n*2048);
 char* fl=malloc(400<<20);
 float cbuf[1024] __attribute__((aligned(64)));
 double best=1e9;
 for(int rep=0;rep<5;rep++){ memset(fl,rep,400<<20); double t0=now();
 for(long p=0;p<pairs;p++){ uint16_t* b0=w+p*pe; uint16_t* b1=b0+pe/2; const char* nx=(const char*)(b0+dist*pe); long lines=pe*2/64;
  for(int j=0;j<blocks;j++){ uint16_t* aj=a+(long)j*kt_n*1024;
   _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
   for(int kt=0;kt<kt_n;kt++){
     if(pf==1){ long l0=lines*(j*kt_n+kt)/(blocks*kt_n), l1=lines*(j*kt_n+kt+1)/(blocks*kt_n); for(long l=l0;l<l1;l++) _mm_prefetch(nx+l*64,_MM_HINT_T1);}
     if(pf==2 && j==0){ long l0=lines*kt/kt_n, l1=lines*(kt+1)/kt_n; for(long l=l0;l<l1;l++) _mm_prefetch(nx+l*64,_MM_HINT_T1);}
     _tile_loadd(2,b0+kt*512,64);_tile_loadd(3,b1+kt*512,64); if(!(notdp&2)) _tile_loadd(0,aj+kt*1024,64);
     if(!(notdp&1)){_tile_dpbf16ps(4,0,2);_tile_dpbf16ps(5,0,3);} if(!(notdp&2)) _tile_loadd(1,aj+kt*1024+512,64); if(!(notdp&1)){_tile_dpbf16ps(6,1,2);_tile_dpbf16ps(7,1,3);}}
   _tile_stored(4,cbuf,128);_tile_stored(5,cbuf+16,128);_tile_stored(6,cbuf+512,128);_tile_stored(7,cbuf+528,128);
  }}
 double dt=now()-t0; if(dt<best)best=dt;}
 printf("M=%d pf=%d dist=%d: %.1f ms %.1f GB/s %.2f TF\n",M,pf,dist,best*1e3,pairs*pe*2/best/1e9,2.0*blocks*32*pairs*32*K/best/1e12);
}
