"""int8 KV caches (kv_cache_dtype="int8"): the quantizer, the C++ writer and decode kernel against
the PyTorch reference, and the block moves that must carry the scales along.

A float32 step's prefill rows run through the decode kernel (the prefill kernel is bf16 only), so
the decode kernel is the one kernel that reads int8 caches; the one-call decode plan runs it and
the writer (tests/test_quantized.py holds the plan to the fused loop on an int8 cache). Greedy
invariance and TP are in tests/test_kv_cache_dtype.py (its tiny models' heads are at most 64
wide: one scale per row); here once more for 256-wide heads, scaled per 32 values.
"""

from __future__ import annotations

import math

import pytest
import torch
from gguf_models import gguf_files_with_cache
from test_attention import F32_CASES, F32_LENS, build_batch
from test_invariance import run, workload
from tiny_models import build_model

from pagedllm.attention import int8_kv
from pagedllm.attention.int8_kv import attach_scales, cache_scales
from pagedllm.attention.paged_attention import paged_attention, write_kv_cache
from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.rope import apply_rope
from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, move_blocks

kernels = load_cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")


def as_int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache's values quantized as the writer stores them, with their scales attached."""
    q, scales = int8_kv.quantize(cache)
    attach_scales(q, scales.contiguous())
    return q


def read_back(cache: torch.Tensor) -> torch.Tensor:
    return int8_kv.dequantize(cache, cache_scales(cache))


def test_quantizer_rounds_half_to_even_per_token_and_head():
    # rows of up to 64 values: one scale each (a trailing group dimension of 1)
    # one head whose max |x| is 127 (scale exactly 1): its halves round to even
    x = torch.zeros(3, 8)
    x[0] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.49, -126.5, 10.0])
    x[1] = 0.0  # all zero: scale 0, not 0 / 0
    x[2] = torch.tensor([1e-39, -1e-39, 0, 0, 0, 0, 0, 0])  # its scale would be subnormal: stored as zeros
    q, scale = int8_kv.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (3, 1)
    assert q[0].tolist() == [127, 2, 4, 0, -2, 0, -126, 10] and scale[0].item() == 1.0
    assert q[1:].eq(0).all() and scale[1:].eq(0).all()
    # elsewhere: the scale is max |x| / 127 and every value comes back within half a step
    y = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = int8_kv.quantize(y)
    assert torch.equal(scale, y.abs().amax(-1, keepdim=True) / 127)
    assert (q.abs().amax(-1) == 127).all()
    assert ((int8_kv.dequantize(q, scale) - y).abs() <= scale / 2 * (1 + 1e-6)).all()


def test_scale_groups():
    # one scale per row up to 64 values (today's layout), else one per 32 (as llama.cpp's q8_0)
    assert [int8_kv.scale_groups(d) for d in (10, 16, 32, 64, 80, 96, 128, 256)] == [1, 1, 1, 1, 1, 3, 4, 8]
    assert int8_kv.scales_shape((7, 2, 16, 256)) == (7, 2, 16, 8)


def test_quantizer_scales_each_group_of_a_wide_row():
    """A 256-wide row: each group of 32 its own max |x| / 127, so a large channel in one group
    leaves the others their full 255 steps; ties, an all-zero group and a tiny one as per row."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 256, generator=g)
    x[:, :, 5] = 40.0  # a large channel in group 0
    x[1, 0, 32:64] = 0.0  # an all-zero group
    x[2, 1, 64:96] = 1e-39  # a group whose scale would be subnormal: zeros
    x[3, 0, 96:128] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, -126.5, 1.5] * 4)  # scale 1: halves
    q, scale = int8_kv.quantize(x)
    assert q.shape == x.shape and scale.shape == (6, 2, 8)
    groups = x.view(6, 2, 8, 32)
    expected = groups.abs().amax(-1) / 127
    expected[2, 1, 2] = 0.0
    assert torch.equal(scale, expected)
    assert q[1, 0, 32:64].eq(0).all() and q[2, 1, 64:96].eq(0).all()
    assert q[3, 0, 96:104].tolist() == [127, 2, 4, 0, -2, 0, -126, 2]
    back = int8_kv.dequantize(q, scale).view(6, 2, 8, 32)
    # within half a step (the tiny group: within its own size)
    assert ((back - groups).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-6) + 1e-38).all()
    # the groups without the large channel keep their own steps: far finer than one row scale
    others = scale[..., 1:].clone()
    others[3, 0, 2] = 0.0  # the halves' group: scale 1 by construction
    assert (others < scale[..., :1] / 5).all()


def test_int8_block_bytes_count_the_scales():
    # head_dim 64: 64 bytes of values + 4 of scale per token and head, 64/68 of fp8's blocks per GiB
    assert kv_bytes_per_block(2, 16, 4, 64, torch.int8) == 2 * 2 * 16 * 4 * 68
    assert kv_bytes_per_block(2, 16, 4, 64, torch.float8_e4m3fn) == 2 * 2 * 16 * 4 * 64
    # wider heads: 4 bytes per 32 values, 256/288 of fp8's blocks
    assert kv_bytes_per_block(2, 16, 1, 256, torch.int8) == 2 * 2 * 16 * 1 * (256 + 32)
    assert kv_bytes_per_block(2, 16, 1, 128, torch.int8) == 2 * 2 * 16 * 1 * (128 + 16)
    assert kv_bytes_per_block(2, 16, 1, 80, torch.int8) == 2 * 2 * 16 * 1 * (80 + 4)


@needs_kernel
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 128), (3, 1, 10), (4, 1, 256), (6, 2, 96)])
def test_rope_and_cache_write_int8_is_bit_exact(h, hkv, d):
    """The C++ writer's int8 values and scales are the reference quantizer's bits, RoPE included."""
    g = torch.Generator().manual_seed(d)
    t, block_size, num_blocks = 11, 4, 8
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g) * 2
    qkv[3, h * d : (h + 1) * d] = 0.0  # an all-zero K head
    qkv[5, (h + hkv) * d : (h + hkv + 1) * d] = 0.0  # an all-zero V head
    if d >= 64:  # a tiny first group of 32 (stored as zeros where the row is scaled in groups)
        qkv[6, h * d : h * d + 32] *= 1e-39
    qkv[7, (h + hkv) * d + d - 4 : (h + hkv + 1) * d] *= 50  # large channels at the end of a V row
    positions = torch.randint(0, 100, (t,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    angles = torch.rand(100, d // 2, generator=g) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    (k_cache, v_cache), (kc_ref, vc_ref) = allocate_kv_cache(2, num_blocks, block_size, hkv, d, torch.int8, "cpu")

    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    _, k_ref = apply_rope(q.view(t, h, d), k.view(t, hkv, d), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    write_kv_cache(k_ref, v.reshape(t, hkv, d), kc_ref, vc_ref, slots)
    kernels.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slots, h, hkv)
    for got, ref in ((k_cache, kc_ref), (v_cache, vc_ref)):
        assert torch.equal(got, ref)
        assert torch.equal(cache_scales(got), cache_scales(ref))  # bitwise: float32 equality, no tolerance
    assert cache_scales(k_cache)[slots[3] // block_size, 0, slots[3] % block_size].eq(0).all()
    assert cache_scales(v_cache)[slots[5] // block_size, 0, slots[5] % block_size].eq(0).all()
    written = cache_scales(k_cache)[slots // block_size, :, slots % block_size]
    assert written.shape == (t, hkv, int8_kv.scale_groups(d))
    assert (written > 0).any(-1).sum() == t * hkv - 1  # every other head got scales


def write_unrotated(qkv: torch.Tensor, h: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of qkv written at slots 1 and 6 of int8 caches (2 blocks of 4) by the C++ writer
    (RoPE by the identity) and by the reference, held bit-equal; returns the writer's caches."""
    cos, sin = torch.ones(4, d), torch.zeros(4, d)
    slots, positions = torch.tensor([1, 6]), torch.tensor([0, 3])
    (k_cache, v_cache), (kc_ref, vc_ref) = allocate_kv_cache(2, 2, 4, hkv, d, torch.int8, "cpu")
    kernels.rope_and_cache_write(qkv.clone(), positions, cos, sin, k_cache, v_cache, slots, h, hkv)
    k, v = qkv[:, h * d :].view(2, 2 * hkv, d).split(hkv, dim=1)
    write_kv_cache(k, v, kc_ref, vc_ref, slots)
    for got, ref in ((k_cache, kc_ref), (v_cache, vc_ref)):
        assert torch.equal(got, ref) and torch.equal(cache_scales(got), cache_scales(ref))
    return k_cache, v_cache


@needs_kernel
def test_int8_writer_rounds_halves_to_even_as_the_reference():
    """Values at .5 steps (a head whose max is 127: scale 1) and an all-zero head, no rotation."""
    h, hkv, d = 1, 2, 8
    qkv = torch.zeros(2, (h + 2 * hkv) * d)
    halves = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, -126.5, 1.5])
    qkv[:, h * d : (h + 1) * d] = halves  # K head 0; K head 1 stays all zero
    qkv[:, (h + hkv) * d : (h + hkv + 1) * d] = halves * 3  # V head 0: scale 3, the same halves
    qkv[:, (h + hkv + 1) * d :] = -halves / 64  # V head 1: scale 1/64
    k_cache, v_cache = write_unrotated(qkv, h, hkv, d)
    expected = [127, 2, 4, 0, -2, 0, -126, 2]
    assert k_cache[0, 0, 1].tolist() == expected and v_cache[0, 0, 1].tolist() == expected
    assert v_cache[0, 1, 1].tolist() == [-e for e in expected]
    assert k_cache[0, 1, 1].eq(0).all() and cache_scales(k_cache)[0, 1, 1] == 0


@needs_kernel
def test_int8_writer_needs_its_scales():
    h, hkv, d = 2, 1, 8
    qkv = torch.zeros(1, (h + 2 * hkv) * d)
    cache = torch.zeros(2, hkv, 4, d, dtype=torch.int8)
    args = (qkv, torch.tensor([0]), torch.ones(4, d), torch.zeros(4, d), cache, cache.clone(), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="scales go with an int8 cache"):
        kernels._m.rope_and_cache_write(*args, h, hkv, None, None)
    with pytest.raises(RuntimeError, match=r"float32 \[num_blocks, num_kv_heads, block_size, groups\]"):
        kernels._m.rope_and_cache_write(*args, h, hkv, torch.zeros(2, hkv, 3), torch.zeros(2, hkv, 3))
    with pytest.raises(RuntimeError, match="groups"):  # the old layout, one scale per row, no group dimension
        kernels._m.rope_and_cache_write(*args, h, hkv, torch.zeros(2, hkv, 4), torch.zeros(2, hkv, 4))


@needs_kernel
def test_int8_writer_groups_are_bit_exact():
    """A 256-wide head (8 groups of 32): ties at scale 1 in one group, an all-zero group, a tiny
    (subnormal-scale) group, a group scaled 1/64 and one with a large channel, in K and V."""
    h, hkv, d = 2, 1, 256
    halves = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, -126.5, 1.5] * 4)
    row = torch.randn(d, generator=torch.Generator().manual_seed(3))
    row[0:32] = halves  # scale exactly 1: the halves round to even
    row[32:64] = 0.0
    row[64:96] = 1e-39
    row[96:128] = -halves / 64
    row[200] = 300.0
    qkv = torch.zeros(2, (h + 2 * hkv) * d)
    qkv[:, h * d : (h + 1) * d] = row
    qkv[:, (h + 1) * d :] = row.flip(0) * 3
    k_cache, v_cache = write_unrotated(qkv, h, hkv, d)
    ks = cache_scales(k_cache)[0, 0, 1]
    assert ks[0] == 1.0 and ks[1] == 0 and ks[2] == 0 and ks[3] == 127 / 64 / 127
    assert k_cache[0, 0, 1, :8].tolist() == [127, 2, 4, 0, -2, 0, -126, 2]
    assert k_cache[0, 0, 1, 32:96].eq(0).all()
    assert ks[6] == 300.0 / 127 and (ks[[0, 3, 4, 5, 7]] < 2).all()


def poison_unwritten_scales(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    """NaN scales (and extreme values) in every row no sequence has written: the kernel may read
    those rows beside real ones but must not let them into its output."""
    bs = cache.shape[2]
    written = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
        for p in range(n):
            written[table[p // bs], p % bs] = True
    cache_scales(cache).masked_fill_(~written[:, None, :, None], float("nan"))
    cache.masked_fill_(~written[:, None, :, None], -127)


@needs_kernel
@pytest.mark.parametrize("block_size,h,hkv,d", F32_CASES)
def test_float32_decode_kernel_over_an_int8_cache_equals_reference(block_size, h, hkv, d):
    """The kernel folds each key's scale into its score and each value's into its probability;
    the reference multiplies the rows: equal to float summation order. Both stay within int8
    rounding of the float32 cache's result."""
    q, k, v, kc, vc, meta, _ = build_batch(block_size, h, hkv, d, 2, F32_LENS, [])
    scale = 1 / math.sqrt(d)
    kc8, vc8 = as_int8_cache(kc), as_int8_cache(vc)
    ref = paged_attention(q, k, v, kc8, vc8, meta, scale)  # writes the step's K/V, quantized
    wide = paged_attention(q, k, v, kc, vc, meta, scale)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    poison_unwritten_scales(kc8, tables, lens)
    poison_unwritten_scales(vc8, tables, lens)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc8, vc8, tables, lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # a step is max |x| / 127 of a head's unit normals (~2.5e-2 at head_dim 64), the scores move
    # by a few of them: the outputs move by less than one step (measured over these cases: up to
    # 2.4e-2; e4m3 moves the same cases by up to 0.13; against the reference all stay below 1e-6)
    torch.testing.assert_close(out, wide, atol=4e-2, rtol=0)
    assert not torch.equal(out, wide)  # the cache really was int8


@needs_kernel
@pytest.mark.parametrize(
    "block_size,h,hkv,d", [(16, 9, 3, 64), (8, 4, 1, 128), (16, 4, 1, 256), (1, 4, 2, 16), (5, 6, 2, 10), (3, 2, 1, 96)]
)
def test_int8_step_with_prefill_rows_equals_reference(block_size, h, hkv, d):
    """Decodes and prefill chunks (with and without context) in one step, as the runner runs float32:
    the prefill queries as decode rows through the kernel, the reference through SDPA over the
    dequantized blocks (a chunk without context over its own K/V as the cache holds them)."""
    decode_lens = [1, 2, 16, 17, 100, 300, 40, 129]
    prefills = [(0, 7), (20, 5), (33, 40)]
    q, k, v, kc, vc, meta, _ = build_batch(block_size, h, hkv, d, 1, decode_lens, prefills)
    scale = 1 / math.sqrt(d)
    ref = paged_attention(q, k, v, as_int8_cache(kc), as_int8_cache(vc), meta, scale)
    meta.decode_kernel = kernels.paged_decode_attention
    meta.prefill_as_decode_rows = True
    out = paged_attention(q, k, v, as_int8_cache(kc), as_int8_cache(vc), meta, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("d", [64, 256])
def test_int8_sliding_window_decode_equals_reference(window, d):
    q, k, v, kc, vc, meta, _ = build_batch(8, 4, 2, d, 5, [1, 9, 50, 130, 300], [])
    kc8, vc8 = as_int8_cache(kc), as_int8_cache(vc)
    ref = paged_attention(q, k, v, kc8, vc8, meta, 0.125, window)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc8, vc8, meta.decode_block_tables, meta.decode_seq_lens, 0.125, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_kernel_needs_an_int8_caches_scales():
    q, _, _, kc, vc, meta, _ = build_batch(16, 4, 2, 64, 1, [5, 9], [])
    args = (meta.decode_block_tables, meta.decode_seq_lens, 0.125, 0)
    kc8, vc8 = as_int8_cache(kc), as_int8_cache(vc)
    with pytest.raises(RuntimeError, match="scales go with an int8 cache"):
        kernels._m.paged_decode_attention(torch.empty_like(q), q, kc8, vc8, *args, None, None)
    with pytest.raises(RuntimeError, match="scales go with an int8 cache"):  # scales beside a float cache
        kernels._m.paged_decode_attention(torch.empty_like(q), q, kc, vc, *args, cache_scales(kc8), cache_scales(vc8))


def _filled_int8_caches(num_blocks: int, seed: int, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = allocate_kv_cache(2, num_blocks, 4, 2, d, torch.int8, "cpu")
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_blocks * 4)
    for kc, vc in caches:
        k, v = (torch.randn(len(slots), 2, d, generator=g) * torch.rand(len(slots), 2, 1, generator=g) for _ in "kv")
        write_kv_cache(k, v, kc, vc, slots)
    return caches


@pytest.mark.parametrize("d", [16, 256])
def test_block_copies_and_swaps_move_the_scales(d):
    """Copy-on-write and swap out / in copy whole blocks: the int8 rows and their scales (every
    group's), so a copied block reads back the same values (rows alone would read with the
    target's old scales)."""
    device = _filled_int8_caches(6, 0, d)
    host = _filled_int8_caches(4, 1, d)
    assert cache_scales(device[0][0]).shape[-1] == int8_kv.scale_groups(d)
    before = [(read_back(kc).clone(), read_back(vc).clone()) for kc, vc in device]
    move_blocks(device, device, [(1, 4), (2, 5)])  # copy-on-write
    move_blocks(device, host, [(4, 0), (0, 3)])  # swap out
    move_blocks(host, device, [(0, 2), (3, 1)])  # swap in, elsewhere
    for (kc, vc), (k0, v0) in zip(device, before, strict=True):
        for cache, old in ((kc, k0), (vc, v0)):
            now = read_back(cache)
            assert torch.equal(now[4], old[1]) and torch.equal(now[5], old[2])
            assert torch.equal(now[2], old[1]) and torch.equal(now[1], old[0])
            assert torch.equal(now[0], old[0]) and torch.equal(now[3], old[3])
            assert not torch.equal(old[1], old[4])  # the copies really changed blocks


@pytest.fixture(scope="module")
def wide_head_file(tmp_path_factory):
    """The tiny Llama with 256-wide heads (8 scale groups per row) as a Q8_0 GGUF file: integer
    GEMMs give each row the same bits in any batch (tests/test_kv_cache_dtype.py)."""
    root = tmp_path_factory.mktemp("int8_wide")
    hf = build_model("llama", str(root / "llama_hd256"), head_dim=256)
    with gguf_files_with_cache(root, {"llama": (hf, {})}) as paths:
        yield paths["llama"]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=1, num_kv_blocks=4104),
        dict(max_num_batched_tokens=7),
        dict(block_size=8, num_kv_blocks=15, preemption_mode="swap", num_swap_blocks=64),
    ],
    ids=["block1", "chunked", "swap"],
)
def test_wide_heads_greedy_invariant_to_schedule(wide_head_file, kwargs):
    """Grouped scales through the whole engine (writer, decode kernel or reference, swaps): greedy
    output of an int8 cache does not depend on block size, chunking or swapping."""
    prompts = workload()
    expected, llm = run(wide_head_file, prompts, max_num_seqs=1, kv_cache_dtype="int8")
    assert cache_scales(llm.llm_engine.runner.kv_caches[0][0]).shape[-1] == 8
    assert (llm.llm_engine.runner.decode_kernel is not None) == (kernels is not None)  # the kernel ran
    toks, llm = run(wide_head_file, prompts, kv_cache_dtype="int8", **kwargs)
    assert toks == expected
    if "preemption_mode" in kwargs:
        assert llm.llm_engine.scheduler.num_swap_preemptions > 0
