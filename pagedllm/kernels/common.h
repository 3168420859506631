// Shared helpers of the CPU kernels: bf16 <-> float conversions and work splitting.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDLLM_AVX512BF16 1
#else
#define PAGEDLLM_AVX512BF16 0
#endif
// AMX tiles (bf16 tile products), for the prefill attention kernel.
#if PAGEDLLM_AVX512BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLLM_AMX 1
#else
#define PAGEDLLM_AMX 0
#endif

#if PAGEDLLM_AMX
#include <sys/syscall.h>
#include <unistd.h>

// AMX tile set-up shared by the tile kernels (prefill attention, GEMM).
constexpr int kTileRows = 16;  // rows of every tile; K dimension 32 bf16 (64 bytes)

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes: A (16 x 32 bf16), B (16 pair-rows x 16 x 2 bf16), C (16 x 16 float).
// A static object: gcc sank the stores of a stack copy below ldtilecfg (#GP on a garbage config).
inline const TileConfig kTiles = [] {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  return cfg;
}();

// Per thread, before the first tile instruction; _tile_release() after the last.
inline void configure_tiles() { _tile_loadconfig(&kTiles); }

// Linux hands out the tile register state only on request, once per process. PAGEDLLM_NO_AMX=1
// declines it, so the AVX512-BF16 paths (those of CPUs without AMX) run and are tested here too.
inline bool amx_permitted() {
  static const bool ok = [] {
    if (const char* off = std::getenv("PAGEDLLM_NO_AMX"); off != nullptr && off[0] == '1' && off[1] == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
#endif

// The KV cache element types narrower than float32 activations (kv_cache_dtype) that the
// attention and RoPE + cache-write kernels read and write (interface.py NARROW_KV_DTYPES).
inline bool narrow_kv_cache(c10::ScalarType t) {
  return t == torch::kBFloat16 || t == torch::kHalf || t == torch::kFloat8_e4m3fn || t == torch::kFloat8_e5m2 ||
         t == torch::kChar;
}

// An int8 cache row's scale groups (pagedllm/attention/int8_kv.py scale_groups): one scale per
// row up to 64 values (or where the row is no multiple of 32), else one per 32 values: a wide
// head's range is set by a few large channels, which left the others few steps.
constexpr int64_t kInt8Group = 32, kInt8WholeRow = 64;
constexpr int64_t int8_scale_groups(int64_t head_dim) {
  return head_dim <= kInt8WholeRow || head_dim % kInt8Group ? 1 : head_dim / kInt8Group;
}

// An int8 cache's scales: float32 [num_blocks, num_kv_heads, block_size, groups], groups scales
// per cache row (token and KV head), given for int8 caches and only for them. Returns their data
// (null for the other dtypes).
inline float* int8_cache_scales(const char* who, const torch::Tensor& cache, const c10::optional<torch::Tensor>& scales) {
  const bool int8 = cache.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 == scales.has_value(), who, ": scales go with an int8 cache, and only with one");
  if (!int8) return nullptr;
  const torch::Tensor& sc = *scales;
  TORCH_CHECK(sc.scalar_type() == torch::kFloat && sc.is_contiguous() && sc.dim() == 4 && cache.dim() == 4 &&
                  sc.size(0) == cache.size(0) && sc.size(1) == cache.size(1) && sc.size(2) == cache.size(2) &&
                  sc.size(3) == int8_scale_groups(cache.size(3)),
              who, ": an int8 cache's scales are float32 [num_blocks, num_kv_heads, block_size, groups], contiguous");
  return sc.data_ptr<float>();
}

inline float bf16_bits_to_float(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }
// float -> bfloat16 bits, round to nearest even (no NaNs reach these kernels).
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

#if PAGEDLLM_AVX512BF16
inline __m512 bf16x16_bits_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 bf16x16_to_float(const uint16_t* p) { return bf16x16_bits_to_float(_mm256_loadu_si256((const __m256i*)p)); }
// Round to nearest even, as torch's float -> bfloat16 conversion does.
inline void store_float_as_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round_bf16x16(__m512 v) { return bf16x16_bits_to_float((__m256i)_mm512_cvtneps_pbh(v)); }

// e^x to ~2 float ulps: 2^n * e^r with n = round(x log2 e), r = x - n ln 2 (|r| <= 0.35, ln 2 in two
// parts) and e^r by its degree-6 Taylor polynomial (truncation ~1.2e-7). glibc's vectorized expf
// plus a vdivps made SiLU ~2 cycles per element, as much as the rest of an MLP epilogue.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators of one row of raw attention scores sj[0 .. len) (scaled here), rounded to bf16
// into pj (pj[len] = 0 when len2 = len + 1: an even length for key pairs); returns 1 / their sum.
// Decode and prefill attention share it.
inline float probs_bf16(const float* sj, int64_t len, int64_t len2, float scale, uint16_t* pj) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-3.0e38f);
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 mk = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
    mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_loadu_ps(sj + t));
  }
  const __m512 m = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), vscale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 mk = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mk, sj + t), vscale, m)));
    sum = _mm512_add_ps(sum, e);
    _mm256_mask_storeu_epi16(pj + t, mk, (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (len2 > len) pj[len] = 0;
  return 1.f / _mm512_reduce_add_ps(sum);
}

// bf16(bf16(silu(g)) * u) for 16 float gate / up values, each first rounded to bf16 (as a bf16
// gate_up row holds them): the roundings of the scalar silu_and_mul. 1 / (1 + e^-g) by rcp14
// and one Newton step (~1e-8 relative).
inline __m256i silu_mul_bf16x16(__m512 g, __m512 u) {
  g = round_bf16x16(g);
  u = round_bf16x16(u);
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
  const __m512 silu = round_bf16x16(_mm512_mul_ps(g, inv));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u));
}
#endif

// Splits items [0, n) into `parts` contiguous ranges of about equal total cost; returns the
// parts + 1 boundaries. Cheap enough to run every call (one pass over the items).
template <typename Cost>
std::vector<int64_t> balanced_split(int64_t n, int64_t parts, Cost cost) {
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += cost(i);
  int64_t acc = 0, k = 1;
  for (int64_t i = 0; i < n && k < parts; ++i) {
    acc += cost(i);
    while (k < parts && acc * parts >= total * k) bounds[k++] = i + 1;
  }
  return bounds;
}

// Every index a kernel reads from a block table is in range: the length within the table's row,
// and the block ids it covers within the cache. A bad table from a bug upstream is then an
// exception (one failed step, contained by the engine) rather than a read or write anywhere in
// memory. O(blocks) per sequence: nothing next to the attention over those blocks.
// first_key: the first key read (a sliding window's start); the blocks before it may be released.
inline void check_block_table_row(const char* who, int64_t seq, const int64_t* table, int64_t max_blocks, int64_t len,
                                  int64_t num_blocks, int64_t block_size, int64_t first_key = 0) {
  TORCH_CHECK(len >= 0 && len <= max_blocks * block_size, who, ": sequence ", seq, " has length ", len,
              ", more than its block table row holds (", max_blocks, " blocks of ", block_size, ")");
  const int64_t n = (len + block_size - 1) / block_size;
  for (int64_t b = first_key / block_size; b < n; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, who, ": sequence ", seq, " block ", b, " is ", table[b],
                ", outside the cache's ", num_blocks, " blocks");
}
