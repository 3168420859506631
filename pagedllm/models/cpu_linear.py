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


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


def pack_linears(model: nn.Module) -> int:
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
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
