"""Issue 22: every index a kernel reads from a table is checked (an exception, not a wild access),
and no stack array is sized by a head count."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")
BF16 = torch.bfloat16


def decode_inputs(h: int = 4, hkv: int = 2, d: int = 64, bs: int = 16, num_blocks: int = 4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, h, d, generator=g).to(dtype)
    k = torch.randn(num_blocks, hkv, bs, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, hkv, bs, d, generator=g).to(dtype)
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([20, 32])
    return torch.empty_like(q), q, k, v, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t, n: t.__setitem__((1, 1), 4), "outside the cache"),
        (lambda t, n: t.__setitem__((0, 0), -1), "outside the cache"),
        (lambda t, n: n.__setitem__(1, 33), "more than its block table row holds"),
        (lambda t, n: n.__setitem__(0, -5), "length"),
    ],
)
def test_decode_rejects_bad_tables(dtype, mutate, match):
    out, q, k, v, tables, lens = decode_inputs(dtype=dtype)
    kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)  # the good ones run
    mutate(tables, lens)
    with pytest.raises(RuntimeError, match=match):
        kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)


def test_decode_rejects_mismatched_table_shapes():
    out, q, k, v, tables, lens = decode_inputs()
    with pytest.raises(RuntimeError, match="one block table row"):
        kernels.paged_decode_attention(out, q, k, v, tables[:1], lens, 0.125)
    with pytest.raises(RuntimeError, match="one block table row"):
        kernels.paged_decode_attention(out, q, k, v, tables, lens[:1], 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_decode_with_many_query_heads(dtype):
    # > 64 query heads: a fixed float inv[64] in the per-sequence bf16 path overflowed the stack.
    out, q, k, v, tables, lens = decode_inputs(h=160, hkv=2, dtype=dtype)
    kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)
    ref = torch.empty(q.shape, dtype=torch.float32)
    kernels.paged_decode_attention(ref, q.float(), k.float(), v.float(), tables, lens, 0.125)
    assert torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_rope_and_cache_write_rejects_bad_slots_and_positions(dtype):
    h, hkv, d, t, bs, num_blocks = 4, 2, 16, 3, 4, 2
    qkv = torch.zeros(t, (h + 2 * hkv) * d, dtype=dtype)
    cos = torch.ones(10, d, dtype=dtype)
    sin = torch.zeros(10, d, dtype=dtype)
    k_cache = torch.zeros(num_blocks, hkv, bs, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([0, 1, 2])
    kernels.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, torch.tensor([0, 5, 7]), h, hkv)
    for slots in ([0, 8, 1], [-1, 0, 1]):
        with pytest.raises(RuntimeError, match="outside the cache"):
            kernels.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, torch.tensor(slots), h, hkv)
    with pytest.raises(RuntimeError, match="RoPE table"):
        kernels.rope_and_cache_write(
            qkv, torch.tensor([0, 10, 1]), cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2]), h, hkv
        )


def test_prefill_rejects_bad_block_ids():
    h, hkv, d, bs = 4, 2, 64, 16
    if not kernels.prefill_attention_available(d, bs):
        pytest.skip("the bf16 prefill kernel is not built for this CPU")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, h, d, generator=g).to(BF16)
    k = torch.randn(2, hkv, bs, d, generator=g).to(BF16)
    v = torch.randn(2, hkv, bs, d, generator=g).to(BF16)
    out = torch.empty_like(q)
    args = (torch.tensor([0]), torch.tensor([8]), torch.tensor([4]), 0.125)
    kernels.paged_prefill_attention(out, q, k, v, torch.tensor([[1]]), *args)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_prefill_attention(out, q, k, v, torch.tensor([[2]]), *args)
