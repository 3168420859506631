// tdpbf16ps throughput and latency with M-row A/C tiles: ./amx M
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static cfg_t cfg;
__attribute__((aligned(64))) static uint16_t buf[8][16*32];
__attribute__((aligned(64))) static float cb[16*16];
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int M=atoi(argv[1]);
  memset(&cfg,0,sizeof cfg); cfg.palette_id=1;
  for(int t=0;t<8;t++){cfg.rows[t]=16;cfg.colsb[t]=64;}
  cfg.rows[0]=M; for(int t=4;t<8;t++) cfg.rows[t]=M;
  _tile_loadconfig(&cfg);
  long N=10000000;
  _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
  _tile_loadd(0,buf[0],64);_tile_loadd(1,buf[1],64);_tile_loadd(2,buf[2],64);_tile_loadd(3,buf[3],64);
  double t=now();
  for(long n=0;n<N;n++){ _tile_dpbf16ps(4,0,1);_tile_dpbf16ps(5,0,2);_tile_dpbf16ps(6,0,3);_tile_dpbf16ps(7,0,1);}
  double dt=now()-t; printf("M=%d: 4 independent: %.2f ns per TDP\n",M,dt/N/4*1e9);
  t=now();
  for(long n=0;n<N;n++){ _tile_dpbf16ps(4,0,1);}
  dt=now()-t; printf("M=%d: chain: %.2f ns per TDP\n",M,dt/N*1e9);
  t=now();
  for(long n=0;n<N;n++){ _tile_loadd(1,buf[1+(n&3)],64);_tile_dpbf16ps(4,0,1);_tile_loadd(2,buf[2],64);_tile_dpbf16ps(5,0,2);_tile_loadd(3,buf[3],64);_tile_dpbf16ps(6,0,3);_tile_loadd(1,buf[4],64);_tile_dpbf16ps(7,0,1);}
  dt=now()-t; printf("M=%d: 4 indep with B loads (L1): %.2f ns per TDP\n",M,dt/N/4*1e9);
  t=now();
  for(long n=0;n<N;n++){ _tile_loadd(0,buf[5],64);_tile_loadd(1,buf[1],64);_tile_dpbf16ps(4,0,1);_tile_stored(4,cb,64);}
  dt=now()-t; printf("M=%d: load A,B, tdp, store C chain: %.2f ns per iter\n",M,dt/N*1e9);
  _tile_release();
}
