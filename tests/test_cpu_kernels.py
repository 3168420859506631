"""The compiled CPU layer kernels (pagedllm/kernels) equal the PyTorch reference path.

RoPE + cache write must give the reference's bits (bf16 and float32); the others agree to bf16
rounding, or in float32 to a few float ulps. At the model level, the fused bf16 forward must pick
the reference's greedy tokens wherever the reference's choice is not a near-tie; the fused float32
forward must pick them all, with logprobs equal to float rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.attention.paged_attention import write_kv_cache
from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.rope import apply_rope
from pagedllm.sampler import Sampler

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")
BF16, F32 = torch.bfloat16, torch.float32
FP8_E4M3, FP8_E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(BF16, BF16), (F32, F32), (F32, BF16), (F32, torch.float16), (F32, FP8_E4M3), (F32, FP8_E5M2)],
    ids=["bf16", "f32", "f32-kv-bf16", "f32-kv-f16", "f32-kv-e4m3", "f32-kv-e5m2"],
)
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 128), (3, 1, 10)])
def test_rope_and_cache_write_is_bit_exact(h, hkv, d, dtype, kv_dtype):
    """float32 too: the kernel rounds each product and the sum as the reference does (no FMA).
    A narrower cache (kv_cache_dtype) holds K/V rounded to nearest even, as torch's .to() rounds."""
    g = torch.Generator().manual_seed(d)
    t, block_size, num_blocks = 11, 4, 8
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 100, (t,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    angles = torch.rand(100, d // 2, generator=g) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k_cache = torch.zeros(num_blocks, hkv, block_size, d, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)

    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    c, s = cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)
    q_ref, k_ref = apply_rope(q.view(t, h, d), k.view(t, hkv, d), c, s)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k_ref, v.reshape(t, hkv, d), kc_ref, vc_ref, slots)

    # a strided view (rows of a wider buffer), as the fused projection output can be
    buf = torch.zeros(t, qkv.shape[1] + 32, dtype=dtype)
    buf[:, : qkv.shape[1]] = qkv
    view = buf[:, : qkv.shape[1]]
    kernels.rope_and_cache_write(view, positions, cos.to(dtype), sin.to(dtype), k_cache, v_cache, slots, h, hkv)
    assert torch.equal(view[:, : h * d].view(t, h, d), q_ref)
    assert torch.equal(view[:, h * d : (h + hkv) * d].view(t, hkv, d), k_ref)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    # the layout itself: a head's keys of a block are contiguous, [block, kv head, offset, dim]
    assert torch.equal(k_cache[slots // block_size, :, slots % block_size], k_ref.to(kv_dtype))
    assert torch.equal(buf[:, qkv.shape[1] :], torch.zeros(t, 32, dtype=dtype))  # nothing past the row


@pytest.mark.parametrize(
    "kv_dtype,largest", [(torch.float16, 65504), (FP8_E4M3, 448), (FP8_E5M2, 57344)], ids=["f16", "e4m3", "e5m2"]
)
def test_narrow_cache_saturates_rather_than_store_infinities(kv_dtype, largest):
    """K/V beyond the cache dtype's range are stored as its largest finite value by the kernel
    and the reference alike (float8 as vLLM stores it unscaled)."""
    h, hkv, d = 2, 1, 8
    qkv = torch.zeros(2, (h + 2 * hkv) * d)
    qkv[:, h * d :] = torch.tensor([1e6, -1e6, 7.0, 70000.0, 500.0, -460.0, 1e-5, -3e-3] * (2 * hkv * d // 8)).repeat(
        2, 1
    )
    cos, sin = torch.ones(4, d), torch.zeros(4, d)  # no rotation
    slots, positions = torch.tensor([1, 6]), torch.tensor([0, 3])
    k_cache = torch.zeros(2, hkv, 4, d, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    kernels.rope_and_cache_write(qkv.clone(), positions, cos, sin, k_cache, v_cache, slots, h, hkv)
    kc_ref, vc_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k, v = qkv[:, h * d :].view(2, 2 * hkv, d).split(hkv, dim=1)
    write_kv_cache(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    assert torch.isfinite(k_cache.float()).all() and k_cache.float().abs().max() == largest


def test_rope_and_cache_write_rejects_mixed_dtypes():
    h, hkv, d = 2, 1, 8
    qkv = torch.zeros(1, (h + 2 * hkv) * d)
    tables = torch.ones(4, d), torch.zeros(4, d)
    cache = torch.zeros(2, hkv, 4, d)
    args = (torch.tensor([0]), *tables, cache, cache.clone(), torch.tensor([1]), h, hkv)
    kernels.rope_and_cache_write(qkv, *args)  # all float32: fine
    for bad in (qkv.to(BF16), qkv.double()):
        with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
            kernels.rope_and_cache_write(bad, *args)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):  # bf16 tables with float32 qkv
        kernels.rope_and_cache_write(qkv, args[0], tables[0].to(BF16), tables[1].to(BF16), *args[3:])
    # caches narrower than float32 qkv are taken (kv_cache_dtype); other mixes are not
    narrow = (cache.to(torch.float16), cache.to(torch.float16))
    kernels.rope_and_cache_write(qkv, *args[:3], *narrow, *args[5:])
    bf16_qkv = (qkv.to(BF16), args[0], tables[0].to(BF16), tables[1].to(BF16))
    for caches in (narrow, (cache, cache.clone()), (cache.to(BF16), cache.to(torch.float16))):
        with pytest.raises(RuntimeError, match="caches of qkv's dtype"):
            kernels.rope_and_cache_write(*bf16_qkv, *caches, *args[5:])


def test_silu_and_mul_matches_reference():
    gate_up = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(BF16)
    gate, up = gate_up.split(1536, dim=-1)
    ref = F.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    # same formula and roundings; only the last bit of exp may differ
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-5)  # two bf16 ulps
    assert (out == ref).float().mean() > 0.99


def test_silu_and_mul_bf16_very_negative_gates_are_zero_not_nan():
    # e^-x overflows below -88.7; the reference's silu is then -0, the kernel must not make NaN
    gate = torch.tensor([[-1e4, -100.0, -88.5, 0.0, 100.0]])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=-1).to(BF16)
    out = kernels.silu_and_mul(gate_up)
    assert out.isfinite().all()
    torch.testing.assert_close(out, F.silu(gate.to(BF16)) * 1, rtol=1.6e-2, atol=1e-5)


# float32 tolerances. SiLU: the reference's exp is Sleef's (1 ulp), the kernel's glibc's vectorized
# expf, and -ffast-math makes the division a reciprocal estimate plus a Newton step (~2 ulps): a
# few float ulps (2^-24 = 6e-8 relative each) in all, under 1e-6 relative. RMSNorm: the same
# operations in the same order, except the sum of squares (another summation order: blocked sums
# of at most a few thousand terms differ by a few 1e-7 relative), which moves the scale 1 / rms by
# half of that; 1e-6 relative again. atol only for results that round to 0 on one side.
F32_RTOL, F32_ATOL = 1e-6, 1e-30


@pytest.mark.parametrize("t,inter", [(1, 1536), (7, 1536), (3, 13)])
def test_silu_and_mul_float32_matches_reference(t, inter):
    g = torch.Generator().manual_seed(inter + t)
    gate_up = torch.randn(t, 2 * inter + 5, generator=g)[:, : 2 * inter] * 8  # strided rows
    gate_up[0, :8] = torch.tensor([-1e4, -100.0, -88.5, -87.0, 0.0, 87.0, 100.0, 1e4])  # e^-x would overflow
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    assert out.dtype == F32 and out.shape == (t, inter) and out.isfinite().all()
    torch.testing.assert_close(out, ref, rtol=F32_RTOL, atol=F32_ATOL)


@pytest.mark.parametrize("t,n", [(1, 576), (5, 576), (3, 4096 + 7), (2, 1)])
def test_add_rms_norm_float32_matches_reference(t, n):
    from pagedllm.models.llama import RMSNorm

    g = torch.Generator().manual_seed(n + t)
    x = torch.randn(t, n, generator=g) * 3
    residual = torch.randn(t, n, generator=g)
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=g) + 0.5)
    expected_residual = residual + x
    ref = norm(expected_residual)  # transformers' float32 formula
    out = kernels.add_rms_norm(x, residual, norm.weight.detach(), 1e-5)
    assert torch.equal(residual, expected_residual)  # the same single rounding of each sum
    torch.testing.assert_close(out, ref, rtol=F32_RTOL, atol=F32_ATOL)


def test_layer_kernels_reject_mixed_dtypes():
    x, w = torch.randn(2, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        kernels.add_rms_norm(x, x.clone(), w.to(BF16), 1e-5)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        kernels.add_rms_norm(x.double(), x.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.add_rms_norm(x, x.clone(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernels.silu_and_mul(x.double())


def test_add_rms_norm_updates_residual_and_normalizes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 576, generator=g).to(BF16)
    residual = torch.randn(5, 576, generator=g).to(BF16)
    weight = (torch.rand(576, generator=g) + 0.5).to(BF16)
    expected_residual = residual + x
    ref = F.rms_norm(expected_residual, (576,), weight, 1e-5)
    out = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)


def test_decode_kernel_reads_strided_queries():
    g = torch.Generator().manual_seed(3)
    h, hkv, d, bs = 9, 3, 64, 16
    k_cache = torch.randn(6, hkv, bs, d, generator=g).to(BF16)
    v_cache = torch.randn(6, hkv, bs, d, generator=g).to(BF16)
    tables = torch.tensor([[3, 1, 5], [0, 2, 4]])
    lens = torch.tensor([40, 17])
    wide = torch.randn(2, (h + 2 * hkv) * d, generator=g).to(BF16)
    q_view = wide[:, : h * d].view(2, h, d)
    out_strided, out_contig = torch.empty(2, h, d, dtype=BF16), torch.empty(2, h, d, dtype=BF16)
    kernels.paged_decode_attention(out_strided, q_view, k_cache, v_cache, tables, lens, 0.125)
    kernels.paged_decode_attention(out_contig, q_view.contiguous(), k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(out_strided, out_contig)


@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 1, 128), (6, 1, 32)])
def test_decode_kernel_output_does_not_depend_on_the_batch(h, hkv, d):
    """A sequence's bf16 attention output is the same bits in a batch of many (a whole sequence per
    work item where the group's accumulators fit in registers) as alone (a kv head per work item)."""
    g = torch.Generator().manual_seed(h * d)
    bs, lens = 16, [300, 17, 1, 64, 250, 33, 100, 299, 180, 5, 128, 77]
    per_seq = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(per_seq), generator=g)  # scattered blocks
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.long)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n
    k_cache = torch.randn(sum(per_seq), hkv, bs, d, generator=g).to(BF16)
    v_cache = torch.randn(sum(per_seq), hkv, bs, d, generator=g).to(BF16)
    q = torch.randn(len(lens), h, d, generator=g).to(BF16)
    batched = torch.empty_like(q)
    kernels.paged_decode_attention(batched, q, k_cache, v_cache, tables, torch.tensor(lens), d**-0.5)
    for i, n in enumerate(lens):
        alone, one = torch.empty_like(q[i : i + 1]), slice(i, i + 1)
        kernels.paged_decode_attention(alone, q[one], k_cache, v_cache, tables[one], torch.tensor([n]), d**-0.5)
        assert torch.equal(alone, batched[one]), f"sequence {i} (length {n})"


@pytest.mark.parametrize(
    "family,engine_args",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {}),  # head_dim 64: prompts through the AMX prefill kernel where there is one
        ("mistral", {"max_num_batched_tokens": 16}),  # prompt chunks after a cached context
    ],
)
def test_fused_bf16_forward_picks_reference_tokens(tiny_model_dirs, family, engine_args):
    """Greedy decoding through the kernels follows the reference path token for token, except
    after a position where the reference's top two logprobs are a near-tie (bf16 rounding)."""
    prompts = [[1, 5, 9, 200, 3], list(range(10, 60)), [7] * 23]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(
            model=tiny_model_dirs[family],
            dtype="bfloat16",
            num_kv_blocks=64,
            attention_backend=backend,
            **engine_args,
        )
        assert (llm.llm_engine.model.kernels is not None) == (backend == "auto")
        if backend == "auto" and family == "mistral" and kernels.prefill_attention_available(64, 16):
            assert llm.llm_engine.runner.prefill_kernel is not None
        if backend == "auto" and kernels.packed_gemm_available():  # the packed GEMMs and the fused SiLU epilogue ran
            assert llm.llm_engine.model.layers[0].mlp.gate_up_proj.local.fused_silu_mul
        outs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert_bf16_tokens_follow(outs["auto"], outs["torch"])


def assert_bf16_tokens_follow(fast_outs: list, ref_outs: list, min_compared: int = 12) -> None:
    """Each completion's tokens are the reference's until a near-tie of its top two logprobs
    (bf16 rounding may pick either), the chosen logprobs within 0.1 up to there; at least
    ``min_compared`` tokens compared in all."""
    compared = 0
    for fast, ref in zip(fast_outs, ref_outs, strict=True):
        for i, (a, b) in enumerate(zip(fast.token_ids, ref.token_ids, strict=True)):
            top = sorted((e.logprob for e in ref.logprobs[i].values()), reverse=True)
            if a != b:
                assert top[0] - top[1] < 0.1, f"diverged at step {i} without a near-tie: {top}"
                break
            assert abs(fast.logprobs[i][a].logprob - ref.logprobs[i][b].logprob) < 0.1
            compared += 1
    assert compared >= min_compared


def _final_hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's output (final-norm hidden states) for one prompt: one prefill step of the engine."""
    captured = []
    handle = llm.llm_engine.model.register_forward_hook(lambda mod, inp, out: captured.append(out.clone()))
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        handle.remove()
    return captured[0]


@pytest.mark.parametrize(
    "family,engine_args",
    [
        ("llama", {}),
        ("llama3_rope", {}),
        ("qwen2", {}),
        ("mistral", {}),
        ("mistral", {"max_num_batched_tokens": 16}),  # prompt chunks after a cached context
    ],
)
def test_fused_float32_forward_matches_reference(tiny_model_dirs, family, engine_args):
    """float32 through the kernels: RoPE and the cache write are the reference's bits, SiLU and
    add + RMSNorm a few float ulps off (see F32_RTOL), so the logits agree to float rounding and
    every greedy token is the reference's."""
    prompts = [[1, 5, 9, 200, 3], list(range(10, 60)), [7] * 23]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    outs, logits = {}, {}
    for backend in ("auto", "torch"):
        llm = LLM(
            model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=64, attention_backend=backend, **engine_args
        )
        model = llm.llm_engine.model
        assert (model.kernels is not None) == (backend == "auto")
        assert model.activation_dtype() == F32
        logits[backend] = model.compute_logits(_final_hidden(llm, list(range(3, 80))))
        outs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    # The norms' few-ulp differences reach logits of order 5 as ~1e-6 of rounding; 1e-5 is ~20 float ulps there.
    torch.testing.assert_close(logits["auto"], logits["torch"], rtol=1e-5, atol=1e-5)
    for fast, ref in zip(outs["auto"], outs["torch"], strict=True):
        assert fast.token_ids == ref.token_ids
        for lp_fast, lp_ref in zip(fast.logprobs, ref.logprobs, strict=True):
            for tok in lp_fast.keys() & lp_ref.keys():
                assert abs(lp_fast[tok].logprob - lp_ref[tok].logprob) < 1e-5


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 100, 49152 + 5])
def test_argmax_rows_equals_torch_first_maximum(n, dtype):
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(7, n + 3, generator=g).to(dtype)[:, :n]  # strided rows
    rows[1] = rows[1].round()  # many ties: the first maximum wins
    rows[2, : n // 2] = float("-inf")  # masked tokens
    rows[3] = 0.0
    rows[3, n // 2 :] = -0.0  # -0 and +0 are equal
    rows[4] = -rows[4].abs() - 1  # all negative
    rows[5, -1] = 100.0  # the maximum in the tail
    rows[6, n // 2 :] = rows[6].max() + 1  # equal maxima from the middle on: the first is past 64 for large n
    expected = rows.float().max(dim=-1).indices
    first = torch.stack([(r.float() == r.float().max()).nonzero()[0, 0] for r in rows])
    assert torch.equal(expected, first)  # torch's max returns the first maximum here too
    assert torch.equal(kernels.argmax_rows(rows), expected)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_greedy_sampler_uses_the_kernel_and_agrees(dtype):
    from test_sampling import make_req

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    reqs = [make_req(prompt=[1], temperature=0.0) for _ in range(5)]
    calls = []

    def counting(x):
        calls.append(x.shape)
        return kernels.argmax_rows(x)

    fast = Sampler(argmax_rows=counting)(logits, reqs).token_ids
    assert calls == [logits.shape]
    assert fast == Sampler()(logits, reqs).token_ids == logits.float().argmax(-1).tolist()


packed = pytest.mark.skipif(kernels is None or not kernels.packed_gemm_available(), reason="built without AVX512-BF16")


@packed
# 1-6 rows: one register block of dot products; with AMX, 7 up: tiles, partial row tiles; without,
# several 6-row blocks and a partial one; both: more than one 256-row chunk
@pytest.mark.parametrize("m", [1, 3, 6, 7, 16, 17, 32, 33, 200, 300])
# k 576: more than one 8-chunk K block when there are several row tiles (AMX); n 96 and 224: a
# thread's share of strips ends in a group of 2 instead of 4
@pytest.mark.parametrize(
    "n,k,bias", [(64, 32, False), (96, 160, True), (1024, 96, False), (128, 576, True), (224, 64, False)]
)
def test_packed_gemm_matches_linear(m, n, k, bias):
    from pagedllm.models.cpu_linear import tile_order

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = kernels.packed_gemm(x, tile_order(w), b, "none")
    assert out.shape == (m, n) and out.dtype == BF16
    torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=8e-3)
    # rows are independent: the same row gives the same bits whatever else is in the batch
    other = x[-7:] if m >= 7 else x[-1:]  # a different batch served the same way (tiles with AMX)
    assert torch.equal(kernels.packed_gemm(other.contiguous(), tile_order(w), b, "none")[-1], out[-1])


@packed
@pytest.mark.parametrize("m", [3, 40])
def test_packed_gemm_silu_mul_epilogue_equals_the_unfused_kernels(m):
    from pagedllm.models.cpu_linear import interleave_gate_up, tile_order

    g = torch.Generator().manual_seed(m)
    inter, k = 64, 96
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).to(BF16)  # [gate; up]
    unfused = kernels.silu_and_mul(kernels.packed_gemm(x, tile_order(w), None, "none"))
    fused = kernels.packed_gemm(x, tile_order(interleave_gate_up(w)), None, "silu_mul")
    assert fused.shape == (m, inter) and torch.equal(fused, unfused)


@packed
@pytest.mark.parametrize("m", [2, 9])  # one register block; AMX tiles or two register blocks
def test_packed_gate_up_layer_keeps_plain_output_order(m):
    from pagedllm.models.cpu_linear import PackedLinear

    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(64, 128, bias=False).to(BF16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 64, generator=g) * 0.1)
    layer = PackedLinear(lin, kernels, fuse_silu_mul=True)
    assert layer.fused_silu_mul
    x = torch.randn(m, 64, generator=g).to(BF16)
    ref = F.linear(x.float(), lin.weight.float())
    torch.testing.assert_close(layer(x).float(), ref, rtol=8e-3, atol=8e-3)
    gate, up = ref.split(64, dim=-1)
    torch.testing.assert_close(layer.silu_and_mul(x).float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


@packed
@pytest.mark.parametrize("m", [1, 6, 7, 16, 33, 200])  # one register block, then tiles or several blocks
def test_packed_gemm_argmax_equals_argmax_of_the_logits(m):
    """The greedy head's fused argmax picks what argmax_rows picks from packed_gemm's bf16 logits,
    first maximum on ties: within a strip pair, across strip pairs and across the threads' halves."""
    from pagedllm.models.cpu_linear import tile_order

    g = torch.Generator().manual_seed(m)
    n, k = 4096, 96
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF16)
    x = torch.randn(m, k, generator=g).to(BF16)
    # Rows 0-2 of x point at weight rows copied to several columns: exact ties for the maximum.
    for r, cols in enumerate([(5, 17), (40, 3000), (2047, 2048, 4095)]):
        if r < m:
            w[list(cols)] = (x[r].float() * 4).to(BF16)
    packed = tile_order(w)
    expected = kernels.argmax_rows(kernels.packed_gemm(x, packed, None, "none"))
    assert torch.equal(kernels.packed_gemm_argmax(x, packed), expected)
    for r, cols in enumerate([(5, 17), (40, 3000), (2047, 2048, 4095)]):
        if r < m:
            assert expected[r] == cols[0]


@packed
def test_greedy_steps_skip_the_logits_and_pick_the_same_tokens(tiny_model_dirs, monkeypatch):
    """An all-greedy step hands the head's argmax straight to the scheduler (no logits): same
    tokens as the logits path; a step that wants logprobs still computes the logits."""
    from pagedllm.models.llama import LlamaForCausalLM

    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 3], list(range(10, 60)), [7] * 23)]
    llm = LLM(model=tiny_model_dirs["llama"], dtype="bfloat16", num_kv_blocks=64)
    calls = {"greedy": 0, "logits": 0}
    greedy, logits = LlamaForCausalLM.greedy_tokens, LlamaForCausalLM.compute_logits

    def counting(name, f):
        def g(*a):
            calls[name] += 1
            return f(*a)

        return g

    monkeypatch.setattr(LlamaForCausalLM, "greedy_tokens", counting("greedy", greedy))
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", counting("logits", logits))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls == {"greedy": 10, "logits": 0}
    monkeypatch.setattr(LlamaForCausalLM, "greedy_tokens", lambda self, hidden: None)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls["logits"] == 10 and fused == plain
    with_logprobs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1))
    assert [o.outputs[0].token_ids for o in with_logprobs] == fused and calls["logits"] == 20
