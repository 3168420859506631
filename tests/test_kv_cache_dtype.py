"""kv_cache_dtype: bf16 / fp16 / fp8 / int8 KV caches under float32 activations.

Within one KV dtype, greedy output must not depend on the schedule (batch, block size, chunking,
preemption by recompute or swap, prefix caching) nor on tensor parallelism; the cache holds two
(16-bit) or four (8-bit) times the tokens of a float32 one in the same memory; the compiled kernels
and the reference path agree. The kernels themselves are checked against the reference in
test_attention.py and test_cpu_kernels.py.

The 8-bit caches run the tiny models as Q8_0 GGUF files: their integer kernels give each row the
same bits in any batch. A float checkpoint's float32 GEMMs (torch's) do not: their rows move by
~1e-5 with the batch's shape, which a 16-bit cache's rounding absorbs but an 8-bit cache's coarser
steps can turn into a flipped near-tie (measured: the tiny Gemma 3, chunked, last token).
"""

from __future__ import annotations

import pytest
import torch
from gguf_models import gguf_files_with_cache, tiny_gemma3_llama_cpp_hf
from test_invariance import run, workload
from test_tensor_parallel import _outputs, _shutdown, _stress_prompts

from pagedllm import LLM
from pagedllm.attention.int8_kv import cache_scales, scale_bytes_per_row
from pagedllm.config import EngineConfig
from pagedllm.kernels import load_cpu_kernels

KV_DTYPES = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"]
EIGHT_BIT = ("fp8_e4m3", "fp8_e5m2", "int8")
TORCH_KV = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FAMILIES = ["llama", "gpt2", "gemma3"]


@pytest.fixture(scope="module")
def q8_0_files(tiny_model_dirs, tmp_path_factory):
    """The tiny models as all-Q8_0 GGUF files (Gemma 3 in the layout llama.cpp can express)."""
    root = tmp_path_factory.mktemp("kv_dtype_gguf")
    hf = {fam: tiny_model_dirs[fam] for fam in FAMILIES}
    hf["gemma3"] = tiny_gemma3_llama_cpp_hf(str(root / "gemma3_hf"))
    with gguf_files_with_cache(root, {fam: (hf[fam], {}) for fam in FAMILIES}) as paths:
        yield paths


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=KV_DTYPES)
def kv_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, kv_dtype, tiny_model_dirs, q8_0_files) -> str:
    return q8_0_files[family] if kv_dtype in EIGHT_BIT else tiny_model_dirs[family]


@pytest.fixture(scope="module")
def baseline(model_dir, kv_dtype):
    prompts = workload()
    toks, llm = run(model_dir, prompts, max_num_seqs=1, kv_cache_dtype=kv_dtype)
    k_cache = llm.llm_engine.runner.kv_caches[0][0]
    assert k_cache.dtype == TORCH_KV[kv_dtype] and llm.llm_engine.dtype == torch.float32
    assert (cache_scales(k_cache) is not None) == (kv_dtype == "int8")
    return prompts, toks


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=1, num_kv_blocks=4104),
        dict(block_size=128, num_kv_blocks=40),
        dict(max_num_seqs=256),
        dict(max_num_batched_tokens=7),
        dict(block_size=8, num_kv_blocks=15),
        dict(block_size=8, num_kv_blocks=15, preemption_mode="swap", num_swap_blocks=64),
    ],
    ids=["block1", "block128", "batch", "chunked", "preempt", "swap"],
)
def test_greedy_invariant_to_schedule(model_dir, kv_dtype, baseline, kwargs):
    prompts, expected = baseline
    toks, llm = run(model_dir, prompts, kv_cache_dtype=kv_dtype, **kwargs)
    assert toks == expected
    engine = llm.llm_engine
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks
    if "preemption_mode" in kwargs:
        assert engine.scheduler.num_swap_preemptions > 0
    elif kwargs.get("num_kv_blocks") == 15:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_caching(model_dir, kv_dtype):
    shared = [7, 8, 9] * 12
    prompts = [shared + p for p in workload()]
    ref, _ = run(model_dir, prompts, max_num_seqs=1, enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    toks, llm = run(model_dir, prompts, enable_prefix_caching=True, num_kv_blocks=40, kv_cache_dtype=kv_dtype)
    assert toks == ref
    assert llm.llm_engine.kv_manager.prefix_cache_stats()[1] > 0


def test_kernels_and_reference_path_agree(tiny_model_dirs, kv_dtype):
    """On the float checkpoint for every dtype: attention_backend "torch" turns off every compiled
    kernel, so a GGUF file would run float activations there (not the same model numerically)."""
    if load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    prompts = workload(6)
    fast, llm = run(tiny_model_dirs["llama"], prompts, kv_cache_dtype=kv_dtype)
    assert llm.llm_engine.runner.decode_kernel is not None  # the kernel path really ran
    ref, _ = run(tiny_model_dirs["llama"], prompts, kv_cache_dtype=kv_dtype, attention_backend="torch")
    assert fast == ref


def test_two_and_four_times_the_tokens_of_a_float32_cache(tiny_llama):
    """The same memory holds twice the blocks in 16 bits, four times in 8 ("fp8" is e4m3); int8
    pays for its scales, 4 bytes per token, head and scale group beside head_dim bytes."""
    blocks = {}
    for kv in ("auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "int8"):
        llm = LLM(model=tiny_llama, dtype="float32", kv_cache_memory_gib=0.01, kv_cache_dtype=kv)
        blocks[kv] = llm.llm_engine.num_kv_blocks
        assert llm.llm_engine.kv_dtype == (torch.float32 if kv == "auto" else TORCH_KV.get(kv, torch.float8_e4m3fn))
    assert blocks["bfloat16"] == blocks["float16"] and blocks["fp8"] == blocks["fp8_e5m2"]
    assert abs(blocks["bfloat16"] - 2 * blocks["auto"]) <= 1
    assert abs(blocks["fp8"] - 4 * blocks["auto"]) <= 3
    d = llm.llm_engine.model.head_dim
    per_row = d + scale_bytes_per_row(torch.int8, d)
    assert abs(blocks["int8"] - blocks["fp8"] * d / per_row) <= 1 and blocks["int8"] < blocks["fp8"]


def test_a_cache_wider_or_other_than_bf16_activations_is_refused(tiny_llama):
    for narrower in ("float16", "int8"):  # int8 as fp8: under float32 activations only
        with pytest.raises(ValueError, match="needs dtype='float32'"):
            LLM(model=tiny_llama, dtype="bfloat16", kv_cache_dtype=narrower, num_kv_blocks=16)
    llm = LLM(model=tiny_llama, dtype="bfloat16", kv_cache_dtype="bfloat16", num_kv_blocks=16)
    assert llm.llm_engine.kv_dtype == torch.bfloat16  # the activation dtype itself: as "auto"
    assert EngineConfig(kv_cache_dtype="BF16").kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("tp_kv_dtype", ["bfloat16", "fp8_e4m3", "int8"])
def test_tp2_matches_tp1_with_a_narrow_cache(tiny_model_dirs, q8_0_files, tp_kv_dtype):
    """Each rank's cache holds its KV heads in 16 or 8 bits; swapped out and back under pressure."""
    prompts = _stress_prompts()
    kwargs = dict(
        model=q8_0_files["llama"] if tp_kv_dtype in EIGHT_BIT else tiny_model_dirs["llama"],
        dtype="float32",
        kv_cache_dtype=tp_kv_dtype,
        num_kv_blocks=24,
        block_size=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        preemption_mode="swap",
        num_threads=1,
    )
    tp1 = _outputs(LLM(**kwargs), prompts)
    llm = LLM(tensor_parallel_size=2, **kwargs)
    try:
        tp2 = _outputs(llm, prompts)
        swaps = llm.llm_engine.scheduler.num_swap_preemptions
    finally:
        _shutdown(llm)
    # Greedy tokens equal; logprobs within 1e-3, not TP's float32 1e-4: the ranks' row-parallel
    # sums differ from TP=1's in the last float bits, and a K/V value that lands near a bf16
    # rounding midpoint then rounds one bf16 step (2^-8 of it) the other way (measured: 1.5e-4).
    # An e4m3 step is 2^-4 of a value, so such a flip moves more (measured on the Q8_0 file: 5.5e-4).
    bound = 5e-3 if tp_kv_dtype in EIGHT_BIT else 1e-3
    for (toks, lps), (ref_toks, ref_lps) in zip(tp2, tp1, strict=True):
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < bound
    assert swaps > 0
