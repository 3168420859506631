"""Linear layers with weights laid out once, at load time, for the CPU kernel that runs them (bf16).

A plain bf16 ``F.linear`` on the CPU lets oneDNN reorder the weight into its blocked layout on
every call: for a 135M model that is a full extra pass over the weights each step. So each layer
keeps its weight in the order its kernel reads it:

- with the compiled kernels (AVX512-BF16): AMX B-tile order (``tile_weight``), the one copy
  ``packed_gemm`` runs for every row count (AMX tiles from 7 rows where the CPU has them,
  AVX512-BF16 dot products otherwise). It sits on transparent huge pages (``place_on_huge_pages``):
  a decode step streams every weight once, and with 4 KiB pages the stream stalls on TLB misses
  (SmolLM2-135M's 120 layer GEMMs at 16 rows: 20 -> 12 ms, at 1 row: 23 -> 10 ms);
- otherwise oneDNN's blocked layout (``packed_weight``), what torch's inductor does for frozen CPU
  models. Where the packed ops are missing or disagree, the layer stays a plain nn.Linear.

The fused gate/up projection of the MLP can also apply SiLU-and-multiply in the GEMM's epilogue
(``silu_and_mul``): its tile weight interleaves gate and up strips so each output block holds both.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pagedllm.host_memory import copy_to_huge_pages
from pagedllm.kernels.interface import CpuKernels

logger = logging.getLogger(__name__)


_AMX_STRIP, _AMX_K = 16, 32  # output columns per B tile, K per tile product


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [N/16, K/32, 16, 32]: each 16-column strip of W^T as consecutive AMX B tiles
    (16 rows of K pairs x 16 columns x 2), the layout ``packed_gemm`` streams."""
    n, k = w.shape
    return (
        w.view(n // _AMX_STRIP, _AMX_STRIP, k // _AMX_K, _AMX_K // 2, 2)
        .permute(0, 2, 3, 1, 4)
        .reshape(n // _AMX_STRIP, k // _AMX_K, _AMX_STRIP, _AMX_K)
    )


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows ([2I, K]) -> strips gate 0, up 0, gate 1, up 1, ... (16 rows each)."""
    two_i, k = w.shape
    gate, up = w.view(2, two_i // 2 // _AMX_STRIP, _AMX_STRIP, k)
    return torch.stack((gate, up), dim=1).reshape(two_i, k)


class PackedLinear(nn.Module):
    """``kernels``: the compiled CPU kernels, or None for oneDNN only. ``fuse_silu_mul``: this is
    a fused [gate; up] projection whose ``silu_and_mul`` method the MLP calls."""

    def __init__(self, linear: nn.Linear, kernels: CpuKernels | None = None, fuse_silu_mul: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.kernels = kernels
        n, k = w.shape
        self.use_tiles = (
            kernels is not None
            and kernels.packed_gemm_available()
            and n % (2 * _AMX_STRIP) == 0
            and k % _AMX_K == 0
            and not (fuse_silu_mul and (n % (4 * _AMX_STRIP) or self.bias is not None))
        )
        self.fused_silu_mul = fuse_silu_mul and self.use_tiles
        if self.use_tiles:  # packed_gemm serves every row count from this one copy
            if self.bias is not None:  # added in float by the kernel: convert once, not per call
                self.bias = self.bias.float()
            self.register_buffer(
                "tile_weight", tile_order(interleave_gate_up(w) if self.fused_silu_mul else w), persistent=False
            )
        else:
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_tiles:
            t = x.reshape(-1, self.in_features).contiguous()
            y = self.kernels.packed_gemm(t, self.tile_weight, self.bias, "none")
            if self.fused_silu_mul:  # interleaved [gate 0, up 0, gate 1, ...] strips: columns back in order
                y = y.view(t.shape[0], -1, 2, _AMX_STRIP).transpose(1, 2)
            return y.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Index of the first maximum of each row of this layer's bf16 output for x [T, K], the
        logits never written (greedy decoding's LM head); None where the kernel does not apply."""
        if not self.use_tiles or self.fused_silu_mul or self.bias is not None:
            return None
        return self.kernels.packed_gemm_argmax(x.contiguous(), self.tile_weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this fused [gate; up] projection of x [T, K] -> [T, I]."""
        if self.fused_silu_mul:
            return self.kernels.packed_gemm(x.contiguous(), self.tile_weight, None, "silu_mul")
        return self.kernels.silu_and_mul(self.forward(x))

    def streamed_weight(self) -> torch.Tensor | None:
        """The weight copy a step streams, if it can move (oneDNN's opaque one cannot)."""
        return self.tile_weight if self.use_tiles else None


@functools.cache
def bf16_packing_available() -> bool:
    """Whether this torch build packs bf16 weights (oneDNN present, and its packed ops agree with
    F.linear)."""
    return torch.backends.mkldnn.is_available() and _packing_works()


def _packing_works() -> bool:
    try:
        lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = lin(x)
            out = PackedLinear(lin)(x)
        return torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    except Exception as e:  # op missing in this torch build, or no oneDNN
        logger.info("oneDNN weight packing unavailable: %s", e)
        return False


def packed_lm_head(weight: torch.Tensor, kernels: CpuKernels | None = None) -> PackedLinear:
    """The LM head over ``weight`` [vocab, hidden] (the embedding itself when tied) as a PackedLinear."""
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    return PackedLinear(head, kernels)


def place_on_huge_pages(layers: list[PackedLinear]) -> bool:
    """Moves the layers' streamed weight copies into one huge-page buffer; False if not possible."""
    movable = [layer for layer in layers if layer.streamed_weight() is not None]
    moved = copy_to_huge_pages([layer.streamed_weight() for layer in movable])
    if moved is None:
        return False
    for layer, t in zip(movable, moved, strict=True):
        layer._buffers["tile_weight"] = t
    return True
