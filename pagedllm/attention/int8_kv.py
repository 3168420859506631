"""int8 KV caches (``kv_cache_dtype="int8"``): symmetric, float32 scales per token and KV head,
one per group of values.

For K and V separately, per (token, KV head) row of ``head_dim`` values, cut into
``scale_groups(head_dim)`` groups of equal size: ``scale = max|x| / 127`` over the group,
``q = x / scale`` rounded to nearest even and clamped to [-127, 127]; a value reads back as
``q * scale``. An all-zero group (or one so small that its scale would not be a normal float) has
scale 0 and q 0.

Groups: one per row up to 64 values (the default model's and the 1.7B shape's heads: one scale
per row, +0.19% perplexity on the default model), else one per 32 values as llama.cpp's q8_0
cache. One scale for a 256-wide head (Gemma 3), whose range a few large channels set, left the
other channels few steps: +2.23% perplexity against the float32 cache; a scale per 32 values
measured within 0.1% (per 64: ~0.9%, per 128: ~1.3%; benchmarks/results/kv_cache_dtype).

Per token and head rather than per block: each token's writer owns its scales, so the
token-parallel C++ writer (rope_and_cache_write) never races on a shared block scale and nothing is
re-quantized as a block fills.

The scales live in a float32 tensor ``[num_blocks, num_kv_heads, block_size, groups]`` beside each
int8 cache ``[num_blocks, num_kv_heads, block_size, head_dim]``: a row's scales sit at its cache
row's index (times ``groups``), so the kernels find them with the row's own offset. The scale
tensor is attached to its cache tensor (``cache_scales``): whatever holds a cache holds its
scales, and what moves blocks (copy-on-write, swap: runner/kv_cache.py move_blocks) moves their
scales along.

This quantizer is the reference the C++ writer (kernels/kv_rows.h store_row_int8) matches bit for
bit: the same float32 division for the scale and for each value, the same rounding.
"""

from __future__ import annotations

import torch

_ATTR = "int8_scales"
SCALE_DTYPE = torch.float32  # of the scales; the C++ kernels read them as float (common.h)
# below this a scale is not a normal float: the kernels may flush it to 0 (-ffast-math), so both
# writers store such a group as zeros
_TINY = torch.finfo(torch.float32).tiny
# Values per scale group in rows wider than WHOLE_ROW (common.h kInt8Group / kInt8WholeRow).
GROUP = 32
WHOLE_ROW = 64


def scale_groups(head_dim: int) -> int:
    """Scales per cache row: 1 up to WHOLE_ROW values (or for a row that is no multiple of GROUP),
    else one per GROUP values."""
    return 1 if head_dim <= WHOLE_ROW or head_dim % GROUP else head_dim // GROUP


def scales_shape(cache_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for an int8 cache of ``cache_shape`` ``[..., head_dim]``."""
    return (*cache_shape[:-1], scale_groups(cache_shape[-1]))


def attach_scales(cache: torch.Tensor, scales: torch.Tensor) -> None:
    """Gives an int8 cache its scale tensor (shape ``scales_shape(cache.shape)``, float32)."""
    assert cache.dtype == torch.int8 and scales.dtype == SCALE_DTYPE
    assert scales.shape == scales_shape(cache.shape), (scales.shape, cache.shape)
    setattr(cache, _ATTR, scales)


def cache_scales(cache: torch.Tensor) -> torch.Tensor | None:
    """The scales of an int8 cache; None for the caches that have none (every other dtype)."""
    return getattr(cache, _ATTR, None)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., D]`` -> (int8 ``[..., D]``, float32 scales ``[..., scale_groups(D)]``)."""
    *lead, d = x.shape
    n = scale_groups(d)
    x = x.float().reshape(*lead, n, d // n)
    scale = x.abs().amax(-1) / 127
    scale = torch.where(scale >= _TINY, scale, torch.zeros_like(scale))
    live = (scale > 0).unsqueeze(-1)
    q = (x / torch.where(live, scale.unsqueeze(-1), 1.0)).round().clamp(-127, 127)  # round: to nearest even
    return torch.where(live, q, 0.0).to(torch.int8).reshape(*lead, d), scale


def scale_bytes_per_row(dtype: torch.dtype, head_dim: int) -> int:
    """The scale bytes a cache of ``dtype`` keeps per row (token and KV head): int8's, else 0."""
    return SCALE_DTYPE.itemsize * scale_groups(head_dim) if dtype == torch.int8 else 0


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 values ``[..., D]`` times their groups' scales ``[..., groups]``, in ``dtype``."""
    *lead, d = q.shape
    n = scales.shape[-1]
    return (q.float().reshape(*lead, n, d // n) * scales.unsqueeze(-1)).reshape(q.shape).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 cache holds it, back in x's dtype."""
    return dequantize(*quantize(x), x.dtype)
