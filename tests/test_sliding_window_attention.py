"""Sliding-window attention through the block table equals dense attention under transformers'
sliding mask (a query at position p sees keys [max(0, p - W + 1), p]), also when the blocks wholly
before every window have been released (NULL_BLOCK entries, their contents poisoned)."""

from __future__ import annotations

import math

import pytest
import torch
from test_attention import build_batch

from pagedllm.attention.paged_attention import paged_attention
from pagedllm.kv.base import NULL_BLOCK


def dense_window_attention(q, k_all, v_all, ctx, scale, window):
    """Query rows at positions ctx.. over the dense K/V, each seeing at most `window` keys back."""
    h, hkv = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // hkv, dim=1).float()
    v = v_all.repeat_interleave(h // hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    n = k.shape[0]
    kv_idx, q_idx = torch.arange(n).unsqueeze(0), torch.arange(ctx, n).unsqueeze(1)
    mask = (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def release_out_of_window(kc, vc, meta, window: int, poison: float) -> None:
    """What block release does: every block whose positions all lie before the first query's window
    gets a NULL_BLOCK entry; its contents become ``poison``, so a path that lets it in fails (the
    reference path gathers padded decode tables whole, and pads with block 0, possibly a released
    one: finite poison there, huge enough to swamp any softmax it leaked into)."""
    bs = kc.shape[2]
    released = set()
    if meta.num_decodes:
        tables = meta.decode_block_tables
        for i, n in enumerate(meta.decode_seq_lens.tolist()):
            for j in range(max(0, n - window) // bs):
                released.add(int(tables[i, j]))
                tables[i, j] = NULL_BLOCK
    for p in meta.prefills:
        for j in range(max(0, p.context_len - window + 1) // bs):
            released.add(int(p.block_ids[j]))
            p.block_ids[j] = NULL_BLOCK
    for b in released:
        kc[b] = poison
        vc[b] = poison


CASES = [  # block_size, heads, kv_heads, head_dim, window
    (1, 4, 2, 16, 5),
    (4, 4, 2, 16, 8),
    (16, 9, 3, 64, 16),
    (8, 4, 4, 16, 13),
    (16, 4, 1, 32, 100),  # wider than most contexts
]


@pytest.mark.parametrize("block_size,h,hkv,d,window", CASES)
@pytest.mark.parametrize("release", [False, True])
def test_reference_window_equals_dense(block_size, h, hkv, d, window, release):
    decode_lens = [1, 5, 17, 40, 64, 129]
    prefills = [(0, 9), (0, 30), (13, 6), (31, 2), (50, 20)]
    q, k, v, kc, vc, meta, dense = build_batch(block_size, h, hkv, d, 0, decode_lens, prefills)
    if release:
        release_out_of_window(kc, vc, meta, window, 1e6)
    scale = 1 / math.sqrt(d)
    out = paged_attention(q, k, v, kc, vc, meta, scale, window)
    row = 0
    for k_all, v_all, ctx in dense:
        ql = k_all.shape[0] - ctx
        ref = dense_window_attention(q[row : row + ql], k_all, v_all, ctx, scale, window)
        torch.testing.assert_close(out[row : row + ql], ref, atol=1e-5, rtol=1e-5)
        row += ql


def test_window_none_is_full_causal_attention():
    q, k, v, kc, vc, meta, _ = build_batch(4, 4, 2, 16, 1, [3, 30], [(0, 12), (9, 7)])
    full = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.25)
    wide = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.25, window=10_000)
    narrow = paged_attention(q, k, v, kc, vc, meta, 0.25, window=4)
    torch.testing.assert_close(full, wide)
    assert not torch.allclose(full, narrow)
