// 2x2-tile GEMM inner loop, hot: ./gemmloop M ORDER [K=576] [KBLOCK=8] (C tiles stored every KBLOCK k-chunks)
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  long M=atol(argv[1]); int order=atoi(argv[2]); long K=argc>3?atol(argv[3]):576, KB=argc>4?atol(argv[4]):8;
  cfg_t cfg; memset(&cfg,0,sizeof cfg); cfg.palette_id=1; for(int t=0;t<8;t++){cfg.rows[t]=16;cfg.colsb[t]=64;}
  _tile_loadconfig(&cfg);
  uint16_t*A=aligned_alloc(64,M*K*2); uint16_t*B=aligned_alloc(64,32*K*2); memset(A,0,M*K*2); memset(B,0,32*K*2);
  float cb[32*32];
  long kt_n=K/32; long reps=2000;
  double t=now();
  for(long r=0;r<reps;r++){
    for(long kb=0;kb<kt_n;kb+=KB){
      for(long m0=0;m0<M;m0+=32){
        const uint16_t*a0=A+m0*K, *a1=A+(m0+16)*K; 
        _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
        for(long kt=kb;kt<kb+KB&&kt<kt_n;kt++){
          const uint16_t*b0=B+kt*512,*b1=B+(kt_n+kt)*512;
          if(order==0){
            _tile_loadd(2,b0,64);_tile_loadd(3,b1,64);_tile_loadd(0,a0+kt*32,K*2);
            _tile_dpbf16ps(4,0,2);_tile_dpbf16ps(5,0,3);_tile_loadd(1,a1+kt*32,K*2);_tile_dpbf16ps(6,1,2);_tile_dpbf16ps(7,1,3);
          } else if(order==2){
            _tile_loadd(0,a0+kt*32,K*2);_tile_loadd(3,b1,64);_tile_dpbf16ps(5,0,3);
            _tile_loadd(2,b0,64);_tile_dpbf16ps(4,0,2);_tile_loadd(1,a1+kt*32,K*2);_tile_dpbf16ps(7,1,3);_tile_dpbf16ps(6,1,2);
          } else if(order==3){
            _tile_loadd(0,a0+kt*32,K*2);_tile_loadd(2,b0,64);_tile_loadd(3,b1,64);_tile_loadd(1,a1+kt*32,K*2);
            _tile_dpbf16ps(4,0,2);_tile_dpbf16ps(5,0,3);_tile_dpbf16ps(6,1,2);_tile_dpbf16ps(7,1,3);
          } else {
            _tile_loadd(0,a0+kt*32,K*2);_tile_loadd(2,b0,64);_tile_dpbf16ps(4,0,2);
            _tile_loadd(3,b1,64);_tile_dpbf16ps(5,0,3);_tile_loadd(1,a1+kt*32,K*2);_tile_dpbf16ps(6,1,2);_tile_dpbf16ps(7,1,3);
          }
        }
        _tile_stored(4,cb,128);_tile_stored(5,cb+16,128);_tile_stored(6,cb+512,128);_tile_stored(7,cb+528,128);
      }
    }
  }
  double dt=now()-t; long tdps=reps*kt_n*(M/32)*4;
  printf("M %ld order %d: %.2f ns per TDP (A %ld KB)\n",M,order,dt/tdps*1e9,M*K*2/1024);
}
