"""Linear and embedding layers whose weights stay in their GGUF (llama.cpp) quantized blocks.

A layer holds the file's bytes for its rows, ``qweight`` [N, K / block * block_bytes] uint8, and
never a float copy. ``forward`` runs the compiled integer kernel where it handles the format:
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights are repacked eight rows at a time (the same bytes,
permuted, Q5_x's fifth bits transposed; as llama.cpp repacks Q4_0) for
kernels/quant_gemm_interleaved.cpp (int8 activations for Q4_x / Q5_x, int16 for Q8_0); Q4_K and
Q5_K likewise, their 6-bit scales unpacked to bytes (kernels/quant_gemm_q4k_q5k.cpp), Q6_K
regrouped (kernels/quant_gemm_q6k.cpp), int8 activations. A layer whose rows are not a multiple
of eight keeps the file's order for kernels/quant_gemm.cpp, int16 activations.
Without kernels the reference path dequantizes the layer for this call only (gguf-py's own
dequantizer, independent of the kernels) and runs F.linear. The reference is what the kernels are tested against.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from pagedllm.kernels.interface import FINE_SCALES_OFFSET, INTERLEAVED_OFFSET, CpuKernels

# Block formats kept quantized in memory. Float tensors (F32 / F16 / BF16) load as plain floats.
QUANTIZED_TYPES = frozenset(
    int(t)
    for t in (
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    )
)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k values in this GGUF block format."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if k % block:
        raise ValueError(f"{GGMLQuantizationType(qtype).name}: row length {k} is not a multiple of {block}")
    return k // block * nbytes


def dequantize_rows(qweight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Reference dequantization (gguf-py) of rows of GGUF blocks [R, bytes] -> float32 [R, k]."""
    w = gguf_dequantize(qweight.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(qweight.shape[0], k))


def runs_weight_blocks(model: nn.Module) -> bool:
    """Whether any GEMM of the model runs GGUF blocks (an F32 / F16 GGUF is a float model)."""
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W as GGUF blocks. ``kernels``: the compiled CPU kernels, or None
    for the reference path. The layer owns ``qweight``: with the kernels, Q4_x / Q5_x / Q8_0 rows are
    repacked in place (no second copy while a model loads) unless ``interleave=False``.

    ``fine_input_scales``: Q4_x / Q5_x inputs take int8 with a scale per 16 values, not 32 (the
    MLP's down projection). Its input, silu(gate) * up, has a few large values per block that
    leave the rest of a 32-value block a handful of int8 steps: on the default model (Q4_1, float
    weights on the reference path with the inputs rounded as the kernels round them) per-32 rounding
    everywhere cost +0.3% perplexity, per-16 for down_proj alone -0.03% (activation_rounding_ppl.py).
    The same precision at every batch size: outputs never depend on load."""

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        interleave: bool = True,
        fine_input_scales: bool = False,
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"qweight {tuple(qweight.shape)} is not rows of {in_features} values in format {qtype}")
        self.qtype, self.in_features, self.out_features = int(qtype), in_features, qweight.shape[0]
        self.bias = bias
        self.kernels = kernels if kernels is not None and kernels.quant_gemm_supports(self.qtype) else None
        # quant_gemm's code for the layout qweight holds: the GGUF type, or its interleaved code
        self.kernel_qtype = self.qtype
        code = None if self.kernels is None else self.kernels.interleaved_qtype(self.qtype)
        qweight = qweight.contiguous()
        if interleave and code is not None and self.out_features % 8 == 0:
            qweight = self.kernels.quant_interleave_rows(qweight, self.qtype)  # Q4_K: a new tensor
            fine = self.kernels.fine_scales_qtype(self.qtype) if fine_input_scales else None
            self.kernel_qtype = code if fine is None else fine
        self.register_buffer("qweight", qweight, persistent=False)

    @property
    def interleaved(self) -> bool:
        return self.kernel_qtype != self.qtype

    @property
    def fine_input_scales(self) -> bool:
        """Whether the kernel quantizes this layer's input with a scale per 16 values (not 32)."""
        return self.kernel_qtype >= INTERLEAVED_OFFSET + FINE_SCALES_OFFSET

    def gguf_rows(self) -> torch.Tensor:
        """The weight as GGUF rows [N, bytes] in the file's order (a new tensor when interleaved)."""
        if not self.interleaved:
            return self.qweight
        return self.kernels.quant_interleaved_rows(self.qweight, self.qtype, torch.arange(self.out_features))

    @property
    def format(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (made for this call; the layer keeps only its blocks)."""
        return dequantize_rows(self.gguf_rows(), self.qtype, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and self.bias is None:
            # The decoder's own case, kept free of no-op reshapes and casts: at batch size 1 a
            # step makes ~120 of these calls and their Python overhead was ~10% of it.
            return self.kernels.quant_gemm(x, self.qweight, self.kernel_qtype)
        t = x.reshape(-1, self.in_features)
        if self.kernels is not None:
            y = self.kernels.quant_gemm(t.float(), self.qweight, self.kernel_qtype).to(x.dtype)
        else:
            y = F.linear(t, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """No fused greedy head for quantized weights: the model falls back to compute_logits."""
        return None

    def extra_repr(self) -> str:
        layout = ", interleaved" if self.interleaved else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}{layout}"


class ConcatLinear(nn.Module):
    """A fused projection (q/k/v or gate/up) whose parts have different weight formats (llama.cpp's
    mixed files, e.g. attn_v in Q6_K next to Q4_K q and k): each part runs its own GEMM."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantizedEmbedding(nn.Module):
    """Token embedding lookup from GGUF blocks: only the looked-up rows are dequantized.
    ``interleaved``: qweight is a tied head's repacked weight (QuantizedLinear.qweight), read in place."""

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: int,
        dim: int,
        kernels: CpuKernels | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        # a tied head's repacked rows may be longer (Q4_K's unpacked scales): the kernels check them
        if not interleaved and qweight.shape[1] != row_bytes(qtype, dim):
            raise ValueError(f"embedding qweight {tuple(qweight.shape)} is not rows of {dim} values")
        self.qtype, self.dim = int(qtype), dim
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.kernels = kernels if kernels is not None and kernels.quant_gemm_supports(self.qtype) else None
        if interleaved and self.kernels is None:
            raise ValueError("an interleaved embedding needs the CPU kernels")
        self.interleaved = interleaved
        self.dtype = torch.float32  # of the output: set to the activation dtype by the loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            rows = self.kernels.quant_interleaved_rows(self.qweight, self.qtype, ids.reshape(-1).long())
        else:
            rows = self.qweight.index_select(0, ids.reshape(-1))
        if self.kernels is not None:
            x = self.kernels.quant_dequantize(rows, self.qtype, self.dim)
        else:
            x = dequantize_rows(rows, self.qtype, self.dim)
        return x.to(self.dtype).reshape(*ids.shape, self.dim)
