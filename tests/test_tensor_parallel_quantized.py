"""tensor_parallel_size=2 with quantization="gguf": every rank holds its shard of the file's
quantized blocks (pagedllm/layers/checkpoint.py): whole rows of q/k/v, gate/up and the vocabulary,
whole blocks of o_proj's and down_proj's input columns, the bytes of the file, never requantized.
Greedy tokens equal tensor_parallel_size=1's for Q8_0 (llama: KV heads split), Q4_0 (qwen2: one
KV head replicated on both ranks, q/k/v biases, tied head) and K-quants (256-value blocks), on
the integer kernels and on the reference path; a shape that does not split in whole blocks is
refused by name."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf_models import T, gguf_files_with_cache, tiny_kquant_hf
from test_fidelity import make_prompts
from test_tensor_parallel import _outputs, _shutdown

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.engine.builder import native_gguf_path
from pagedllm.layers import RowParallelLinear
from pagedllm.layers.checkpoint import column_split_refusal as block_split_refusal
from pagedllm.models.quantized_linear import QuantizedLinear

_Q4_0 = {k: T.Q4_0 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
# K-quants wherever the tiny K-quant llama (hidden 256, intermediate 512) splits in whole 256-value
# blocks over two ranks: down_proj's 512 input columns do (256 per rank), o_proj's 256 do not
# (128 per rank), so attn_output is Q8_0 here, as llama.cpp mixes formats in one file.
_K_SPLITTABLE = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q8_0,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q5_K,
    "ffn_down": T.Q6_K,
    "token_embd": T.Q6_K,
}

# Max |logprob(TP=2) - logprob(TP=1)| of the chosen tokens. Each rank's partial dot products are
# exactly the full one's blocks (shards are whole weight blocks, and the kernels quantize the
# activations in blocks of 32 from the same values), so what differs is the order of fp32
# additions (the all-reduce sums two partial sums): ~1e-6 relative per GEMM. The next layer then
# requantizes its activations, and a value that sits at a rounding midpoint may round the other
# way: one quantization step of that one value, amax / 127 for the int8 activations of the Q4_x
# kernel (1/254 of the block's largest value, relative), amax / 32767 for the int16 ones (Q8_0).
# Over 8 prompts x 32 greedy tokens a few such flips happen; their effect on a logprob stays below
# the kernel's own quantization error, and far below what would flip a greedy token. Measured on
# these files (max over the prompts): TP=2 vs TP=1 on the kernels 2e-4 (Q8_0), 1e-2 (Q4_0; 3.2e-2
# once down_proj's input took a scale per 16: twice the blocks, twice the midpoints), 2e-2 to
# 6.5e-2 over runs of the same build (K-quants: its Q4_K, Q5_K, Q6_K layers run int8 activations like
# Q4_0's, and which values sit at a rounding midpoint shifts with the additions' order; 7e-4 when
# they ran int16 ones). The TP=1 kernel path differs from its own reference path by 4e-4 (Q8_0)
# and ~1e-1 (int8 activations, its greedy tokens part): the bounds below are 3-10x the TP
# measurements, and no wider than that distance for int8 activations. The reference path (no
# activation quantization) differs by fp32 order only: 2e-6 to 2e-5 measured.
LOGPROB_TOLERANCE = {"llama_q8_0": 2e-3, "qwen2_q4_0": 1e-1, "kquant": 1e-1}
REFERENCE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tp_gguf_files(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf_tp")
    kq = tiny_kquant_hf(str(root / "kquant_hf"))
    files = {
        "llama_q8_0": (tiny_model_dirs["llama"], {}),
        "qwen2_q4_0": (tiny_model_dirs["qwen2"], _Q4_0),
        "kquant": (kq, _K_SPLITTABLE),
        "kquant_o_proj_q5_k": (kq, {**_K_SPLITTABLE, "attn_output": T.Q5_K}),
    }
    with gguf_files_with_cache(root, files) as paths:
        yield paths


def _kernels_built() -> bool:
    import pagedllm.kernels

    return pagedllm.kernels.load_cpu_kernels() is not None


def _column_bytes(layer: QuantizedLinear, cols: slice) -> torch.Tensor:
    """The bytes of ``layer``'s file rows that hold input columns ``cols`` (whole blocks)."""
    block, nbytes = GGML_QUANT_SIZES[T(layer.qtype)]
    return layer.gguf_rows()[:, cols.start // block * nbytes : cols.stop // block * nbytes]


def _assert_rank0_holds_the_file_blocks(tp1_model, tp2_model) -> None:
    """The driver (rank 0) holds the first half of down_proj's columns and of the vocabulary rows,
    byte for byte the TP=1 layer's (which holds the file's blocks)."""
    full, part = tp1_model.layers[0].mlp.down_proj.local, tp2_model.layers[0].mlp.down_proj
    assert isinstance(part, RowParallelLinear) and isinstance(part.local, QuantizedLinear)
    assert part.local.in_features * 2 == full.in_features
    assert torch.equal(part.local.gguf_rows(), _column_bytes(full, slice(0, part.local.in_features)))
    head, full_head = tp2_model.lm_head.local, tp1_model.lm_head.local
    assert isinstance(head, QuantizedLinear) and head.out_features * 2 == full_head.out_features
    assert torch.equal(head.gguf_rows(), full_head.gguf_rows()[: head.out_features])


@pytest.mark.parametrize(
    ("which", "backend"),
    [("llama_q8_0", "auto"), ("qwen2_q4_0", "auto"), ("kquant", "auto"), ("qwen2_q4_0", "torch")],
)
def test_tp2_gguf_blocks_match_tp1(tp_gguf_files, which, backend):
    if backend == "auto" and not _kernels_built():
        pytest.skip("CPU kernels not built here")
    kwargs = dict(
        model=tp_gguf_files[which],
        dtype="float32",
        num_kv_blocks=64,
        quantization="gguf",
        attention_backend=backend,
        num_threads=1,
        # float32 KV: at 1e-4 in logprob, as TP's float sums alone; a float16 cache (the default)
        # rounds a K/V value near a midpoint either way (TP=2 == TP=1 per KV dtype:
        # tests/test_kv_cache_dtype.py, at 1e-3)
        kv_cache_dtype="float32",
    )
    prompts = make_prompts()
    tp1_llm = LLM(**kwargs)
    tp1 = _outputs(tp1_llm, prompts)
    llm = LLM(tensor_parallel_size=2, **kwargs)
    try:
        _assert_rank0_holds_the_file_blocks(tp1_llm.llm_engine.model, llm.llm_engine.model)
        tp2 = _outputs(llm, prompts)
    finally:
        _shutdown(llm)
    tolerance = LOGPROB_TOLERANCE[which] if backend == "auto" else REFERENCE_TOLERANCE
    for (toks, lps), (ref_toks, ref_lps) in zip(tp2, tp1, strict=True):
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < tolerance
    assert len({t for toks, _ in tp1 for t in toks}) > 20  # not a degenerate model


def test_blocks_that_do_not_split_are_refused_by_name(tp_gguf_files):
    """o_proj in Q5_K: 256 input columns are 128 per rank, half a K-quant block."""
    path = tp_gguf_files["kquant_o_proj_q5_k"]
    needle = r"blk\.0\.attn_output\.weight \(Q5_K, block size 256\): its 256 input columns do not split over 2 ranks"
    with pytest.raises(ValueError, match=needle):
        LLM(model=path, dtype="float32", num_kv_blocks=8, quantization="gguf", tensor_parallel_size=2, num_threads=1)
    # "auto" dequantizes such a file at load (float weights split anywhere); a file that splits
    # keeps its blocks
    assert native_gguf_path(EngineConfig(model=path, tensor_parallel_size=2)) is None
    if _kernels_built():
        splittable = tp_gguf_files["kquant"]
        assert native_gguf_path(EngineConfig(model=splittable, tensor_parallel_size=2)) == splittable


def test_block_split_refusal_names_the_tensor_type_block_and_ranks():
    assert block_split_refusal("blk.0.ffn_down.weight", int(T.Q4_0), 128, 2) is None
    assert block_split_refusal("blk.0.ffn_down.weight", int(T.Q6_K), 512, 2) is None
    assert block_split_refusal("blk.0.attn_output.weight", int(T.F16), 100, 4) is None  # float: block of 1
    refusal = block_split_refusal("blk.0.attn_output.weight", int(T.Q8_0), 64, 4)
    assert refusal == (
        "GGUF tensor blk.0.attn_output.weight (Q8_0, block size 32): its 64 input columns "
        "do not split over 4 ranks in whole 32-value blocks (16 per rank)"
    )
    assert "(Q4_K, block size 256)" in block_split_refusal("t", int(T.Q4_K), 768, 2)  # 384 per rank
