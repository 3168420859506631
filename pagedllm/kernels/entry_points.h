// The kernels' entry points, declared once for the bindings and for the kernels that call
// each other (decoder_loop.cpp runs the layer kernels itself).
#pragma once

#include "common.h"
#include "scratch_buffers.h"

#include <string>

// window > 0: a sliding window (keys seq_len - window .. seq_len - 1 only); <= 0: none.
// k_scales / v_scales: an int8 cache's (common.h int8_cache_scales), else none.
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
void rope_and_cache_write(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                          int64_t num_kv_heads, c10::optional<torch::Tensor> k_scales,
                          c10::optional<torch::Tensor> v_scales);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor argmax_rows(torch::Tensor x);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
bool prefill_attention_available(int64_t head_dim, int64_t block_size);
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                             torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          const std::string& epilogue);
bool packed_gemm_available();
bool amx_available();
torch::Tensor packed_gemm_argmax(torch::Tensor x, torch::Tensor packed);
// quant_gemm's type codes for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights repacked by
// quant_interleave_rows (as ggml gives its repacked Q4_0_8_8 a type of its own): the GGUF type + kInterleaved.
constexpr int64_t kInterleaved = 1000;
// On top of kInterleaved, + kFineScales: Q4_0 / Q4_1 / Q5_0 / Q5_1 repacked alike, their
// activations quantized with a scale per 16 values, not 32 (QuantizedLinear's fine_input_scales).
constexpr int64_t kFineScales = 1000;
// The format of a code below kInterleaved's: the code without its kFineScales.
inline int64_t fine_scales_format(int64_t code) { return code > kFineScales ? code - kFineScales : code; }
torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype);
torch::Tensor quant_dequantize(torch::Tensor w, int64_t qtype, int64_t K);
bool quant_gemm_supports(int64_t qtype);
bool quant_gemm_simd();
torch::Tensor quant_interleave_rows(torch::Tensor w, int64_t qtype);
torch::Tensor quant_interleaved_rows(torch::Tensor w, int64_t qtype, torch::Tensor ids);
torch::Tensor quant_gemm_interleaved(torch::Tensor x, torch::Tensor w, int64_t qtype);
// quant_gemm_interleaved's Q4_0 / Q4_1 / Q5_0 / Q5_1 (+ kFineScales) / Q8_0 at many activation rows on
// AVX512-VNNI (quant_gemm_interleaved_panels.cpp): the leading rows it computed (whole panels of 16;
// 0 where it does not run: too few rows, no VNNI), the caller runs the rest.
int64_t quant_gemm_interleaved_panels(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                                      int64_t qtype, float* y);
// Q4_K (five false) or Q5_K (quant_gemm_q4k_q5k.cpp).
torch::Tensor quant_q45k_interleave(torch::Tensor w, bool five);
torch::Tensor quant_q45k_rows(torch::Tensor w, torch::Tensor ids, bool five);
torch::Tensor quant_gemm_q45k(torch::Tensor x, torch::Tensor w, bool five);
torch::Tensor quant_q6k_interleave(torch::Tensor w);
torch::Tensor quant_q6k_rows(torch::Tensor w, torch::Tensor ids);
torch::Tensor quant_gemm_q6k(torch::Tensor x, torch::Tensor w);
void bind_decoder_plan(pybind11::module_& m);
