"""The compiled decode kernel equals the PyTorch reference; the reference equals dense attention."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.attention.paged_attention import attend, paged_attention
from pagedllm.kernels import load_cpu_kernels


def build_batch(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int,
    decode_lens: list[int],
    prefills: list[tuple[int, int]],
    dtype=torch.float32,
):
    """A random paged cache holding every sequence's context, scattered over shuffled blocks.

    decode_lens: context length (incl. the new token) of each decode; prefills: (context_len, query_len).
    Returns the step's q/k/v, caches, metadata and each sequence's full dense K/V for checking.
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seqs = [(n - 1, 1) for n in decode_lens] + list(prefills)
    total_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    free = list(range(total_blocks))
    rng.shuffle(free)
    k_cache = torch.zeros(total_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)  # head-major blocks
    v_cache = torch.zeros_like(k_cache)
    tables, dense, slots, qs, ks, vs = [], [], [], [], [], []
    for ctx, ql in seqs:
        n = ctx + ql
        table = [free.pop() for _ in range(-(-n // block_size))]
        k_all = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v_all = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(ctx):  # earlier tokens are already in the cache
            k_cache[table[p // block_size], :, p % block_size] = k_all[p]
            v_cache[table[p // block_size], :, p % block_size] = v_all[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, n)]
        qs.append(torch.randn(ql, num_heads, head_dim, generator=g).to(dtype))
        ks.append(k_all[ctx:])
        vs.append(v_all[ctx:])
        tables.append(table)
        dense.append((k_all, v_all, ctx))
    nd = len(decode_lens)
    max_blocks = max([len(t) for t in tables[:nd]], default=1)
    pf, row = [], nd
    for i, (ctx, ql) in enumerate(prefills):
        n = ctx + ql
        mask = None
        if ctx:
            mask = torch.arange(n).unsqueeze(0) <= torch.arange(ctx, n).unsqueeze(1)
        pf.append(PrefillSeq(row, ql, n, torch.tensor(tables[nd + i]), mask))
        row += ql
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=nd,
        decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:nd]]) if nd else None,
        decode_seq_lens=torch.tensor(decode_lens) if nd else None,
        prefills=pf,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, dense


def dense_attention(q, k_all, v_all, ctx, scale):
    """Plain causal attention of the query rows (positions ctx..) over the full dense K/V."""
    h, hkv = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // hkv, dim=1).float()
    v = v_all.repeat_interleave(h // hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    n = k.shape[0]
    mask = torch.arange(n).unsqueeze(0) <= torch.arange(ctx, n).unsqueeze(1)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


CASES = [  # block_size, heads, kv_heads, head_dim
    (1, 4, 2, 16),
    (16, 9, 3, 64),
    (128, 4, 1, 32),
    (16, 4, 4, 16),
]


@pytest.mark.parametrize("block_size,h,hkv,d", CASES)
def test_reference_equals_dense(block_size, h, hkv, d):
    decode_lens, prefills = [1, 5, 17, 40], [(0, 9), (13, 6), (31, 1 + 1)]
    q, k, v, kc, vc, meta, dense = build_batch(block_size, h, hkv, d, 0, decode_lens, prefills)
    scale = 1 / math.sqrt(d)
    out = paged_attention(q, k, v, kc, vc, meta, scale)
    row = 0
    for k_all, v_all, ctx in dense:
        ql = k_all.shape[0] - ctx
        ref = dense_attention(q[row : row + ql], k_all, v_all, ctx, scale)
        torch.testing.assert_close(out[row : row + ql], ref, atol=1e-5, rtol=1e-5)
        row += ql


kernels = load_cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernel could not be built here")


# Also every head_dim the bf16 kernel specializes (32 / 64 / 128 / 256), with GQA groups of 1-8 query
# heads and block sizes that are not a multiple of 16 (1, 8).
KERNEL_CASES = CASES + [(1, 9, 3, 64), (8, 10, 2, 64), (16, 8, 1, 128), (32, 6, 1, 32), (16, 2, 1, 256)]


@needs_kernel
@pytest.mark.parametrize("block_size,h,hkv,d", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(block_size, h, hkv, d, dtype):
    # ragged, block boundaries included; enough sequences that the CPU kernel also takes its
    # whole-sequence work items where it has them
    decode_lens = [1, 2, 16, 17, 100, 300, 40, 64, 129, 250, 33, 77]
    prefills = [(0, 7), (20, 5)]  # mixed with prefill chunks
    q, k, v, kc, vc, meta, _ = build_batch(block_size, h, hkv, d, 1, decode_lens, prefills, dtype)
    scale = 1 / math.sqrt(d)
    ref = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, scale)
    meta.decode_kernel = kernels.paged_decode_attention
    meta.prefill_as_decode_rows = dtype == torch.float32  # as the runner decides
    out = paged_attention(q, k, v, kc, vc, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_prefill_without_context_is_causal():
    q, k, v, kc, vc, meta, dense = build_batch(16, 2, 2, 8, 3, [], [(0, 12)])
    out = paged_attention(q, k, v, kc, vc, meta, 0.5)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.5
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref)


PREFILL_CASES = [  # block_size, heads, kv_heads, head_dim (the kernel's: 64 or 128)
    (16, 9, 3, 64),
    (32, 8, 8, 64),
    (48, 4, 1, 64),
    (16, 8, 2, 128),
]


@needs_kernel
@pytest.mark.skipif(kernels is None or not kernels.prefill_attention_available(64, 16), reason="no prefill kernel here")
@pytest.mark.parametrize("block_size,h,hkv,d", PREFILL_CASES)
def test_prefill_kernel_equals_reference(block_size, h, hkv, d):
    """All prefill chunks of a step in one call: fresh prompts around the 16-row tile size,
    chunks after a cached context, mixed with decodes (which it must leave alone)."""
    decode_lens = [3, 40]
    prefills = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 100), (20, 5), (31, 40), (5, 200)]
    q, k, v, kc, vc, meta, dense = build_batch(block_size, h, hkv, d, 1, decode_lens, prefills, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    ref = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, scale)
    meta.prefill_kernel = kernels.paged_prefill_attention
    out = paged_attention(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    # ... and as close to exact (float) attention as the reference is
    row = 0
    for k_all, v_all, ctx in dense:
        ql = k_all.shape[0] - ctx
        exact = dense_attention(q[row : row + ql], k_all, v_all, ctx, scale)
        err, ref_err = ((x[row : row + ql].float() - exact).abs().max() for x in (out, ref))
        assert err <= max(2 * ref_err, 1e-2), (row, err, ref_err)
        row += ql


@needs_kernel
def test_prefill_kernel_availability():
    assert not kernels.prefill_attention_available(32, 16)  # head_dim 64 or 128 only
    assert not kernels.prefill_attention_available(64, 8)  # blocks of whole 16-row tiles only


# The float32 kernel's own cases (the AVX2 path where the CPU has one): GQA groups of 1, 3, 8 and
# > 64 query heads, block sizes that are not a multiple of 8, every head_dim it specializes.
F32_CASES = [(16, 9, 3, 64), (16, 3, 3, 64), (16, 8, 1, 64), (12, 6, 2, 128), (8, 4, 1, 256), (1, 2, 1, 32)]
F32_CASES += [(16, 132, 2, 64), (32, 4, 4, 128), (5, 4, 2, 16)]
# length 1, block edges, and lengths split into several chunks of keys (merged afterwards)
F32_LENS = [1, 2, 7, 8, 9, 16, 17, 127, 128, 129, 150, 280, 513, 1000]


def poison_unwritten_rows(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The cache with NaN in every row no sequence has written (stale rows of a last block, free
    blocks): the kernel may read them alongside real rows but must not let them into its output."""
    bs = cache.shape[2]
    written = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    for table, n in zip(meta.decode_block_tables.tolist(), meta.decode_seq_lens.tolist(), strict=True):
        for p in range(n):
            written[table[p // bs], p % bs] = True
    return cache.masked_fill(~written[:, None, :, None], float("nan"))


@needs_kernel
@pytest.mark.parametrize("block_size,h,hkv,d", F32_CASES)
def test_float32_decode_kernel_equals_reference(block_size, h, hkv, d):
    q, k, v, kc, vc, meta, _ = build_batch(block_size, h, hkv, d, 2, F32_LENS, [])
    scale = 1 / math.sqrt(d)
    ref = paged_attention(q, k, v, kc, vc, meta, scale)  # also writes the step's K/V into the caches
    kc, vc = poison_unwritten_rows(kc, meta), poison_unwritten_rows(vc, meta)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc, vc, meta.decode_block_tables, meta.decode_seq_lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    "kv_dtype",
    [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=["kv-bf16", "kv-f16", "kv-e4m3", "kv-e5m2"],
)
@pytest.mark.parametrize("block_size,h,hkv,d", F32_CASES)
def test_float32_decode_kernel_over_a_narrow_cache_equals_reference(block_size, h, hkv, d, kv_dtype):
    """kv_cache_dtype bf16 / fp16 / fp8 under float32 queries: the kernel widens the cache's values as
    the reference does, so the two differ by float summation order only; both stay within the
    K/V rounding of the float32 cache's result."""
    q, k, v, kc, vc, meta, _ = build_batch(block_size, h, hkv, d, 2, F32_LENS, [])
    scale = 1 / math.sqrt(d)
    kc_n, vc_n = kc.to(kv_dtype), vc.to(kv_dtype)
    ref = paged_attention(q, k, v, kc_n, vc_n, meta, scale)  # writes the step's K/V, rounded
    wide = paged_attention(q, k, v, kc, vc, meta, scale)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc_n, vc_n, meta.decode_block_tables, meta.decode_seq_lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # significant bits: bf16 8, fp16 11, e4m3 4, e5m2 3: the outputs (averages of unit normals)
    # move by less than a few roundings of a unit value (measured over these cases: 7.6e-3, 1.0e-3,
    # 0.13, 0.27; against the reference on the same narrow cache all stay below 1e-6)
    rounding = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}[kv_dtype]
    torch.testing.assert_close(out, wide, atol=rounding, rtol=0)
    assert not torch.equal(out, wide)  # the cache really was narrower


@needs_kernel
def test_decode_kernel_refuses_other_cache_dtypes():
    q, _, _, kc, vc, meta, _ = build_batch(16, 4, 2, 64, 1, [5, 9], [])
    args = (meta.decode_block_tables, meta.decode_seq_lens, 0.125)
    for qd, kvd in ((torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32), (torch.float32, torch.float64)):
        qq = q.to(qd)
        with pytest.raises(RuntimeError, match="float8 / int8 under float32 q"):
            kernels.paged_decode_attention(torch.empty_like(qq), qq, kc.to(kvd), vc.to(kvd), *args)


@needs_kernel
def test_float32_decode_kernel_does_not_depend_on_batch_or_threads():
    """A sequence's keys may be split into chunks across threads: the same bits alone, in a batch,
    and on any number of threads (the split depends on the sequence's length only)."""
    lens = [280, 1, 150, 1000, 17, 513, 64]
    q, k, v, kc, vc, meta, _ = build_batch(16, 9, 3, 64, 3, lens, [])
    paged_attention(q, k, v, kc, vc, meta, 0.125)  # writes the step's K/V into the caches
    tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
    prev = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            kernels.paged_decode_attention(out, q, kc, vc, tables, seq_lens, 0.125)
            outs.append(out)
        torch.set_num_threads(prev)
        for i in range(len(lens)):
            alone, one = torch.empty_like(q[i : i + 1]), slice(i, i + 1)
            kernels.paged_decode_attention(alone, q[one], kc, vc, tables[one], seq_lens[one], 0.125)
            assert torch.equal(alone, outs[0][one]), f"sequence {i} (length {lens[i]})"
    finally:
        torch.set_num_threads(prev)
    assert all(torch.equal(o, outs[0]) for o in outs)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (8, 2, 64), (6, 2, 32), (16, 8, 128)])
def test_float32_decode_kernel_rows_of_one_sequence_as_alone(h, hkv, d, kv_dtype):
    """Rows of one sequence at consecutive lengths (a prefill chunk or a verifying pass, attended as
    decode rows) share work items, each key read once for several of them: every row's output is
    the same bits as alone, whatever rows come beside it, across chunk boundaries (lengths near
    128 and 256, where a row's chunks change)."""
    torch.manual_seed(0)
    nb, bs = 64, 16
    kc = (torch.randn(nb, hkv, bs, d) * 2).to(kv_dtype)
    vc = (torch.randn(nb, hkv, bs, d) * 2).to(kv_dtype)
    table, other = torch.randperm(nb)[:20], torch.randperm(nb)[:20]
    lens = list(range(1, 8)) + [77] + list(range(120, 140)) + list(range(250, 262))
    tables = torch.stack([other if n == 77 else table for n in lens])
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), h, d)
    together = torch.empty_like(q)
    kernels.paged_decode_attention(together, q, kc, vc, tables, seq_lens, 0.125)
    for i, n in enumerate(lens):
        alone, one = torch.empty_like(q[i : i + 1]), slice(i, i + 1)
        kernels.paged_decode_attention(alone, q[one], kc, vc, tables[one], seq_lens[one], 0.125)
        assert torch.equal(alone, together[one]), f"row of length {n}"


@needs_kernel
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 32), (9, 3, 64), (4, 4, 64)])
def test_float32_prefill_rows_do_not_depend_on_chunking(h, hkv, d, window):
    """Without a prefill kernel (float32 caches) each prefill query runs as a decode row, so its
    output is the same bits whatever chunk it came in, beside whatever decodes: torch's SDPA did
    not give that (on AVX512 a row's sum changed with the chunk's query count, which flipped a
    Gemma 3 greedy token under chunked prefill)."""
    n = 55
    q, k, v, kc, vc, meta, _ = build_batch(16, h, hkv, d, 4, [], [(0, n)])
    meta.decode_kernel = kernels.paged_decode_attention
    meta.prefill_as_decode_rows = True
    scale = 1 / math.sqrt(d)
    whole = paged_attention(q, k, v, kc, vc, meta, scale, window)  # writes every K/V into the caches
    table = meta.prefills[0].block_ids
    for chunk in (1, 2, 5, 7, 16, 30):
        for start in range(0, n, chunk):
            ql = min(chunk, n - start)
            # beside two decode rows of the same sequence (positions 3 and 40)
            dec_lens = torch.tensor([4, 41])
            rows = torch.cat([q[[3, 40]], q[start : start + ql]])
            part = AttentionMetadata(
                slot_mapping=torch.zeros(2 + ql, dtype=torch.long),
                num_decodes=2,
                decode_block_tables=table.expand(2, -1).contiguous(),
                decode_seq_lens=dec_lens,
                prefills=[PrefillSeq(2, ql, start + ql, table[: -(-(start + ql) // 16)], None)],
                decode_kernel=kernels.paged_decode_attention,
                prefill_as_decode_rows=True,
            )
            out = attend(rows, None, None, kc, vc, part, scale, window)
            assert torch.equal(out[2:], whole[start : start + ql]), f"chunk {chunk} at {start}"
            assert torch.equal(out[:2], whole[[3, 40]])
