"""Reference paged attention in plain PyTorch (any device).

K/V live in a paged cache ``[num_blocks, num_kv_heads, block_size, head_dim]``. New tokens are
written at their slots; queries then attend to their sequence's keys, read by indexing the cache
with the sequence's block table (no per-sequence cache is ever kept).

``window``: a layer's sliding window W (None: full causal attention). A query at absolute position
p then attends to the keys at [max(0, p - W + 1), p], as transformers' sliding mask does
(key index > query index - W). Blocks wholly before a sequence's window may have been released
(their table entries are then ``NULL_BLOCK``); no path reads their contents.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from pagedllm.attention import int8_kv
from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores key/value ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` slots, rounded
    to the cache's dtype (``kv_cache_dtype``: it may be narrower than the activations; int8 with
    scales per token, head and group of values, int8_kv.py)."""
    bs = k_cache.shape[2]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    for x, cache in ((key, k_cache), (value, v_cache)):
        scales = int8_kv.cache_scales(cache)
        if scales is None:
            cache[blocks, :, offsets] = to_cache_dtype(x, cache.dtype)
        else:
            cache[blocks, :, offsets], scales[blocks, :, offsets] = int8_kv.quantize(x)


# The largest finite value of each cache dtype that can overflow (float16, and float8 stored
# unscaled as vLLM stores it without calibrated k/v scales).
_CACHE_MAX = {torch.float16: 65504.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_cache_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to the KV cache's dtype (to nearest even); float16 / float8 caches saturate at
    their largest finite value rather than store an infinity (the kernels, built with
    -ffast-math, assume finite values; as the C++ writer)."""
    if t.dtype == dtype:
        return t
    limit = _CACHE_MAX.get(dtype)
    if limit is not None:
        t = t.clamp(-limit, limit)
    return t.to(dtype)


# Seconds spent in attend() while an attention_timer is open (benchmarks); None: not timing.
_timer: list[float] | None = None


@contextmanager
def attention_timer() -> Iterator[list[float]]:
    """Accumulates the time spent in attention (every layer, both paths) into the yielded
    one-element list while open. CPU calls are synchronous, so wall time is kernel time."""
    global _timer
    acc = [0.0]
    _timer = acc
    try:
        yield acc
    finally:
        _timer = None


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query ``[T, H, D]``, key/value ``[T, Hkv, D]`` for this step's tokens -> output ``[T, H, D]``.

    ``window``: this layer's sliding window (None: full causal attention)."""
    write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    return attend(query, key, value, k_cache, v_cache, meta, scale, window)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of this step's queries over caches that already hold this step's K/V.

    Query rows may be strided (a view of a fused qkv projection); the output is contiguous.
    ``window``: this layer's sliding window (None: full causal attention).
    """
    if _timer is None:
        return _attend(query, key, value, k_cache, v_cache, meta, scale, window)
    t = time.perf_counter()
    try:
        return _attend(query, key, value, k_cache, v_cache, meta, scale, window)
    finally:
        _timer[0] += time.perf_counter() - t


def _attend(
    query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None
) -> torch.Tensor:
    out = query.new_empty(query.shape)
    nd = meta.num_decodes
    if nd and meta.decode_kernel is not None:
        # The kernel writes the decode rows of the output in place.
        meta.decode_kernel(
            out[:nd], query[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window
        )
    elif nd:
        out[:nd] = _decode(query[:nd], k_cache, v_cache, meta, scale, window)
    if meta.prefills and meta.prefill_kernel is not None:
        # One call for every chunk; it reads the chunks' own K/V back from the cache too.
        meta.prefill_kernel(out, query, k_cache, v_cache, *meta.prefill_batch(), scale, window)
        return out
    if meta.prefills and meta.prefill_as_decode_rows:
        # Each prefill query as a decode row over its own keys: its result depends on its position
        # alone, never on how the prompt was chunked or batched.
        first = meta.prefills[0].query_start
        tables, lens = meta.prefill_rows()
        meta.decode_kernel(out[first:], query[first:], k_cache, v_cache, tables, lens, scale, window)
        return out
    for p in meta.prefills:
        rows = slice(p.query_start, p.query_start + p.query_len)
        out[rows] = _prefill(query[rows], key[rows], value[rows], k_cache, v_cache, p, scale, window)
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
):
    nd, h, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    bt, mask = meta.decode_view(bs, window)
    nblk = bt.shape[1]
    # [nd, nblk, hkv, bs, d] -> [nd, hkv, nblk * bs, d]
    k = _read(k_cache, bt, q.dtype).transpose(1, 2).reshape(nd, hkv, nblk * bs, d)
    v = _read(v_cache, bt, q.dtype).transpose(1, 2).reshape(nd, hkv, nblk * bs, d)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h)
    return o.squeeze(2)


def _prefill(q, key, value, k_cache, v_cache, p: PrefillSeq, scale: float, window: int | None):
    h = q.shape[1]
    hkv, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    mask = p.mask
    if p.context_len == 0:
        # Nothing earlier in the cache: this chunk's own K/V are the whole context, rounded as the
        # cache holds them, so that a prompt's output does not depend on how it was chunked.
        k, v = _as_cached(key, k_cache).transpose(0, 1), _as_cached(value, v_cache).transpose(0, 1)
        first_key = 0
    else:
        # Only the blocks from the first query's window on: those before it may be released.
        first_block = 0 if window is None else max(0, p.context_len - window + 1) // bs
        first_key = first_block * bs
        # [nblk, hkv, bs, d] -> [hkv, nblk * bs, d], cut to the sequence
        ids = p.block_ids[first_block:]
        k = _read(k_cache, ids, q.dtype).transpose(0, 1).reshape(hkv, -1, d)[:, : p.seq_len - first_key]
        v = _read(v_cache, ids, q.dtype).transpose(0, 1).reshape(hkv, -1, d)[:, : p.seq_len - first_key]
    if window is not None:
        mask = sliding_mask(p.context_len, p.query_len, first_key, p.seq_len, window, q.device)
    # 4-D (batch of 1): the CPU's fused flash kernel only takes 4-D inputs; 3-D goes to "math".
    # With 4-D inputs it also handles GQA itself (enable_gqa), 1.3-1.5x faster than expanding
    # the KV heads first (bf16, 184-512 query tokens, 9/3 heads).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=hkv != h,
    )
    return o.squeeze(0).transpose(0, 1)


def _read(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's blocks (indexed by ``blocks``, any shape) widened to ``dtype``, an int8 cache's
    values times their scales."""
    scales = int8_kv.cache_scales(cache)
    if scales is None:
        return cache[blocks].to(dtype)
    return int8_kv.dequantize(cache[blocks], scales[blocks], dtype)


def _as_cached(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """t as the cache stores it, back in t's dtype (t itself when the dtypes agree)."""
    if int8_kv.cache_scales(cache) is not None:
        return int8_kv.round_trip(t)
    return t if cache.dtype == t.dtype else to_cache_dtype(t, cache.dtype).to(t.dtype)


def sliding_mask(
    first_query: int, num_queries: int, first_key: int, end_key: int, window: int, device: torch.device | None = None
) -> torch.Tensor:
    """[num_queries, end_key - first_key] bool, True where query position first_query + i sees key
    position first_key + j: causal, and at most ``window`` positions back (the query's own included)."""
    q_pos = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    k_pos = torch.arange(first_key, end_key, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)
