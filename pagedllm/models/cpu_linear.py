"""Linear layers with weights pre-packed for oneDNN (CPU, bfloat16).

A plain bf16 ``F.linear`` on the CPU lets oneDNN reorder the weight into its blocked (AMX /
AVX512-BF16) layout on every call: for a 135M model that is a full extra pass over the weights
each step, which dominates small-batch decoding. Packing once at load time removes it; this is
what torch's own inductor does for frozen CPU models. Where the packed ops are missing or give a
different result, the layer stays a plain nn.Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


# Up to this many rows, the streaming small-M kernel (pagedllm/kernels/small_gemm.cpp) beats
# oneDNN's blocked GEMM on the packed weight (measured: `python -m pagedllm.bench.kernels`).
SMALL_GEMM_MAX_ROWS = 6


class PackedLinear(nn.Module):
    """``small_gemm``: the compiled small-M kernel, or None to always use oneDNN."""

    def __init__(self, linear: nn.Linear, small_gemm=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # The small-M kernel streams the plain row-major weight, so that stays too (2x weight memory).
        self.small_gemm = small_gemm if small_gemm is not None and self.in_features % 32 == 0 else None
        self.weight = w if self.small_gemm is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_gemm is not None and x.dim() == 2 and x.shape[0] <= SMALL_GEMM_MAX_ROWS:
            return self.small_gemm(x.contiguous(), self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


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


def pack_linears(model: nn.Module, small_gemm=None) -> int:
    """Replaces the bf16 nn.Linear layers of a CPU model by PackedLinear; returns how many."""
    if not torch.backends.mkldnn.is_available() or not _packing_works():
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.dtype == torch.bfloat16
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, PackedLinear(child, small_gemm))
                n += 1
    return n
