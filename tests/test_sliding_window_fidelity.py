"""A Mistral model with a sliding window narrower than its prompts generates far past the window
exactly as transformers does (fp32 greedy, token for token, logprobs within 1e-4), on the kernel
path and the reference path."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_WINDOW

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 200


def window_prompts(seed: int = 0) -> list[list[int]]:
    """Lengths below, at and well past the window."""
    rng = random.Random(seed)
    lengths = [1, 5, TINY_WINDOW, TINY_WINDOW + 1, 33, 70]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_greedy(tiny_mistral_windowed) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens (generate, through its own cache) and their log-softmax from one
    full forward under its sliding-window mask (eager: the explicit mask)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral_windowed, dtype=torch.float32, attn_implementation="eager")
    assert hf.config.sliding_window == TINY_WINDOW
    hf.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in window_prompts():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0]
            toks = seq[len(p) :].tolist()
            logp = torch.log_softmax(hf(seq.unsqueeze(0)).logits[0].float(), dim=-1)
            out.append((toks, [logp[len(p) - 1 + i, t].item() for i, t in enumerate(toks)]))
    return out


def generate(model_dir: str, **engine_kwargs):
    kwargs = dict(dtype="float32", num_kv_blocks=256, block_size=8)
    kwargs.update(engine_kwargs)
    llm = LLM(model=model_dir, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in window_prompts()], params, use_tqdm=False)
    return outs, llm


def assert_matches(outs, ref) -> None:
    for (ref_toks, ref_lp), out in zip(ref, outs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ref_toks
        ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp, strict=True)) < 1e-4


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_windowed_generation_matches_transformers(tiny_mistral_windowed, hf_greedy, backend):
    outs, llm = generate(tiny_mistral_windowed, attention_backend=backend)
    assert llm.llm_engine.max_model_len == 512  # the model's: the window caps nothing
    assert_matches(outs, hf_greedy)
    # not degenerate (test_the_window_changes_the_output: the window matters here)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


def test_disable_sliding_window_caps_at_the_window(tiny_mistral_windowed, hf_greedy):
    """disable_sliding_window (vLLM's): full attention, context capped at the window."""
    llm = LLM(model=tiny_mistral_windowed, dtype="float32", num_kv_blocks=64, disable_sliding_window=True)
    assert llm.llm_engine.max_model_len == TINY_WINDOW
    assert all(layer.self_attn.window is None for layer in llm.llm_engine.model.layers)
    prompt = window_prompts()[1]  # 5 tokens: everything it generates stays inside the window
    params = SamplingParams(temperature=0.0, max_tokens=TINY_WINDOW - len(prompt), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy[1][0][: TINY_WINDOW - len(prompt)]


def test_the_window_changes_the_output(tiny_mistral_windowed, hf_greedy):
    """The reference above is windowed for real: without the window, transformers itself scores
    the same tokens differently past the window (else matching it would prove nothing here)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_mistral_windowed, dtype=torch.float32, attn_implementation="eager")
    hf.config.sliding_window = None
    prompt, (toks, windowed_lp) = window_prompts()[-1], hf_greedy[-1]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0], dim=-1)
    full_lp = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks)]
    assert max(abs(a - b) for a, b in zip(full_lp, windowed_lp, strict=True)) > 1e-2
