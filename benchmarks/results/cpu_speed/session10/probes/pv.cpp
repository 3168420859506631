// p.v alone, hot: current dp path vs staging + AMX. One item: len keys, D=64, G=3, V rows contiguous.
// ./pv LEN ITEMS
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <cmath>
#include <initializer_list>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
struct cfg_t { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
constexpr int D=64, G=3, C=D/32, V=D/16;
static inline uint16_t f2b(float f){uint32_t u; memcpy(&u,&f,4); u+=0x7fff+((u>>16)&1); return u>>16;}
static inline float b2f(uint16_t b){uint32_t u=(uint32_t)b<<16; float f; memcpy(&f,&u,4); return f;}
void pv_dp(const uint16_t* vb, const uint16_t* P, int len, int len2, float* acc){
  __m512 a[G][V]; for(int j=0;j<G;j++)for(int v=0;v<V;v++)a[j][v]=_mm512_setzero_ps();
  for(int i=0;i<len;i+=2){ const uint16_t* r0=vb+i*D; __m512i w[V];
    for(int c=0;c<C;c++){ __m512i x0=_mm512_loadu_si512(r0+c*32); __m512i x1= i+1<len?_mm512_loadu_si512(r0+D+c*32):_mm512_setzero_si512();
      w[2*c]=_mm512_unpacklo_epi16(x0,x1); w[2*c+1]=_mm512_unpackhi_epi16(x0,x1);}
    for(int j=0;j<G;j++){ __m512bh pp=(__m512bh)_mm512_set1_epi32(*(const int32_t*)(P+j*len2+i)); for(int v=0;v<V;v++)a[j][v]=_mm512_dpbf16_ps(a[j][v],pp,(__m512bh)w[v]);}}
  for(int j=0;j<G;j++){ alignas(64) float tmp[16]; for(int v=0;v<V;v++){ _mm512_store_ps(tmp,a[j][v]); int c=v/2,h=v%2; for(int k=0;k<4;k++)for(int e=0;e<4;e++) acc[j*D+32*c+8*k+4*h+e]=tmp[4*k+e];}}
}
// P: [G][len32] bf16 (zeros past len). stage: [16 pairs][V][32 bf16]
void pv_amx(const uint16_t* vb, const uint16_t* P, int len, int len32, float* acc){
  alignas(64) uint16_t stage[16*V*32];
  _tile_zero(3);_tile_zero(5);_tile_zero(6);_tile_zero(7);
  for(int t=0;t<len;t+=32){
    for(int p=0;p<16;p++){ int i=t+2*p; const uint16_t* r0=vb+i*D; __m512i*dst=(__m512i*)(stage+p*V*32);
      for(int c=0;c<C;c++){ __m512i x0= i<len?_mm512_loadu_si512(r0+c*32):_mm512_setzero_si512(); __m512i x1= i+1<len?_mm512_loadu_si512(r0+D+c*32):_mm512_setzero_si512();
        _mm512_store_si512(dst+2*c,_mm512_unpacklo_epi16(x0,x1)); _mm512_store_si512(dst+2*c+1,_mm512_unpackhi_epi16(x0,x1));}}
    _tile_loadd(1,P+t,len32*2);
    _tile_loadd(0,stage+0*32,V*64); _tile_dpbf16ps(3,1,0);
    _tile_loadd(0,stage+1*32,V*64); _tile_dpbf16ps(5,1,0);
    _tile_loadd(0,stage+2*32,V*64); _tile_dpbf16ps(6,1,0);
    _tile_loadd(0,stage+3*32,V*64); _tile_dpbf16ps(7,1,0);
  }
  alignas(64) float cb[4][G*16];
  _tile_stored(3,cb[0],64);_tile_stored(5,cb[1],64);_tile_stored(6,cb[2],64);_tile_stored(7,cb[3],64);
  for(int j=0;j<G;j++) for(int v=0;v<V;v++){ int c=v/2,h=v%2; for(int k=0;k<4;k++)for(int e=0;e<4;e++) acc[j*D+32*c+8*k+4*h+e]=cb[v][j*16+4*k+e];}
}
void pv_amx2(const uint16_t* vb, const uint16_t* P, int len, int len32, float* acc){
  alignas(64) uint16_t stage[2][16*V*32];
  _tile_zero(3);_tile_zero(5);_tile_zero(6);_tile_zero(7);
  auto st=[&](int t,uint16_t*sb){ for(int p=0;p<16;p++){ int i=t+2*p; const uint16_t* r0=vb+i*D; __m512i*dst=(__m512i*)(sb+p*V*32);
      for(int c=0;c<C;c++){ __m512i x0= i<len?_mm512_loadu_si512(r0+c*32):_mm512_setzero_si512(); __m512i x1= i+1<len?_mm512_loadu_si512(r0+D+c*32):_mm512_setzero_si512();
        _mm512_store_si512(dst+2*c,_mm512_unpacklo_epi16(x0,x1)); _mm512_store_si512(dst+2*c+1,_mm512_unpackhi_epi16(x0,x1));}}};
  st(0,stage[0]);
  for(int t=0,cur=0;t<len;t+=32,cur^=1){
    if(t+32<len) st(t+32,stage[cur^1]);
    uint16_t*sb=stage[cur];
    _tile_loadd(1,P+t,len32*2);
    _tile_loadd(0,sb+0*32,V*64); _tile_loadd(2,sb+1*32,V*64); _tile_dpbf16ps(3,1,0); _tile_dpbf16ps(5,1,2);
    _tile_loadd(0,sb+2*32,V*64); _tile_loadd(2,sb+3*32,V*64); _tile_dpbf16ps(6,1,0); _tile_dpbf16ps(7,1,2);
  }
  alignas(64) float cb[4][G*16];
  _tile_stored(3,cb[0],64);_tile_stored(5,cb[1],64);_tile_stored(6,cb[2],64);_tile_stored(7,cb[3],64);
  for(int j=0;j<G;j++) for(int v=0;v<V;v++){ int c=v/2,h=v%2; for(int k=0;k<4;k++)for(int e=0;e<4;e++) acc[j*D+32*c+8*k+4*h+e]=cb[v][j*16+4*k+e];}
}
int main(int argc,char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  int len=atoi(argv[1]), items=atoi(argv[2]); int len2=(len+1)/2*2, len32=(len+31)/32*32;
  cfg_t cfg; memset(&cfg,0,sizeof cfg); cfg.palette_id=1; cfg.rows[0]=16; cfg.colsb[0]=64; cfg.rows[1]=G; cfg.colsb[1]=64; cfg.rows[2]=16; cfg.colsb[2]=64;
  for(int t: {3,5,6,7}){cfg.rows[t]=G;cfg.colsb[t]=64;}
  _tile_loadconfig(&cfg);
  uint16_t* vb=(uint16_t*)aligned_alloc(64,(size_t)items*len32*D*2); uint16_t* P=(uint16_t*)aligned_alloc(64,(size_t)G*len32*2+64);
  for(size_t i=0;i<(size_t)items*len32*D;i++) vb[i]=f2b((rand()/(float)RAND_MAX)-0.5f);
  memset(P,0,G*len32*2); for(int j=0;j<G;j++)for(int t=0;t<len;t++) P[j*len32+t]=f2b(rand()/(float)RAND_MAX/len);
  // dp version wants [G][len2]: use len32 stride too (fine)
  float a1[G*D],a2[G*D];
  pv_dp(vb,P,len,len32,a1); pv_amx(vb,P,len,len32,a2); double md=0; for(int i=0;i<G*D;i++) md=fmax(md,fabs(a1[i]-a2[i])); printf("max diff %.3g (val ~%.3g)\n",md,a1[0]);
  for(int rep=0;rep<3;rep++){
  double t=now(); for(int r=0;r<200;r++) for(int it=0;it<items;it++) pv_dp(vb+(size_t)it*len32*D,P,len,len32,a1); double d1=(now()-t)/200/items/len*1e9;
  t=now(); for(int r=0;r<200;r++) for(int it=0;it<items;it++) pv_amx(vb+(size_t)it*len32*D,P,len,len32,a2); double d2=(now()-t)/200/items/len*1e9;
  t=now(); for(int r=0;r<200;r++) for(int it=0;it<items;it++) pv_amx2(vb+(size_t)it*len32*D,P,len,len32,a2); double d3=(now()-t)/200/items/len*1e9;
  printf("len %d items %d: dp %.2f ns/key, amx %.2f ns/key, amx2 %.2f\n",len,items,d1,d2,d3);}
  _tile_release();
}
