"""GGUF weights executed in their quantized blocks (QuantizedLinear, kernels/quant_gemm.cpp,
models/gguf_weights.py) against the reference: dequantize-then-matmul, and today's dequantize-at-load."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_models import K_QUANTS, gguf_files_with_cache, pack_k_quant, tiny_gemma3_llama_cpp_hf, tiny_kquant_hf

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

T = GGMLQuantizationType
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
ROWS = (1, 5, 7, 64, 300, 1024)  # 1024: several panels and thread splits at prefill size
# repacked eight rows at a time (quant_gemm_interleaved.cpp; quant_gemm_q4k_q5k.cpp, quant_gemm_q6k.cpp)
INTERLEAVED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
REPACKED_IN_PLACE = (T.Q4_0, T.Q4_1, T.Q8_0)  # the same bytes, permuted (Q4_K's scales are unpacked)
FIFTH_BITS_TRANSPOSED = (T.Q5_0, T.Q5_1)  # in place, the same bits permuted (within each block's qh)
FINE_SCALES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # interleaved, inputs with a scale per 16 (down_proj)


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("CPU kernels not built here")
    return k


def make_weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF blocks [n, bytes] uint8, their float values [n, k] by gguf-py's dequantizer)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        raw = pack_k_quant(qtype, n, k, rng)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    wf = dequantize(raw, qtype).reshape(n, k).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(wf)


def tie_steps(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Per element of t [rows, blocks, block] (x / d before rounding): its step d where it lies
    within four float32 ulps of a rounding midpoint, else 0. There the kernel's x * (kMax / amax),
    compiled with -ffast-math, may round the other way than this emulation: one step d of that one
    value (at 1024 rows one did)."""
    td = t.double()
    ulp = torch.ldexp(torch.ones_like(td), torch.frexp(td.abs().clamp(min=1)).exponent - 24)
    near = (td - td.floor() - 0.5).abs() <= 4 * ulp
    return torch.where(near, d.expand_as(t), torch.zeros_like(t)).reshape(t.shape[0], -1)


def q16_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation scheme: per block of 32, d = amax / 32767, q = round(x / d) as int16.
    Returns (dequantized x, per-element rounding bound d / 2, tie_steps)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 32767
    t = b * torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    return (torch.round(t) * d).reshape(x.shape), (d / 2).expand_as(b).reshape(x.shape), tie_steps(t, d)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_quant_gemm_matches_dequantize_then_matmul(kernels, qtype, rows):
    n, k = 80, 512  # 80: not a multiple of the kernel's 16-row tiles; 512: two K-quant super-blocks
    w, wf = make_weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_gemm(x, w, int(qtype))
    assert y.shape == (rows, n) and y.dtype == torch.float32

    assert_kernel_arithmetic(y, x, wf, q16_activations(x))


def assert_kernel_arithmetic(y, x, wf, activations: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """y = quant_gemm(x) against the float weights wf, given the kernel's activation scheme
    (dequantized x, per-element rounding bound, the steps of values at a near-tie)."""
    xq, err, ties = activations
    # 1. Exactly the kernel's arithmetic in float64 (its quantized activations, the file's weights):
    #    the integer dot products are exact, only float32 rounding of the per-block scale products
    #    and the sums separates them, and a value at a near-tie may have rounded one step apart.
    emulated = xq.double() @ wf.double().T
    scale = xq.double().abs() @ wf.double().abs().T
    tie_bound = ties.double() @ wf.double().abs().T
    assert torch.all((y.double() - emulated).abs() <= 2e-5 * scale + 1e-6 + tie_bound)
    # 2. Against the float reference the only extra error is the activations' rounding:
    #    |x - xq| <= d / 2 per element, so |y - x W^T| <= (d / 2) @ |W|^T (plus the float slack).
    ref = x.double() @ wf.double().T
    bound = err.double() @ wf.double().abs().T
    assert torch.all((y.double() - ref).abs() <= bound * (1 + 1e-4) + 2e-5 * scale + 1e-6)


def q8_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The interleaved kernel's activations: per block of 32 (fine scales: 16), d = amax / 127,
    q = round(x / d) as int8. Returns (dequantized x, per-element rounding bound d / 2, tie_steps)."""
    b = x.reshape(x.shape[0], -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    t = b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    d = amax / 127
    return (torch.round(t) * d).reshape(x.shape), (d / 2).expand_as(b).reshape(x.shape), tie_steps(t, d)


def interleaved(kernels, w: torch.Tensor, qtype) -> tuple[torch.Tensor, int]:
    """(a repacked copy of GGUF rows w, quant_gemm's code for it)."""
    p = kernels.quant_interleave_rows(w.clone(), int(qtype))
    return p, kernels.interleaved_qtype(int(qtype))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: t.name)
def test_interleaved_quant_gemm_matches_dequantize_then_matmul(kernels, qtype, rows):
    n, k = 80, 512  # ten groups of eight rows, not a multiple of the kernel's four-group tiles
    w, wf = make_weight(qtype, n, k, seed=rows)
    p, code = interleaved(kernels, w, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_gemm(x, p, code)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # activations: int8 for Q4_x / Q5_x / K-quants, int16 for Q8_0
    assert_kernel_arithmetic(y, x, wf, q16_activations(x) if qtype == T.Q8_0 else q8_activations(x))


# Offsets of each format's fp16 scale fields (d, and m / dmin) in a block.
SCALE_FIELDS = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.mark.parametrize("rows", (1, 5, 16))
@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: t.name)
def test_interleaved_quant_gemm_exact_at_the_largest_integers(kernels, qtype, rows):
    """Every weight at its format's largest code (all bits set: Q5_K's 31, Q4_K's 15, the 6-bit
    scales and mins 63) against activations of +-127 steps: the integer sums' largest values, which
    the AVX2 path holds in int16 lanes for a few runs before widening (Q5_K: four runs of
    2 * 31 * 127). Random blocks never come near; an overflow here is an error of whole units."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    n, k = 16, 512
    raw = np.full((n, k // block, nbytes), 0xFF, dtype=np.uint8)
    for o in SCALE_FIELDS.get(qtype, (0,)):
        raw[..., o : o + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    w = torch.from_numpy(raw.reshape(n, -1))
    wf = torch.from_numpy(dequantize(raw.reshape(n, -1), qtype).reshape(n, k).astype(np.float64))
    p, code = interleaved(kernels, w, qtype)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0] + [-1.0] * 11)[:rows, None]
    x = signs * torch.ones(rows, k)  # every block's amax 1: q_x = +-127, d_x = 1 / 127
    y = kernels.quant_gemm(x, p, code).double()
    ref = x.double() @ wf.T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def fine(kernels, w: torch.Tensor, qtype) -> tuple[torch.Tensor, int]:
    """(a repacked copy of GGUF rows w, quant_gemm's code for it with fine input scales)."""
    p, _ = interleaved(kernels, w, qtype)
    return p, kernels.fine_scales_qtype(int(qtype))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", FINE_SCALES, ids=lambda t: t.name)
def test_fine_scales_quant_gemm_matches_dequantize_then_matmul(kernels, qtype, rows):
    n, k = 80, 512
    w, wf = make_weight(qtype, n, k, seed=rows)
    p, code = fine(kernels, w, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_gemm(x, p, code)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_kernel_arithmetic(y, x, wf, q8_activations(x, block=16))


@pytest.mark.parametrize("qtype", FINE_SCALES, ids=lambda t: t.name)
def test_fine_scales_round_outliers_closer(kernels, qtype):
    """Inputs as down_proj's: one large value per 32. Each 16's own scale leaves the other half its
    full int8 range, so the products land closer to the float ones than with a scale per 32."""
    w, wf = make_weight(qtype, 64, 1024, seed=11)
    p, code = fine(kernels, w, qtype)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(12)) * 0.05
    x[:, ::32] = 20.0  # the first element of every block of 32: the low half's 16 only
    ref = x.double() @ wf.double().T
    err_fine = (kernels.quant_gemm(x, p, code).double() - ref).abs().mean()
    err_coarse = (kernels.quant_gemm(x, p, kernels.interleaved_qtype(int(qtype))).double() - ref).abs().mean()
    assert err_fine < 0.7 * err_coarse, (err_fine, err_coarse)


def test_fine_scales_only_for_the_nibble_formats(kernels):
    assert [kernels.fine_scales_qtype(int(t)) is not None for t in FORMATS] == [t in FINE_SCALES for t in FORMATS]
    for qtype in FORMATS:
        w, _ = make_weight(qtype, 16, 256)
        layer = QuantizedLinear(w, int(qtype), 256, None, kernels, fine_input_scales=True)
        assert layer.fine_input_scales == (qtype in FINE_SCALES)
        assert not QuantizedLinear(w.clone(), int(qtype), 256, None, kernels).fine_input_scales


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: t.name)
def test_interleaving_permutes_the_file_bytes(kernels, qtype):
    w, _ = make_weight(qtype, 24, 256, seed=5)
    p, _ = interleaved(kernels, w, qtype)
    if qtype in REPACKED_IN_PLACE:
        assert not torch.equal(p, w) and p.shape == w.shape
        assert torch.equal(p.flatten().sort().values, w.flatten().sort().values)  # the same bytes
    elif qtype in FIFTH_BITS_TRANSPOSED:  # d (and m) and qs bytes permuted, each qh's bits transposed
        assert not torch.equal(p, w) and p.shape == w.shape
        assert np.unpackbits(p.numpy()).sum() == np.unpackbits(w.numpy()).sum()  # as many set bits
    elif qtype in (T.Q4_K, T.Q5_K):  # 8 rows x 144 / 176 bytes a super-block, plus 6-bit scales and mins as bytes
        assert p.shape == (24, (1184 if qtype == T.Q4_K else 1440) // 8)
    else:  # Q6_K: the file's bytes, regrouped
        assert p.shape == w.shape and not torch.equal(p, w)
        assert torch.equal(p.flatten().sort().values, w.flatten().sort().values)
    assert torch.equal(kernels.quant_interleaved_rows(p, int(qtype), torch.arange(24)), w)
    ids = torch.tensor([23, 0, 9, 9, 16])  # rows of any group, any order, repeated: embedding lookups
    assert torch.equal(kernels.quant_interleaved_rows(p, int(qtype), ids), w[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.quant_interleaved_rows(p, int(qtype), torch.tensor([24]))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.quant_interleave_rows(w[:20].clone(), int(qtype))


@pytest.mark.parametrize("fine_scales", [False, True], ids=["per32", "per16"])
@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: t.name)
def test_interleaved_rows_do_not_depend_on_the_call(kernels, qtype, fine_scales):
    """As below, for the interleaved kernel (micro-kernels of 1-4 rows, or 5 / 6 at once; on
    AVX512-VNNI two groups per 512-bit register, the fifth group of these 40 rows alone; groups
    split over threads; from 12 rows on AVX512-VNNI, panels of 16 rows with the groups decoded
    once, and a last panel filled with zeros)."""
    if fine_scales and qtype not in FINE_SCALES:
        pytest.skip("no fine input scales for this format")
    w, _ = make_weight(qtype, 40, 256, seed=3)
    p, code = (fine if fine_scales else interleaved)(kernels, w, qtype)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(4))
    full = kernels.quant_gemm(x, p, code)
    counts = ((0, 1), (5, 1), (299, 1), (3, 2), (10, 3), (40, 5), (60, 6), (20, 7), (37, 11), (37, 12), (50, 16))
    for start, count in (*counts, (100, 64)):
        part = kernels.quant_gemm(x[start : start + count], p, code)
        assert torch.equal(part, full[start : start + count]), (start, count)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_quant_gemm_rows_do_not_depend_on_the_call(kernels, qtype):
    """Each output row is bit-identical whether its activation row comes alone, in a group of 7 or
    in 300 (the kernel switches between unpacking in registers and decoded tiles, and between
    micro-kernels of 1-4 rows): a greedy token must not depend on its batch."""
    w, _ = make_weight(qtype, 37, 256, seed=3)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(4))
    full = kernels.quant_gemm(x, w, int(qtype))
    for start, count in ((0, 1), (5, 1), (299, 1), (3, 2), (10, 3), (20, 7), (100, 64)):
        part = kernels.quant_gemm(x[start : start + count], w, int(qtype))
        assert torch.equal(part, full[start : start + count]), (start, count)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_quant_dequantize_is_gguf_dequantize(kernels, qtype):
    w, wf = make_weight(qtype, 33, 256)
    torch.testing.assert_close(kernels.quant_dequantize(w, int(qtype), 256), wf, rtol=0, atol=0)


def test_zero_rows_and_zero_activations(kernels):
    w, _ = make_weight(T.Q4_1, 16, 64)
    assert kernels.quant_gemm(torch.zeros(0, 64), w, int(T.Q4_1)).shape == (0, 16)
    # an all-zero block has amax 0: its scale must be 0, not a division by zero
    assert torch.equal(kernels.quant_gemm(torch.zeros(3, 64), w, int(T.Q4_1)), torch.zeros(3, 16))


@pytest.mark.parametrize("qtype", (T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K), ids=lambda t: t.name)
def test_quantized_linear_kernel_and_reference_paths(kernels, qtype):
    # seeded: over 300 draws of x the worst output's error reached 0.0091-0.0100 of the largest
    # output (median 0.0054, Q4_K / Q6_K / Q4_0 / Q5_1), against the 1e-2 below; unseeded, the
    # draw depended on the tests before it, and one full run went over
    torch.manual_seed(int(qtype))
    w, wf = make_weight(qtype, 48, 256)
    bias = torch.randn(48)
    x = torch.randn(2, 5, 256)
    ref = QuantizedLinear(w, int(qtype), 256, bias)  # no kernels: dequantize + F.linear
    fast = QuantizedLinear(w.clone(), int(qtype), 256, bias, kernels)  # the layer owns its rows
    assert ref.kernels is None and fast.kernels is not None
    assert fast.interleaved == (qtype in INTERLEAVED) and not ref.interleaved
    assert torch.equal(fast.qweight, w) != fast.interleaved  # repacked (Q4_x / Q5_x / Q8_0: in place)
    torch.testing.assert_close(fast.dequantized_weight(), wf, rtol=0, atol=0)
    torch.testing.assert_close(ref(x), torch.nn.functional.linear(x, wf, bias), rtol=1e-5, atol=1e-5)
    # the kernels' activation rounding (see the bound tests above): int16 ~1e-5 of the output
    # scale; int8 (interleaved Q4_x / Q5_x / K-quants) 256x coarser, amax / 254 per element, ~1e-3
    # of it on random data
    tol = 1e-2 if fast.interleaved and qtype != T.Q8_0 else 2e-4
    torch.testing.assert_close(fast(x), ref(x), rtol=0, atol=tol * ref(x).abs().max().item())
    emb_ref = QuantizedEmbedding(w, int(qtype), 256)
    emb = QuantizedEmbedding(w, int(qtype), 256, kernels)
    tied = QuantizedEmbedding(fast.qweight, int(qtype), 256, kernels, fast.interleaved)  # a tied head's rows
    ids = torch.tensor([[3, 0], [47, 3]])
    torch.testing.assert_close(emb(ids), wf[ids], rtol=0, atol=0)
    torch.testing.assert_close(emb_ref(ids), wf[ids], rtol=0, atol=0)
    torch.testing.assert_close(tied(ids), wf[ids], rtol=0, atol=0)


# ---- whole models ---------------------------------------------------------------------------------

# Mixed formats as llama.cpp writes them (q/k/v differ: the fused qkv runs as parts), untied head.
LEGACY_FORMATS = {
    "attn_q": T.Q4_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q4_0,
    "token_embd": T.Q8_0,
    "output": T.Q4_1,
}
# The llama file ("legacy") holds every 32-value format with a kernel: o_proj in Q5_1, down_proj
# in Q5_0. The other families keep LEGACY_FORMATS: their logit tolerances below were set on those,
# and the error of gemma3's random model moves by a few percent of the logit scale with any change
# of formats (down_proj in Q8_0, int16 activations, takes it from 3.9% to 5.0%).
LLAMA_FORMATS = LEGACY_FORMATS | {"attn_output": T.Q5_1, "ffn_down": T.Q5_0}
# K-quants (tied embeddings: the head reads the embedding's Q6_K blocks).
K_FORMATS = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q5_K,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q4_K,
    "ffn_down": T.Q6_K,
    "token_embd": T.Q6_K,
}


# Files of the llama architecture, and of the other GGUF families (models/gguf_arch.py) in the
# legacy formats: qwen2 (q/k/v biases, tied head), qwen3 (per-head q/k norms, untied head); their
# q/k rows are in HF's order (no un-permutation); gemma3 (norms stored + 1, sliding layers, GeGLU,
# tied head), whose layers run in PyTorch around the quantized GEMMs (no fused layer kernels).
FILES = ("legacy", "kquant", "qwen2", "qwen3", "gemma3")
FUSED_LAYERS = ("legacy", "kquant", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def gguf_files(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    kq = tiny_kquant_hf(str(root / "kquant_hf"))
    files = {"legacy": (tiny_model_dirs["llama"], LLAMA_FORMATS), "kquant": (kq, K_FORMATS)}
    files |= {fam: (tiny_model_dirs[fam], LEGACY_FORMATS) for fam in FILES[2:4]}
    files["gemma3"] = (tiny_gemma3_llama_cpp_hf(str(root / "gemma3_hf")), LEGACY_FORMATS)
    with gguf_files_with_cache(root, files) as paths:
        yield paths


@pytest.mark.parametrize("which", FILES)
def test_native_reference_matches_dequantize_at_load(gguf_files, which):
    """The native model on the reference path (no kernels) computes what the dequantized float32
    model computes: same float weights, only a different matmul order -> fp32 rounding, 1e-4.
    (A float32 KV cache for both: the native default, float16, is another rounding.)"""
    path = gguf_files[which]
    native = LLM(
        model=path,
        dtype="float32",
        num_kv_blocks=32,
        attention_backend="torch",
        quantization="gguf",
        kv_cache_dtype="float32",
    )
    dequant = LLM(model=path, dtype="float32", num_kv_blocks=32, attention_backend="torch", quantization=None)
    m_native, m_dequant = native.llm_engine.model, dequant.llm_engine.model
    assert isinstance(m_native.layers[0].mlp.down_proj.local, QuantizedLinear)
    assert isinstance(m_dequant.layers[0].mlp.down_proj.local, torch.nn.Linear)
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.numel() > 4096 for m in m_native.modules())
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 7, 42])
    h_native = _hidden(native, ids)
    h_dequant = _hidden(dequant, ids)
    torch.testing.assert_close(h_native, h_dequant, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        m_native.compute_logits(h_native), m_dequant.compute_logits(h_dequant), rtol=1e-4, atol=1e-4
    )
    assert m_native.num_params == m_dequant.num_params


def _hidden(llm: LLM, ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states of one prompt, through the engine's own runner (one prefill step)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    captured = []
    model = llm.llm_engine.model
    handle = model.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    try:
        llm.generate([{"prompt_token_ids": ids.tolist()}], params, use_tqdm=False)
    finally:
        handle.remove()
    return captured[0]


# Max logit error allowed, as a fraction of the logit scale. Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q6_K
# layers (the legacy files', and the K-quant file's Q4_K and Q6_K ones) run int8 activations
# (llama.cpp's scheme: amax / 254 per element, ~0.4% of a typical element) through two layers and
# the head of this random model: a few percent. Q8_0 layers run int16 ones (~1e-5 relative rounding).
KERNEL_LOGIT_TOLERANCE = {"legacy": 5e-2, "kquant": 5e-2, "qwen2": 5e-2, "qwen3": 5e-2, "gemma3": 5e-2}


@pytest.mark.parametrize("which", sorted(KERNEL_LOGIT_TOLERANCE))
def test_kernel_path_close_to_reference(gguf_files, kernels, which):
    path = gguf_files[which]
    fast = LLM(model=path, dtype="float32", num_kv_blocks=32, quantization="gguf")
    ref = LLM(model=path, dtype="float32", num_kv_blocks=32, attention_backend="torch", quantization="gguf")
    assert fast.llm_engine.model.layers[0].mlp.down_proj.local.kernels is not None
    assert (fast.llm_engine.model.kernels is not None) == (which in FUSED_LAYERS)  # fused layer ops
    assert ref.llm_engine.model.kernels is None
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 7, 42])
    lf = fast.llm_engine.model.compute_logits(_hidden(fast, ids))
    lr = ref.llm_engine.model.compute_logits(_hidden(ref, ids))
    assert (lf - lr).abs().max() <= KERNEL_LOGIT_TOLERANCE[which] * lr.abs().max()


@pytest.mark.parametrize("which", FUSED_LAYERS)
@pytest.mark.parametrize("quantization", ["gguf", None])
def test_gguf_models_take_the_fused_path(gguf_files, kernels, which, quantization):
    """Native (QuantizedLinear layers and a QuantizedEmbedding without a float weight) and
    dequantized float32 models both run the fused layer kernels between their GEMMs."""
    llm = LLM(model=gguf_files[which], dtype="float32", num_kv_blocks=32, quantization=quantization)
    model = llm.llm_engine.model
    assert isinstance(model.embed_tokens.local, QuantizedEmbedding) == (quantization == "gguf")
    assert model.activation_dtype() == torch.float32 and model.kernels is not None


@pytest.mark.parametrize("which", ["legacy", "kquant"])
def test_native_load_interleaves_the_formats_with_that_kernel(gguf_files, kernels, which):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K layers (rows a multiple of 8) are repacked
    for the interleaved kernels at load: every layer of both files (the K-quant file's o_proj in Q5_K)."""
    model = LLM(model=gguf_files[which], dtype="float32", num_kv_blocks=32, quantization="gguf").llm_engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    expected = [m.qtype in {int(t) for t in INTERLEAVED} and m.out_features % 8 == 0 for m in layers]
    assert [m.interleaved for m in layers] == expected
    assert any(expected)
    assert all(m.interleaved for m in layers)
    assert (which == "kquant") == any(m.qtype == int(T.Q5_K) for m in layers)
    # fine input scales: the MLP's down projection only, where its format has them
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    nibbles = {int(t) for t in FINE_SCALES}
    assert [m.fine_input_scales for _, m in named] == [
        "mlp.down_proj" in n and m.qtype in nibbles and m.interleaved for n, m in named
    ]
    assert any(m.fine_input_scales for _, m in named) == (which == "legacy")


def test_gguf_blocks_get_a_float16_kv_cache_by_default(gguf_files, kernels):
    """kv_cache_dtype "auto": float16 where the weights run in their blocks (activations are rounded
    to int8 / int16 at every GEMM anyway), float32 where the file is dequantized to float."""
    native = LLM(model=gguf_files["legacy"], dtype="float32", num_kv_blocks=16, quantization="gguf")
    assert native.llm_engine.kv_dtype == torch.float16
    assert native.llm_engine.runner.kv_caches[0][0].dtype == torch.float16
    dequantized = LLM(model=gguf_files["legacy"], dtype="float32", num_kv_blocks=16, quantization=None)
    assert dequantized.llm_engine.kv_dtype == torch.float32
    named = LLM(model=gguf_files["legacy"], dtype="float32", num_kv_blocks=16, kv_cache_dtype="float32")
    assert named.llm_engine.kv_dtype == torch.float32


def test_quantization_flag_validation(tiny_llama):
    from pagedllm.config import EngineConfig

    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        LLM(model=tiny_llama, quantization="gguf")


# ---- greedy invariance of a natively quantized model ---------------------------------------------

NEW_TOKENS = 16


def _workload() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 512, size=int(rng.integers(1, 70))).tolist() for _ in range(8)]


def _greedy(path: str, **kwargs) -> tuple[list[list[int]], LLM]:
    args = dict(dtype="float32", num_kv_blocks=256, block_size=16, quantization="gguf")
    args.update(kwargs)
    llm = LLM(model=path, **args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _workload()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# qwen3: its per-head q/k norms run between the quantized projection and RoPE; gemma3: sliding
# layers whose window the longer prompts outgrow
@pytest.fixture(scope="module", params=["legacy", "kquant", "qwen3", "gemma3"])
def greedy_baseline(request, gguf_files, kernels):
    path = gguf_files[request.param]
    toks, llm = _greedy(path, max_num_seqs=1)  # one request at a time, whole prompts: the simplest schedule
    assert llm.llm_engine.model.layers[0].mlp.down_proj.local.kernels is not None  # the integer kernel path
    return path, toks


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_seqs=256),  # every request in one batch
        dict(block_size=1, num_kv_blocks=4096),
        dict(block_size=128, num_kv_blocks=48),
        dict(max_num_batched_tokens=7),  # chunked prefill mixed with decodes
        dict(block_size=8, num_kv_blocks=12),  # preemption (asserted below)
    ],
    ids=["batch", "block1", "block128", "chunked", "preempt"],
)
def test_greedy_invariant_to_schedule(greedy_baseline, kwargs):
    """Each activation row is quantized on its own and each output is a per-row dot product, so a
    row's result cannot depend on what else is in the batch: greedy tokens must match exactly."""
    path, expected = greedy_baseline
    toks, llm = _greedy(path, **kwargs)
    assert toks == expected
    if kwargs.get("num_kv_blocks") == 12:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_cache_folder_has_no_float_weights(gguf_files):
    from pagedllm.models.resolve import resolve_model_path

    folder = resolve_model_path(gguf_files["legacy"], weights=False)
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))


# ---- the whole-step decode loop (kernels/decoder_loop.cpp) ----------------------------------------


def step_outputs(llm: LLM, prompts: list[list[int]], use_plan: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every step's final hidden states, with the model's decoder plan on or off."""
    model = llm.llm_engine.model
    plan = model._decoder_plan
    assert plan is not None
    calls = []

    class CountedPlan:
        def decode(self, *args):
            calls.append(1)
            return plan.decode(*args)

    captured: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    model._decoder_plan = CountedPlan() if use_plan else None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        handle.remove()
        model._decoder_plan = plan
    assert (len(calls) >= NEW_TOKENS - 1) == use_plan  # every step after the last prefill
    return [o.outputs[0].token_ids for o in outs], captured


def assert_plan_is_the_fused_loop(llm: LLM) -> None:
    """Decode-only steps through the C++ plan are bit-identical to the fused Python loop: same
    kernels on the same tensors in the same order (mixed steps always take the loop). The model
    runs without prefix caching: both runs must schedule the same steps."""
    toks_plan, hidden_plan = step_outputs(llm, _workload(), use_plan=True)
    toks_loop, hidden_loop = step_outputs(llm, _workload(), use_plan=False)
    assert toks_plan == toks_loop
    assert len(hidden_plan) == len(hidden_loop)
    for a, b in zip(hidden_plan, hidden_loop, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["legacy", "kquant", "qwen2"])  # qwen3 (q/k norms) has no plan
def test_decoder_plan_equals_the_fused_loop_gguf(gguf_files, kernels, which):
    # kquant mixes formats inside the fused qkv projection (a ConcatLinear: Q4_K q and k, Q6_K v), as do
    # the legacy files
    llm = LLM(
        model=gguf_files[which], dtype="float32", num_kv_blocks=256, quantization="gguf", enable_prefix_caching=False
    )
    assert_plan_is_the_fused_loop(llm)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])  # qwen2: q/k/v biases
def test_decoder_plan_equals_the_fused_loop_float32(tiny_model_dirs, kernels, family):
    llm = LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert_plan_is_the_fused_loop(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_decoder_plan_equals_the_fused_loop_over_an_8_bit_cache(gguf_files, kernels, kv_cache_dtype):
    """The plan writes and reads the int8 cache with its scales (and fp8 without) as the loop does."""
    llm = LLM(
        model=gguf_files["legacy"],
        dtype="float32",
        num_kv_blocks=256,
        quantization="gguf",
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert_plan_is_the_fused_loop(llm)


def test_no_decoder_plan_where_a_layer_has_no_kernel(gguf_files, kernels):
    """The reference path (no kernels) builds no plan: every step runs the module graph."""
    llm = LLM(model=gguf_files["legacy"], dtype="float32", num_kv_blocks=32, attention_backend="torch")
    assert llm.llm_engine.model._decoder_plan is None
