"""How a layer's weights run: chosen once per weight, when the layer has all of its parts.

``LinearMethods`` is decided once at load (engine/builder.py, from the CPU, the config and the
checkpoint's formats) and handed to every layer; a layer never re-decides it. Per weight:

- float (F.linear in the activation dtype): float checkpoints, and GGUF formats without an
  integer kernel (dequantized by the reader);
- packed bf16 (``PackedLinear``, models/cpu_linear.py): bf16 weights laid out once for the CPU's
  GEMM (AMX / AVX512-BF16 tiles of the compiled kernels, else oneDNN's blocked layout);
- GGUF blocks (``QuantizedLinear``, models/quantized_linear.py): the file's bytes, run by the
  integer kernel of their format;
- parts in different formats (llama.cpp's mixed files: attn_v in Q6_K beside Q4_K q and k):
  ``ConcatLinear``, one GEMM per part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.interface import CpuKernels
from pagedllm.layers.checkpoint import BlockRows, CheckpointTensor
from pagedllm.models.quantized_linear import ConcatLinear, QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearMethods:
    """``dtype``: of the activations (and float weights). ``kernels``: the compiled CPU kernels
    (integer GEMMs of GGUF blocks, packed bf16 GEMMs), or None for the PyTorch reference.
    ``pack_bf16``: bf16 weights get PackedLinear's layout."""

    dtype: torch.dtype
    kernels: CpuKernels | None = None
    pack_bf16: bool = False
    device: torch.device = torch.device("cpu")

    def _float(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(device=self.device, dtype=self.dtype).contiguous()
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()  # a shard's view would keep the whole checkpoint tensor alive
        return t

    def linear(
        self,
        parts: list[CheckpointTensor],
        bias: torch.Tensor | None,
        silu_mul_epilogue: bool = False,
        fine_input_scales: bool = False,
    ):
        """One (possibly fused) projection over ``parts``' rows, in order; its bias whole.
        ``fine_input_scales``: GGUF Q4_x / Q5_x weights quantize the input per 16 values
        (QuantizedLinear)."""
        if all(isinstance(p, BlockRows) for p in parts) and len({p.qtype for p in parts}) == 1:
            rows = torch.cat([p.bytes_tensor() for p in parts]) if len(parts) > 1 else parts[0].bytes_tensor()
            b = None if bias is None else bias.float()  # the integer kernels add it in float32
            return QuantizedLinear(
                rows, parts[0].qtype, parts[0].k, b, self.kernels, fine_input_scales=fine_input_scales
            )
        if not any(isinstance(p, BlockRows) for p in parts):
            w = torch.cat(parts) if len(parts) > 1 else parts[0]
            return self._float_linear(w, bias, silu_mul_epilogue)
        # mixed formats: one GEMM per run of neighbouring parts in the same format (q and k in
        # Q4_K beside v in Q6_K: two), the bias split along
        runs: list[list[CheckpointTensor]] = []
        for p in parts:
            if runs and _format(runs[-1][-1]) == _format(p):
                runs[-1].append(p)
            else:
                runs.append([p])
        mods, start = [], 0
        for run in runs:
            n = sum(p.shape[0] for p in run)
            mods.append(self.linear(run, None if bias is None else bias[start : start + n], False, fine_input_scales))
            start += n
        return ConcatLinear(mods)

    def _float_linear(self, w: torch.Tensor, bias: torch.Tensor | None, silu_mul_epilogue: bool) -> nn.Module:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(self._float(w), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(self._float(bias), requires_grad=False)
        if self.pack_bf16 and self.dtype == torch.bfloat16 and self.device.type == "cpu":
            from pagedllm.models.cpu_linear import PackedLinear

            return PackedLinear(lin, self.kernels, fuse_silu_mul=silu_mul_epilogue)
        return lin

    def embedding(self, t: CheckpointTensor) -> nn.Module:
        """A token embedding over ``t``'s rows (GGUF blocks: only looked-up rows dequantized)."""
        if isinstance(t, BlockRows):
            emb = QuantizedEmbedding(t.bytes_tensor(), t.qtype, t.k, self.kernels)
            emb.dtype = self.dtype
            return emb
        return nn.Embedding.from_pretrained(self._float(t))

    def tied_head_and_embedding(self, t: CheckpointTensor) -> tuple[nn.Module | torch.Tensor, nn.Module]:
        """The LM head and the embedding over the same rows, one copy: GGUF blocks repacked for
        the head's GEMM, which the embedding reads in place; a float weight shared."""
        if isinstance(t, BlockRows):
            head = QuantizedLinear(t.bytes_tensor(), t.qtype, t.k, None, self.kernels)
            emb = QuantizedEmbedding(head.qweight, t.qtype, t.k, head.kernels, head.interleaved)
            emb.dtype = self.dtype
            return head, emb
        emb = nn.Embedding.from_pretrained(self._float(t))
        return self.head(emb.weight), emb

    def head(self, t: CheckpointTensor) -> nn.Module | torch.Tensor:
        """The LM head's local GEMM: a float weight (F.linear), or a layer (packed bf16, GGUF)."""
        if isinstance(t, BlockRows):
            return QuantizedLinear(t.bytes_tensor(), t.qtype, t.k, None, self.kernels)
        w = self._float(t)
        if self.pack_bf16 and self.dtype == torch.bfloat16 and self.device.type == "cpu":
            from pagedllm.models.cpu_linear import packed_lm_head

            return packed_lm_head(w, self.kernels)
        return w


def _format(t: CheckpointTensor) -> int | None:
    """A GGUF block format, or None for float."""
    return t.qtype if isinstance(t, BlockRows) else None


def log_weight_formats(model: torch.nn.Module, source: str, kernels: CpuKernels | None) -> None:
    """One line: which GEMMs run on what (the choice linear_methods made, per weight)."""
    from collections import Counter

    from pagedllm.layers.linear import ParallelLinear  # imports this module

    kinds: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            kinds[f"{m.format}{'' if m.kernels is not None else ' (reference)'}"] += 1
        elif isinstance(m, (ParallelLinear, ConcatLinear)):
            # a mixed-format projection's float parts (llama.cpp's Q4_K_M: Q5_0 q and k, dequantized,
            # beside a Q8_0 v) are GEMMs of their own inside its ConcatLinear
            for part in m.parts if isinstance(m, ConcatLinear) else [m.local]:
                if isinstance(part, torch.nn.Linear):
                    kinds[f"float {str(part.weight.dtype).removeprefix('torch.')}"] += 1
        elif type(m).__name__ == "PackedLinear":
            kinds["packed bf16"] += 1
    isa = "none" if kernels is None else kernels.compiled_isa()
    logging.getLogger("pagedllm").info(  # the engine's start-up lines' logger
        "pagedllm: %s: GEMMs %s; compiled kernels: %s; fused layer loop: %s",
        source,
        ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none",
        isa,
        "yes" if getattr(model, "kernels", None) is not None else "no",
    )
