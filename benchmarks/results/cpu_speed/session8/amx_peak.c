// AMX bf16 tile-product rate by where the operands come from (session 8).
// gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -pthread -o /tmp/amx_peak amx_peak.c && /tmp/amx_peak
// Each iteration: 2 A + 2 B tile loads (1 KB each, sequential in a window of the given size), 4 tile
// products into 4 C tiles (a 2x2 block, as amx_gemm). Windows of 16 KB sit in L1, 256 KB in L2.
// Session 8: A 16K/B 16K 3.22 (1 thread) / 6.64 (2) TFLOP/s; one operand from L2 3.32 / 6.48;
// both from L2 2.48 / 4.74; both 1 MB (L2 spills) 0.76 / 1.41; A streamed from memory 0.49 / 0.69.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
#include <pthread.h>
#include <stdlib.h>
typedef struct { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void cfg(){ cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;} _tile_loadconfig(&c);}
long iters=1000000; long asz, bsz; // bytes windows
typedef struct {long mode; char* a; char* b;} arg_t;
void* run(void* p){ arg_t* g=p; cfg(); _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
 long ao=0, bo=0;
 for(long i=0;i<iters;i++){
  _tile_loadd(2,g->b+bo,64);_tile_loadd(3,g->b+bo+1024,64); _tile_loadd(0,g->a+ao,64);_tile_loadd(1,g->a+ao+1024,64);
  _tile_dpbf16ps(4,0,2);_tile_dpbf16ps(5,0,3);_tile_dpbf16ps(6,1,2);_tile_dpbf16ps(7,1,3);
  ao+=2048; if(ao>=asz) ao=0; bo+=2048; if(bo>=bsz) bo=0; }
 float C[256]; _tile_stored(4,C,64); return 0;}
int main(int argc,char**argv){ syscall(SYS_arch_prctl,0x1023,18);
 long sizes[][2]={{16384,16384},{262144,16384},{16384,262144},{262144,262144},{1<<20,1<<20},{64<<20,16384}};
 for(int s=0;s<6;s++) for(int th=1;th<=2;th++){ asz=sizes[s][0]; bsz=sizes[s][1]; pthread_t t[2]; arg_t g[2];
  for(int i=0;i<th;i++){g[i].a=aligned_alloc(4096,asz); g[i].b=aligned_alloc(4096,bsz); memset(g[i].a,0,asz); memset(g[i].b,0,bsz);}
  double t0=now(); for(int i=0;i<th;i++) pthread_create(&t[i],0,run,&g[i]); for(int i=0;i<th;i++) pthread_join(t[i],0); double dt=now()-t0;
  printf("A %ldK B %ldK threads %d: %.2f TFLOP/s\n",asz>>10,bsz>>10,th, th*iters*4*16.0*16*32*2/dt/1e12);} }
