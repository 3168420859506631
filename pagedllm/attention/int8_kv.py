"""int8 KV caches (``kv_cache_dtype="int8"``): symmetric, one float32 scale per token and KV head.

For K and V separately, per (token, KV head): ``scale = max|x| / 127`` over the head's values,
``q = x / scale`` rounded to nearest even and clamped to [-127, 127]; a value reads back as
``q * scale``. An all-zero head (or one so small that its scale would not be a normal float) has
scale 0 and q 0. Per token and head rather than per block: each token's writer owns its scale, so
the token-parallel C++ writer (rope_and_cache_write) never races on a shared block scale and
nothing is re-quantized as a block fills (llama.cpp's q8_0 cache is likewise scaled per 32 values).

The scales live in a float32 tensor ``[num_blocks, num_kv_heads, block_size]`` beside each int8
cache ``[num_blocks, num_kv_heads, block_size, head_dim]``: a token's scale sits at its cache
row's index, so the kernels find it with the row's own offset. The scale tensor is attached to its
cache tensor (``cache_scales``): whatever holds a cache holds its scales, and what moves blocks
(copy-on-write, swap: runner/kv_cache.py move_blocks) moves their scales along.

This quantizer is the reference the C++ writer (kernels/layer_ops.cpp store_row_int8) matches bit
for bit: the same float32 division for the scale and for each value, the same rounding.
"""

from __future__ import annotations

import torch

_ATTR = "int8_scales"
SCALE_DTYPE = torch.float32  # of the scales; the C++ kernels read them as float (common.h)
# below this a scale is not a normal float: the kernels may flush it to 0 (-ffast-math), so both
# writers store such a head as zeros
_TINY = torch.finfo(torch.float32).tiny


def attach_scales(cache: torch.Tensor, scales: torch.Tensor) -> None:
    """Gives an int8 cache its scale tensor (shape ``cache.shape[:-1]``, float32)."""
    assert cache.dtype == torch.int8 and scales.dtype == SCALE_DTYPE and scales.shape == cache.shape[:-1]
    setattr(cache, _ATTR, scales)


def cache_scales(cache: torch.Tensor) -> torch.Tensor | None:
    """The scales of an int8 cache; None for the caches that have none (every other dtype)."""
    return getattr(cache, _ATTR, None)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., D]`` -> (int8 ``[..., D]``, float32 scales ``[...]``), per row of D values."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    scale = torch.where(scale >= _TINY, scale, torch.zeros_like(scale))
    live = (scale > 0).unsqueeze(-1)
    q = (x / torch.where(live, scale.unsqueeze(-1), 1.0)).round().clamp(-127, 127)  # round: to nearest even
    return torch.where(live, q, 0.0).to(torch.int8), scale


def scale_bytes_per_row(dtype: torch.dtype) -> int:
    """The scale bytes a cache of ``dtype`` keeps per row (token and KV head): int8's, else 0."""
    return SCALE_DTYPE.itemsize if dtype == torch.int8 else 0


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 values ``[..., D]`` times their rows' scales ``[...]``, in ``dtype``."""
    return (q.float() * scales.unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 cache holds it, back in x's dtype."""
    return dequantize(*quantize(x), x.dtype)
