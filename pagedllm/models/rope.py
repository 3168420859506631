"""Rotary position embeddings (RoPE) as transformers computes them: cos/sin tables and their rotation.

Its own module because every RoPE family shares it (llama.py, gemma3.py's table per layer type,
phi3.py's partial rotary dims and LongRoPE build on ``RotaryEmbedding`` and its helpers), and the
fused CPU kernels index these tables by row (``table_rows``) rather than by position.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, computed as transformers computes them.

    The kernels and ``tables`` index them by table row: ``table_rows`` maps this step's positions
    to rows (the position itself here; a family whose RoPE varies per sequence keeps several
    tables in one and offsets the rows, see models/phi3.py).

    ``layer_type``: for configs whose ``rope_parameters`` hold one dict per layer type (Gemma 3:
    "sliding_attention", "full_attention"), the type whose parameters make this table."""

    def __init__(self, hf_config, max_len: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.layer_type = layer_type
        cos, sin = self._build_tables(hf_config, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._bf16: tuple[torch.Tensor, torch.Tensor] | None = None

    def _build_tables(self, hf_config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        rope_type = _rope_type(hf_config, self.layer_type)
        if rope_type in ("dynamic", "longrope"):
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
        inv_freq, attention_scaling = _rope_inv_freq(hf_config, rope_type, self.layer_type)
        return rope_cos_sin(inv_freq, attention_scaling, max_len)

    def table_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The table row of each token of the step: its position."""
        return positions

    def bf16_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole cos/sin tables in bf16 (the fused CPU RoPE kernel indexes them itself), made once."""
        if self._bf16 is None:
            self._bf16 = (self.cos.to(torch.bfloat16).contiguous(), self.sin.to(torch.bfloat16).contiguous())
        return self._bf16

    def f32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole cos/sin tables in float32 for the fused CPU RoPE kernel: the tables themselves,
        whose rows the float32 reference path uses as they are."""
        return self.cos.contiguous(), self.sin.contiguous()

    def kernel_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused CPU RoPE kernel's tables for activations of ``dtype`` (bf16 or float32)."""
        return self.bf16_tables() if dtype == torch.bfloat16 else self.f32_tables()

    def tables(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this step's table rows (``table_rows``), [T, 1, D], looked up once for all layers."""
        return self.cos[rows].to(dtype).unsqueeze(1), self.sin[rows].to(dtype).unsqueeze(1)


def rope_cos_sin(
    inv_freq: torch.Tensor, attention_scaling: float, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, 2 * len(inv_freq)] for positions 0.., in transformers' float32 formula."""
    pos = torch.arange(num_positions, dtype=torch.float)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(hf_config, rope_type: str, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling as transformers' LlamaRotaryEmbedding makes
    them: its formula for the default type, its rope-init functions for the others. Not the class
    itself: importing modeling_llama costs ~70 MB of resident memory for one small table."""
    if rope_type == "default":
        params = _rope_params(hf_config, layer_type)
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * (params.get("partial_rotary_factor") or 1.0))  # RoPE on the first dims only (Phi-4-mini)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)  # (config, device)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, layer_type=layer_type)


def _rope_params(hf_config, layer_type: str | None = None) -> dict:
    """The RoPE parameters dict: the config's own, or for ``layer_type`` its entry in the
    per-layer-type dict transformers keeps for models like Gemma 3."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params[layer_type] if layer_type is not None else params


def _rope_type(hf_config, layer_type: str | None = None) -> str:
    params = _rope_params(hf_config, layer_type)
    return params.get("rope_type", params.get("type", "default"))
