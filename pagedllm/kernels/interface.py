"""CpuKernels: the typed interface of the compiled CPU kernels (one extension module per
instruction-set level, see build.py). Models, layers and the runner take this object, never the raw module,
so what each kernel takes and does is written down once, here.

All tensors are on the CPU; bf16 unless named otherwise (the layer kernels, RoPE + cache write,
SiLU-and-mul, add + RMSNorm and the row argmax, take float32 too). Each kernel is tested against the
PyTorch reference path (tests/test_cpu_kernels.py, tests/test_attention.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedllm.attention.int8_kv import cache_scales

# rope_and_cache_write rotates a head in fixed 256-float halves (layer_ops.cpp rope_head).
MAX_ROPE_HEAD_DIM = 512
KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# KV caches narrower than float32 activations (kv_cache_dtype) that the kernels read and write;
# an int8 cache's scales (pagedllm/attention/int8_kv.py) go to the kernels beside it.
NARROW_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
# GGMLQuantizationType values, and quant_gemm's offset for their interleaved repacking
# (entry_points.h kInterleaved).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
INTERLEAVED_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
INTERLEAVED_OFFSET = 1000
# On top of an interleaved code (entry_points.h kFineScales): activations quantized with a scale
# per 16 values instead of 32, for the 4- and 5-bit formats whose blocks split into two nibble halves.
FINE_SCALES_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1)
FINE_SCALES_OFFSET = 1000


def kv_cache_dtype_supported(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the attention and RoPE + cache-write kernels take activations of ``dtype`` over a
    KV cache of ``kv_dtype``: the same dtype, or bf16 / fp16 / fp8 / int8 caches under float32 activations."""
    return kv_dtype == dtype or (dtype == torch.float32 and kv_dtype in NARROW_KV_DTYPES)


def kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The scales of an int8 K and V cache (None, None for the other dtypes): the kernels' last
    two arguments."""
    return cache_scales(k_cache), cache_scales(v_cache)


def layer_scales(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DecoderPlan.decode's ``kv_scales``: each layer's (K, V) scales for int8 caches, else empty."""
    # every layer's cache has one dtype: the first tells whether there are scales at all
    if not kv_caches or cache_scales(kv_caches[0][0]) is None:
        return []
    return [kv_scales(k, v) for k, v in kv_caches]


def _kv_refusal(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> str:
    name = str(kv_dtype).removeprefix("torch.")
    return f"a {name} KV cache under {str(dtype).removeprefix('torch.')} activations"


class CpuKernels:
    def __init__(self, module: ModuleType) -> None:
        self._m = module

    def compiled_isa(self) -> str:
        """The instruction-set features this build was compiled with ("avx2+fma f16c avx512f ...",
        or "portable")."""
        return self._m.compiled_isa()

    def release_scratch(self) -> int:
        """Frees the idle buffers the kernels keep for their large float32 outputs
        (scratch_buffers.h: recycled, not unmapped and faulted in again each layer); their bytes."""
        return self._m.release_scratch()

    def scratch_idle_bytes(self) -> int:
        """Bytes of those idle buffers."""
        return self._m.scratch_idle_bytes()

    # ---- what the kernels take ------------------------------------------------------------
    # The kernels refuse shapes they do not handle with a TORCH_CHECK, which would fail every step
    # of a model of that shape. These say so up front, so the engine decides once at load which
    # parts run the PyTorch reference path (and logs why) instead. They mirror the C++ checks:
    # tests/test_kernel_shapes.py holds each against the kernel itself.
    def layer_ops_refusal(
        self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> str | None:
        """Why rope_and_cache_write / silu_and_mul / add_rms_norm (the fused decoder-layer path)
        would refuse a model of this shape (``kv_dtype``: its KV cache's, default ``dtype``), or
        None when they take it."""
        if dtype not in KERNEL_DTYPES:
            return f"dtype {str(dtype).removeprefix('torch.')} (the layer kernels take bfloat16 and float32)"
        if not kv_cache_dtype_supported(dtype, kv_dtype or dtype):
            return _kv_refusal(dtype, kv_dtype)
        if head_dim % 2 or head_dim > MAX_ROPE_HEAD_DIM:
            return f"head_dim {head_dim} (the fused RoPE kernel takes an even head_dim up to {MAX_ROPE_HEAD_DIM})"
        return None

    def decode_attention_refusal(
        self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype | None = None
    ) -> str | None:
        """Why paged_decode_attention would refuse queries of ``dtype`` over caches of this shape
        and ``kv_dtype`` (default ``dtype``), or None when it takes them (its portable path takes
        any head_dim; the SIMD paths are chosen inside)."""
        if dtype not in KERNEL_DTYPES:
            return f"dtype {str(dtype).removeprefix('torch.')} (decode attention takes bfloat16 and float32)"
        if not kv_cache_dtype_supported(dtype, kv_dtype or dtype):
            return _kv_refusal(dtype, kv_dtype)
        if head_dim < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            return f"{num_heads} query heads over {num_kv_heads} KV heads (not a whole number per KV head)"
        return None

    # ---- attention ----------------------------------------------------------------------
    def paged_decode_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> None:
        """out[i] <- softmax(q[i] k^T * scale) v over sequence i's first seq_lens[i] keys, K/V read
        in place through block_tables [n, max_blocks] (long). q, out: [n, heads, head_dim].
        ``window``: a sliding window W (only the last W keys; the blocks before them are never
        read, their entries may be NULL_BLOCK), or None. Windowed bf16 runs the portable path.
        An int8 cache's scales (attached to it) are read beside it."""
        self._m.paged_decode_attention(
            out, q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0, *kv_scales(k_cache, v_cache)
        )

    def prefill_attention_available(self, head_dim: int, block_size: int) -> bool:
        """Whether paged_prefill_attention runs here for this head_dim and block_size."""
        return self._m.prefill_attention_available(head_dim, block_size)

    def paged_prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> None:
        """Causal attention of every prefill chunk of a step (rows query_starts[i] + [0,
        query_lens[i]) of q / out), each over its context_lens[i] earlier keys plus itself, read
        through block_tables. The chunks' own K/V must already be in the cache. ``window``: a
        sliding window (each query sees its last ``window`` keys; blocks before a chunk's first
        query's window are never read), or None."""
        self._m.paged_prefill_attention(
            out, q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, scale, window or 0
        )

    def rope_and_cache_write(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """RoPE on the q and k parts of each fused qkv row (in place), then k and v stored at the
        row's cache slot. qkv, cos / sin [max_positions, head_dim] and the caches: all bf16 or all
        float32, or float32 over a narrower cache (kv_cache_dtype; int8: its scales written too)."""
        ks, vs = kv_scales(k_cache, v_cache)
        self._m.rope_and_cache_write(
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, ks, vs
        )

    # ---- elementwise ----------------------------------------------------------------------
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused [T, 2I] gate_up projection -> [T, I] (bf16 or float32)."""
        return self._m.silu_and_mul(gate_up)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual) * weight (all bf16 or all float32)."""
        return self._m.add_rms_norm(x, residual, weight, eps)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the first maximum of each row of bf16 or float32 logits [T, V] -> [T] long."""
        return self._m.argmax_rows(x)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """logits[rows[i], t] = -inf (in place) where bit t of bitmask row i is clear: float32 logits
        [R, V], int32 bitmask [n, ceil(V / 32)] (llguidance's layout), int64 rows [n]."""
        self._m.apply_token_bitmask(logits, bitmask, rows)

    # ---- GEMM -----------------------------------------------------------------------------
    def packed_gemm_available(self) -> bool:
        """Whether packed_gemm was built (it needs AVX512-BF16)."""
        return self._m.packed_gemm_available()

    def amx_available(self) -> bool:
        """Whether the kernels use AMX tiles here (built with AMX, and permitted)."""
        return self._m.amx_available()

    def packed_gemm(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, epilogue: str
    ) -> torch.Tensor:
        """x [T, K] @ W^T with W packed in tile order (cpu_linear.tile_order); epilogue "none"
        (+ float bias if given) or "silu_mul" (W's gate / up strips interleaved)."""
        return self._m.packed_gemm(x, packed, bias, epilogue)

    def packed_gemm_argmax(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Per row of x, the first argmax of bf16(x @ W^T), no logits written (greedy LM head)."""
        return self._m.packed_gemm_argmax(x, packed)

    # ---- GGUF quantized GEMM (quant_gemm.cpp, quant_gemm_interleaved.cpp) -----------------------
    def quant_gemm_supports(self, qtype: int) -> bool:
        """Whether quant_gemm runs weights of this GGMLQuantizationType
        (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K)."""
        return self._m.quant_gemm_supports(qtype)

    def quant_gemm_simd(self) -> bool:
        """Whether quant_gemm uses AVX2 integer dot products here (else its portable C++ loop)."""
        return self._m.quant_gemm_simd()

    def quant_gemm(self, x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32, W the N rows of GGUF blocks w [N, bytes] uint8.
        x is quantized per row to int16 blocks of 32 with a float scale (amax / 32767); for
        ``interleaved_qtype`` of any format but Q8_0 (w repacked by ``quant_interleave_rows``) to
        int8 blocks (amax / 127)."""
        return self._m.quant_gemm(x, w, qtype)

    def interleaved_qtype(self, qtype: int) -> int | None:
        """quant_gemm's code for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights repacked eight
        rows at a time (None for other formats, and for a build without that kernel). The kernel it
        selects is the faster one at every row count."""
        if qtype not in INTERLEAVED_TYPES or not self._m.quant_gemm_supports(INTERLEAVED_OFFSET + qtype):
            return None
        return INTERLEAVED_OFFSET + qtype

    def fine_scales_qtype(self, qtype: int) -> int | None:
        """quant_gemm's code for Q4_0 / Q4_1 / Q5_0 / Q5_1 weights repacked as for interleaved_qtype
        whose activations take int8 with a scale per 16 values (each half of a block: its low or
        its high nibbles) rather than per 32: finer rounding where a block of inputs holds a few
        large values; None for other formats and builds without it."""
        code = INTERLEAVED_OFFSET + FINE_SCALES_OFFSET + qtype
        if qtype not in FINE_SCALES_TYPES or not self._m.quant_gemm_supports(code):
            return None
        return code

    def quant_interleave_rows(self, w: torch.Tensor, qtype: int) -> torch.Tensor:
        """Rows w [N, bytes] (N a multiple of 8) repacked for quant_gemm: Q4_0 / Q4_1 / Q5_0 / Q5_1 /
        Q8_0 in place (w returned; Q5_x's fifth bits transposed), Q4_K / Q5_K / Q6_K into a new tensor
        (Q4_K's and Q5_K's scales unpacked: 1184 / 1440 bytes per 8 x 256 values; Q6_K regrouped, the
        same size)."""
        return self._m.quant_interleave_rows(w, qtype)

    def quant_interleaved_rows(self, w: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 [R]) of weights repacked by quant_interleave_rows, as GGUF rows [R, bytes]."""
        return self._m.quant_interleaved_rows(w, qtype, ids)

    # ---- whole decode steps (decoder_loop.cpp) ----------------------------------------------
    def decoder_plan(
        self,
        projections: list[list[tuple[torch.Tensor, int, torch.Tensor | None]]],
        norms: list[torch.Tensor],
        eps: list[float],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        windows: list[int | None] | None = None,
    ):
        """A DecoderPlan: ``decode(h, residual, positions, cos, sin, kv_caches, kv_scales, slots,
        block_tables, seq_lens)`` (``kv_scales``: layer_scales(kv_caches)) runs a decode-only step
        through every layer in one call, with the kernels the fused Python loop calls, in its order
        (so bit-identical to it).
        ``projections``: qkv, o, gate_up, down of each layer, each a list of parts (weight, qtype,
        bias) whose outputs are concatenated: GGUF blocks (qtype >= 0) or float32 weights (qtype
        -1). ``norms`` / ``eps``: per layer the post-attention norm, then the next input norm
        (the final norm after the last layer). ``windows``: each layer's sliding window (None:
        full attention; default: none anywhere). Activations float32."""
        layer_windows = [w or 0 for w in windows] if windows is not None else [0] * (len(projections) // 4)
        return self._m.DecoderPlan(projections, norms, eps, num_heads, num_kv_heads, head_dim, scale, layer_windows)

    def quant_dequantize(self, w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """Float32 values [R, k] of R rows of GGUF blocks w [R, bytes] uint8."""
        return self._m.quant_dequantize(w, qtype, k)
