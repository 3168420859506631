"""Greedy output equals Hugging Face transformers, token for token (fp32), for every family."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 32


def make_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 15, 16, 17, 40, 77, 120][:n]
    return [[rng.randrange(3, 512) for _ in range(length)] for length in lengths]


def hf_reference(model_dir: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens from HF generate, and the chosen tokens' log-softmax from a full forward."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # run the full NEW_TOKENS, like ignore_eos
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0]
            toks = seq[len(p) :].tolist()
            logp = torch.log_softmax(hf(seq.unsqueeze(0)).logits[0].float(), dim=-1)
            out.append((toks, [logp[len(p) - 1 + i, t].item() for i, t in enumerate(toks)]))
    return out


def assert_greedy_matches_transformers(model_dir: str, reference=hf_reference, **engine_kwargs) -> list:
    """fp32 greedy tokens of make_prompts() equal HF's, their logprobs within 1e-4; the outputs.
    ``reference``: hf_reference, or another function of (model_dir, prompts) of its shape."""
    prompts = make_prompts()
    ref = reference(model_dir, prompts)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=16, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for (ref_toks, ref_lp), out in zip(ref, outs, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == ref_toks
        ours = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp, strict=True)) < 1e-4
    return outs


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "qwen2", "mistral", "qwen3"])
def test_greedy_matches_transformers(tiny_model_dirs, family):
    outs = assert_greedy_matches_transformers(tiny_model_dirs[family])
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # the tiny models must not be degenerate, or matching would prove little
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_qwen3_matches_transformers_on_each_path(tiny_model_dirs, backend):
    """Qwen3's q/k norms on the fused CPU loop (kernels loaded) and on the reference path. The
    whole-step decode plan has no q/k norm step, so a Qwen3 model must never build one."""
    import pagedllm.kernels

    if backend == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    llm = LLM(model=tiny_model_dirs["qwen3"], dtype="float32", num_kv_blocks=8, attention_backend=backend)
    model = llm.llm_engine.model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (model.kernels is not None) == (backend == "auto")
    assert model._decoder_plan is None
    outs = assert_greedy_matches_transformers(tiny_model_dirs["qwen3"], attention_backend=backend)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


def test_text_prompt_and_detokenization_match_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    prompt = "The quick brown fox"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == prompt
    assert out.outputs[0].token_ids == ref.tolist()
    assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "qwen2", "mistral", "qwen3"])
def test_rope_tables_equal_transformers(tiny_model_dirs, family):
    """RoPE tables are made without transformers' LlamaRotaryEmbedding (its module is ~70 MB of
    imports); they must still be its tables bit for bit, default and scaled types alike."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedllm.models.rope import RotaryEmbedding

    cfg = AutoConfig.from_pretrained(tiny_model_dirs[family])
    ours = RotaryEmbedding(cfg, 300)
    hf = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 300, cfg.hidden_size)
    cos, sin = hf(x, torch.arange(300).unsqueeze(0))
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
