"""GGUF files of each supported family (models/gguf_arch.py), written from the tiny HF checkpoints
as llama.cpp's converter writes them: float32 files run exactly the HF model (dequantized at load
and natively), their tokenizers come from the metadata, and other architectures are refused.
(The quantized files of these families are held to the dequantized reference in test_quantized.)
Under tensor_parallel_size=2 both the float32 files and Q8_0 ones give TP=1's tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_models import tiny_gemma3_llama_cpp_hf, write_gguf
from test_tensor_parallel import _shutdown

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf_arch import GGUF_ARCHITECTURES
from pagedllm.models.gguf_weights import gguf_weights
from pagedllm.models.loader import load_hf_config
from pagedllm.models.registry import get_model_class, supported_architectures
from pagedllm.models.resolve import resolve_model_path
from pagedllm.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = GGMLQuantizationType
# llama: permuted q/k rows; qwen2: q/k/v biases; qwen3: q/k norms; phi3: fused q/k/v and
# gate/up, LongRoPE factors as tensors; phi3_partial: RoPE on 3/4 of each head (its q/k rows reordered)
# gpt2: LayerNorm decoder, learned positions, Conv1D weights; gemma3: norms stored + 1, five
# sliding layers (window 24, narrower than the long prompt) and a global one, GQA
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "phi3_partial", "gpt2", "gemma3")
OWN_CONFIG_KEYS = {"gpt2"}  # not Llama-like: its config has its own keys, none of RoPE's
MATRICES = (
    *("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
    *("token_embd", "position_embd", "output"),
)
NEW_TOKENS = 12
# The last is past the tiny Phi-3's LongRoPE original context (64): it runs on the long factors,
# the others on the short ones. (None crosses it while generating: there transformers' generate
# recomputes the cache, see test_family_phi3. None reaches EOS greedily: min_new_tokens masks it.)
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 7, 42],
    [1, 2, 3],
    [300, 200, 100, 50, 25, 12, 6],
    [(11 * i + 5) % 500 for i in range(70)],
]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  spaces\tand\nnewlines ",
    "def hello(world):\n    return world * 2\n",
    "e\u0301 caf\u00e9 12345",  # Qwen's tokenizer normalizes to NFC and splits digits one by one
    "<|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>",
]
# A turn's markers: special tokens of the family's vocabulary, kept whole
TURN_MARKERS = {"gemma3": ("<start_of_turn>", "<end_of_turn>")}


@pytest.fixture(scope="module")
def hf_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """The HF folder of each family; Gemma 3's as llama.cpp can express it (gguf_models)."""
    gemma3 = tiny_gemma3_llama_cpp_hf(str(tmp_path_factory.mktemp("gemma3_llama_cpp")))
    return {**tiny_model_dirs, "gemma3": gemma3}


@pytest.fixture(scope="module")
def f32_files(hf_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf_families")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root / "cache"))
        yield {
            fam: write_gguf(hf_dirs[fam], str(root / f"{fam}.gguf"), dict.fromkeys(MATRICES, T.F32)) for fam in FAMILIES
        }


@pytest.fixture(scope="module")
def hf_greedy(hf_dirs) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of each prompt, from the HF folder. The mask is given: left
    to itself generate masks every pad token of a prompt as padding (the long prompt holds a 0,
    Gemma's pad id)."""
    out = {}
    for fam in FAMILIES:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[fam], dtype=torch.float32).eval()
        with torch.no_grad():
            out[fam] = [
                model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )[0, len(p) :].tolist()
                for p in PROMPTS
            ]
    return out


@pytest.mark.parametrize("quantization", [None, "gguf"], ids=["dequantized", "native"])
@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_greedy_equals_the_hf_folder(f32_files, hf_greedy, hf_dirs, family, quantization):
    """A wrong q/k row order breaks RoPE, a lost bias or q/k norm changes every logit: either flips
    greedy tokens of these random models within a few steps."""
    llm = LLM(model=f32_files[family], dtype="float32", num_kv_blocks=64, quantization=quantization)
    assert type(llm.llm_engine.model) is get_model_class(transformers.AutoConfig.from_pretrained(hf_dirs[family]))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy[family]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_quantized_gpt2_runs_in_its_blocks(hf_dirs, tmp_path, monkeypatch, backend):
    """GPT-2's matrices in Q8_0 stay the file's blocks, already [out, in] (llama.cpp transposed
    the Conv1D weights; only float tensors are transposed back), on the integer kernels ("auto")
    or dequantized per GEMM ("torch"), and pick the greedy tokens of the file dequantized at load.
    (The kernels' int16 rounding of the activations, ~1e-5 relative, flips none of these tokens.)"""
    from pagedllm.kernels import load_cpu_kernels
    from pagedllm.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

    if backend == "auto" and load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf_dirs["gpt2"], str(tmp_path / "gpt2-q8_0.gguf"), dict.fromkeys(MATRICES, T.Q8_0))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for quantization in ("gguf", None):
        llm = LLM(model=path, dtype="float32", num_kv_blocks=64, quantization=quantization, attention_backend=backend)
        model = llm.llm_engine.model
        layer = model.layers[0]
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.fc1, layer.mlp.fc2)
        native = quantization == "gguf"
        assert all(isinstance(p.local, QuantizedLinear) == native for p in projections)
        assert isinstance(model.embed_tokens.local, QuantizedEmbedding) == native
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outs]
    assert tokens["gguf"] == tokens[None]


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_config_is_the_families(f32_files, hf_dirs, family):
    """Every value the config made from the metadata holds is the HF folder's (Gemma 3's layer
    types, attention scale and local RoPE base: derived as llama.cpp assumes them)."""
    folder = resolve_model_path(f32_files[family], weights=False)
    ours, ref = load_hf_config(folder), transformers.AutoConfig.from_pretrained(hf_dirs[family])
    with open(os.path.join(folder, "config.json")) as f:
        written = set(json.load(f))
    # compared below as the model reads them (Qwen2's config has no head_dim, its attention_bias
    # None; Gemma 3's local RoPE base goes into rope_parameters)
    derived = {"rope_scaling", "rope_theta", "head_dim", "attention_bias"}
    derived |= {"rope_local_base_freq"} if family == "gemma3" else set()
    assert written > derived or family in OWN_CONFIG_KEYS  # GPT-2's config has none of them
    for key in sorted(written - derived):
        assert getattr(ours, key) == getattr(ref, key), key

    def head_dim(cfg) -> int:
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    assert head_dim(ours) == head_dim(ref)
    assert getattr(ours, "rope_parameters", None) == getattr(ref, "rope_parameters", None)
    assert bool(getattr(ours, "attention_bias", False)) == bool(getattr(ref, "attention_bias", False))


# The tokenizer class each family's checkpoints name (Qwen3's name Qwen2Tokenizer: NFC, Qwen's split
# regex); the tiny folders name none, so transformers would pick another for the tiny Qwen3.
REFERENCE_TOKENIZER = {
    "llama": "AutoTokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "phi3": "AutoTokenizer",
    "phi3_partial": "AutoTokenizer",
    "gpt2": "AutoTokenizer",
    "gemma3": "AutoTokenizer",
}


# Not Gemma 3's yet: transformers' GGUF code builds a gpt2 vocabulary into its GPT-2 tokenizer
# class, which adds its default <|endoftext|> / <mask> (absent from Gemma's vocabulary) and fails
# encoding some of TEXTS without an unk token; its greedy test runs from prompt ids.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
def test_tokenizer_from_gguf_metadata(f32_files, hf_dirs, family):
    """The tokenizer pagedllm loads for a GGUF, built from its gpt2-style BPE metadata, is the HF
    folder's: vocabulary, special tokens (Gemma's BOS on every text), chat template, and every
    encoding and decoding."""
    folder = resolve_model_path(f32_files[family], weights=False)
    ours = load_tokenizer(folder, load_hf_config(folder))
    ref = getattr(transformers, REFERENCE_TOKENIZER[family]).from_pretrained(hf_dirs[family])
    gguf_dir, _, name = f32_files[family].rpartition("/")
    from_file = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    assert ours.get_vocab() == ref.get_vocab() == from_file.get_vocab()
    assert ours.all_special_ids == ref.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.chat_template == ref.chat_template
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids), text
    start, end = TURN_MARKERS.get(family, ("<|im_start|>", "<|im_end|>"))
    ids = ours.encode(f"{start}user\nhi{end}")  # the special tokens stay whole
    bos = [ref.bos_token_id] if family == "gemma3" else []  # Gemma's tokenizer adds its BOS
    assert ids[: len(bos) + 1] == [*bos, ref.convert_tokens_to_ids(start)] and ids[-1] == ref.convert_tokens_to_ids(end)


def test_every_gguf_architecture_has_a_model_class():
    for name, arch in GGUF_ARCHITECTURES.items():
        assert arch.hf_architecture in supported_architectures(), name


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, str(tmp_path / "mamba.gguf"), {}, architecture="mamba")
    supported = r"supported: gemma3, gpt2, llama, phi3, qwen2, qwen3\)"
    for weights in (True, False):  # dequantized and native: both convert the metadata first
        with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba' \(" + supported):
            resolve_model_path(path, cache_dir=str(tmp_path / "cache"), weights=weights)
    # the native weight stream reads the architecture from the file itself
    cfg = transformers.AutoConfig.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"'mamba' \(" + supported):
        next(gguf_weights(path, cfg))


# ---- tensor_parallel_size=2 on the same files, loaded natively (quantization="gguf": the layers
# take the file's tensors whole and keep their shard, as from any checkpoint). F32 files: greedy
# tokens equal TP=1's and transformers' token for token (the shards of the file's values are the
# HF folder's values). Q8_0 files (every matrix in blocks; row-parallel weights cut in whole
# 32-value blocks): greedy tokens equal TP=1's, logprobs within what the order of the fp32
# additions changes (test_tensor_parallel_quantized.py's tolerance for Q8_0).
Q8_0_LOGPROB_TOLERANCE = 2e-3


def _greedy(llm: LLM, logprobs: int = 0) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if logprobs:  # each step's top logprobs, best first
        return [
            (c.token_ids, [sorted((e.logprob for e in lp.values()), reverse=True) for lp in c.logprobs])
            for c in (o.outputs[0] for o in outs)
        ]
    return [
        (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        for c in (o.outputs[0] for o in outs)
    ]


def _tp1_and_tp2(path: str, logprobs: int = 0) -> tuple[list, list]:
    kwargs = dict(model=path, dtype="float32", num_kv_blocks=64, quantization="gguf", num_threads=1)
    tp1 = _greedy(LLM(**kwargs), logprobs)
    llm = LLM(tensor_parallel_size=2, **kwargs)
    try:
        assert llm.llm_engine.model.tensor_parallel_size == 2
        return tp1, _greedy(llm, logprobs)
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_f32_gguf_equals_tp1_and_transformers(f32_files, hf_greedy, family):
    tp1, tp2 = _tp1_and_tp2(f32_files[family])
    assert [toks for toks, _ in tp2] == [toks for toks, _ in tp1] == hf_greedy[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_q8_0_gguf_blocks_equal_tp1(hf_dirs, tmp_path, family):
    path = write_gguf(hf_dirs[family], str(tmp_path / f"{family}_q8_0.gguf"), {})  # every matrix Q8_0
    tp1, tp2 = _tp1_and_tp2(path, logprobs=2)
    # Row-parallel layers sum each rank's half of K and all-reduce: float sums in another order,
    # so logprobs move by up to ~1e-4 and a step whose top two TP=1 logprobs are closer than that
    # may go either way (the llama file has one: 1.1e-5 apart, flipped where AVX512 rounds).
    # Tokens must agree up to such a near-tie; most steps get compared.
    compared = 0
    for (toks, tops), (ref_toks, ref_tops) in zip(tp2, tp1, strict=True):
        for tok, ref_tok, top, ref_top in zip(toks, ref_toks, tops, ref_tops, strict=True):
            if tok != ref_tok:
                assert ref_top[0] - ref_top[1] < Q8_0_LOGPROB_TOLERANCE, f"diverged without a near-tie: {ref_top}"
                break
            assert abs(top[0] - ref_top[0]) < Q8_0_LOGPROB_TOLERANCE
            compared += 1
    assert compared >= len(PROMPTS) * NEW_TOKENS // 2
