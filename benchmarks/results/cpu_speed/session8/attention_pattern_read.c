// Decode attention's memory pattern without its arithmetic (session 8): 200 sequences x 19 placed
// 16-token blocks of a [blocks][3 heads][16][64] bf16 cache, 8 layers of K and V, caches flushed.
// gcc -O2 -mavx512f -fopenmp -o /tmp/apr attention_pattern_read.c && /tmp/apr MODE PREFETCH
// MODE 0: per (sequence, head) the 2 KB runs of K, then of V, as the kernel; 1: whole 6 KB blocks.
// Session 8: 25.7-26.8 GB/s (1.74-1.82 ms/layer) in all four cases, vs the kernel's ~14.7 GB/s
// (3.1-3.3 ms/layer) on the same data shape (../session3/attention_bandwidth.py 2 huge, PLACED=1).
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// cache [blocks][3 heads][16][64] bf16 = 6 KB per block; 200 seqs x 19 blocks placed; 8 layers (K and V separate caches)
#define SEQS 200
#define NB 19
int main(int argc,char**argv){ int mode=atoi(argv[1]); int pf=atoi(argv[2]);
 long blk=6144, per_layer=(long)SEQS*NB*blk; int L=8; long tot=per_layer*2*L;
 char* buf=aligned_alloc(1<<21,tot); madvise(buf,tot,MADV_HUGEPAGE); memset(buf,1,tot);
 char* fl=malloc(512<<20);
 double best=0;
 for(int rep=0;rep<5;rep++){ memset(fl,rep,512<<20); double t0=now(); long sink=0;
  for(int l=0;l<L;l++){ char* K=buf+(long)l*2*per_layer; char* V=K+per_layer;
   #pragma omp parallel num_threads(2) reduction(|:sink)
   { __m512i acc=_mm512_setzero_si512(); int id=omp_get_thread_num();
     if(mode==0){ // per (seq, head) item: K pass over 2KB runs, then V pass
       for(int it=id*SEQS*3/2; it<(id+1)*SEQS*3/2; it++){ int s=it/3,h=it%3;
         for(int pass=0;pass<2;pass++){ char* base=(pass?V:K)+(long)s*NB*blk+h*2048;
           for(int b=0;b<NB;b++){ char* p=base+(long)b*blk; if(pf && b+2<NB) for(int o=0;o<2048;o+=64) _mm_prefetch(p+2*blk+o,_MM_HINT_T1);
             for(int o=0;o<2048;o+=64) acc=_mm512_or_si512(acc,_mm512_load_si512(p+o)); } } } }
     else { // per seq: whole 6 KB blocks (all heads), K pass then V pass
       for(int s=id*SEQS/2; s<(id+1)*SEQS/2; s++){
         for(int pass=0;pass<2;pass++){ char* base=(pass?V:K)+(long)s*NB*blk;
           for(long o=0;o<(long)NB*blk;o+=64){ if(pf && (o&2047)==0 && o+4*2048<(long)NB*blk) for(int q=0;q<2048;q+=64)_mm_prefetch(base+o+4*2048+q,_MM_HINT_T1);
             acc=_mm512_or_si512(acc,_mm512_load_si512(base+o)); } } } }
     sink|=_mm512_reduce_or_epi64(acc); } }
  double dt=now()-t0; double bw=(double)per_layer*2*L/dt/1e9; if(bw>best)best=bw; }
 printf("mode %d pf %d: %.1f GB/s (%.2f ms/layer)\n",mode,pf,best,per_layer*2/best/1e6);
}
