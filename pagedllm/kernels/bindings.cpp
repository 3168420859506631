// Python bindings of the CPU kernels (one extension module for all of them).
#include "entry_points.h"

// The instruction-set features this build was compiled with: what its kernel paths may use (the
// runtime choices, AMX permission and the PAGEDLLM_NO_AMX switch, come on top).
static std::string compiled_isa() {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (on) s += s.empty() ? name : std::string(" ") + name;
  };
#if defined(__AVX2__) && defined(__FMA__)
  add(true, "avx2+fma");
#endif
#if defined(__F16C__)
  add(true, "f16c");
#endif
#if defined(__AVX512F__)
  add(true, "avx512f");
#endif
#if defined(__AVX512BW__)
  add(true, "avx512bw");
#endif
#if defined(__AVX512VNNI__)
  add(true, "avx512vnni");
#endif
#if defined(__AVXVNNI__)
  add(true, "avxvnni");
#endif
#if defined(__AVX512BF16__)
  add(true, "avx512bf16");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  add(true, "amx-bf16");
#endif
  return s.empty() ? "portable" : s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention (CPU): out <- softmax(q k^T * scale) v, K/V read through the block table");
  m.def("rope_and_cache_write", &rope_and_cache_write,
        "RoPE on the q and k parts of a fused qkv row (in place), then k and v stored at their cache slots");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for a fused [T, 2I] gate_up projection");
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place); returns rms_norm(residual) * weight");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention (CPU, AMX) of all prefill chunks of a step, K/V read through the block tables");
  m.def("prefill_attention_available", &prefill_attention_available,
        "whether paged_prefill_attention runs here for this head_dim and block_size");
  m.def("argmax_rows", &argmax_rows, "index of the first maximum of each row of bfloat16 or float32 logits");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[i], t] = -inf where bit t of bitmask row i is clear (structured outputs)");
  m.def("packed_gemm", &packed_gemm,
        "x @ W^T (+ bias, or silu(gate) * up) with W packed in AMX B-tile order (AMX tiles or AVX512-BF16)");
  m.def("packed_gemm_argmax", &packed_gemm_argmax,
        "greedy LM head: per row, the first argmax of bf16(x @ W^T) with W packed as for packed_gemm (no logits written)");
  m.def("packed_gemm_available", &packed_gemm_available, "whether packed_gemm was built (AVX512-BF16)");
  m.def("amx_available", &amx_available, "whether the kernels use AMX tiles here (AMX built and permitted)");
  m.def("quant_gemm", &quant_gemm,
        "x @ W^T with W in GGUF quantized blocks (activations quantized to int16 blocks of 32 on the fly)");
  m.def("quant_dequantize", &quant_dequantize, "float32 values of GGUF quantized rows");
  m.def("quant_gemm_supports", &quant_gemm_supports, "whether quant_gemm handles this GGMLQuantizationType");
  m.def("quant_gemm_simd", &quant_gemm_simd, "whether quant_gemm was built with AVX2 integer dot products");
  m.def("quant_interleave_rows", &quant_interleave_rows,
        "repack Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (in place) or Q4_K / Q5_K / Q6_K (a new tensor) rows, a multiple of 8, "
        "eight rows per group, for quant_gemm_interleaved; returns the repacked tensor");
  m.def("quant_interleaved_rows", &quant_interleaved_rows,
        "rows `ids` of weights repacked by quant_interleave_rows, as GGUF rows (embedding lookups)");
  m.def("quant_gemm_interleaved", &quant_gemm_interleaved,
        "x @ W^T with W interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K (int8 activation blocks) or Q8_0 "
        "(int16) groups");
  m.def("compiled_isa", &compiled_isa, "the instruction-set features this build was compiled with");
  m.def("release_scratch", &release_scratch, "frees the idle buffers of the kernels' output pool; returns their bytes");
  m.def("scratch_idle_bytes", &scratch_idle_bytes, "bytes of the kernels' idle output buffers");
  bind_decoder_plan(m);
}
