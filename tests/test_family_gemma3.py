"""Gemma 3 (text) equals Hugging Face transformers: greedy tokens, logprobs, tokenization."""

from __future__ import annotations

import pytest
import torch
from test_fidelity import assert_greedy_matches_transformers, hf_reference, make_prompts
from tiny_models import GEMMA3_WINDOW

from pagedllm import LLM, SamplingParams


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_matches_transformers_on_each_path(tiny_model_dirs, backend):
    """fp32 greedy output of both layer types equals transformers' with the compiled attention
    kernels (where they build) and on the pure PyTorch path."""
    import pagedllm.kernels

    if backend == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    outs = assert_greedy_matches_transformers(tiny_model_dirs["gemma3"], attention_backend=backend)
    # the tiny model must not be degenerate, or matching would prove little
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


def test_the_window_changes_transformers_scores(tiny_model_dirs):
    """The reference is windowed for real: the prompts outgrow the window, and with a window wider
    than them transformers itself scores the same tokens differently (else matching it would
    prove nothing about the sliding layers)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs["gemma3"]
    prompts = make_prompts()
    assert max(len(p) for p in prompts) > 2 * GEMMA3_WINDOW
    prompt = prompts[-1]
    toks, windowed_lp = hf_reference(model_dir, [prompt])[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, sliding_window=4096)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0], dim=-1)
    full_lp = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(toks)]
    assert max(abs(a - b) for a, b in zip(full_lp, windowed_lp, strict=True)) > 1e-2


def test_bf16_follows_transformers_bf16(tiny_model_dirs):
    """bf16 (packed GEMMs where they run, without the silu epilogue: Gemma's gate is gelu)
    follows transformers' bf16 greedy tokens, except after a near-tie of its top two logprobs."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs["gemma3"]
    prompts = [[2, 5, 9, 200, 3], [2, *range(10, 60)], [2] + [7] * 23]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    llm = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=64)
    assert not getattr(llm.llm_engine.model.layers[0].mlp.gate_up_proj.local, "fused_silu_mul", False)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    with torch.no_grad():
        for p, out in zip(prompts, outs, strict=True):
            comp = out.outputs[0]
            logp = torch.log_softmax(hf(torch.tensor([p + comp.token_ids])).logits[0].float(), dim=-1)
            for i, tok in enumerate(comp.token_ids):
                row = logp[len(p) - 1 + i]
                top2 = row.topk(2).values
                if tok != row.argmax().item():
                    assert top2[0] - top2[1] < 0.1, f"diverged at step {i} without a near-tie: {top2}"
                    break
                assert abs(comp.logprobs[i][tok].logprob - row[tok].item()) < 0.1
                compared += 1
    assert compared >= 12


def test_model_keeps_both_layer_types_and_no_fused_layers(tiny_model_dirs):
    llm = LLM(model=tiny_model_dirs["gemma3"], dtype="float32", num_kv_blocks=8)
    model = llm.llm_engine.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.kernels is None  # the fused layer loop computes Llama's norms, never Gemma's
    assert [layer.self_attn.window for layer in model.layers] == [GEMMA3_WINDOW, None, GEMMA3_WINDOW, None]
    assert llm.llm_engine.max_model_len == 512  # the model's own context: the window caps nothing
    assert sorted(model.ropes) == ["full_attention", "sliding_attention"]


def test_rope_tables_equal_transformers_per_layer_type(tiny_model_dirs):
    """The local table (its own base) and the global one (linear scaling) are transformers' own."""
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from pagedllm.models.rope import RotaryEmbedding

    cfg = AutoConfig.from_pretrained(tiny_model_dirs["gemma3"])
    hf = Gemma3RotaryEmbedding(cfg)
    x = torch.zeros(1, 300, cfg.hidden_size)
    tables = {}
    for layer_type in ("sliding_attention", "full_attention"):
        ours = RotaryEmbedding(cfg, 300, layer_type)
        cos, sin = hf(x, torch.arange(300).unsqueeze(0), layer_type)
        assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
        tables[layer_type] = ours.cos
    assert not torch.equal(tables["sliding_attention"], tables["full_attention"])


def test_text_and_chat_prompts_start_with_bos_as_transformers(tiny_model_dirs):
    """A text prompt is encoded with Gemma's BOS; a chat prompt gets it from the template alone
    (not twice), and greedy output equals transformers' for the same ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dirs["gemma3"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    prompt = "The quick brown fox"
    ids = tok(prompt).input_ids
    assert ids[0] == tok.bos_token_id == 2
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids) :]
    assert out.outputs[0].token_ids == ref.tolist()

    messages = [{"role": "user", "content": "Paged attention stores keys"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_ids[0] == 2 and chat_ids[1] != 2
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == list(chat_ids)


@pytest.mark.parametrize(
    "setting",
    [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0}, {"use_bidirectional_attention": True}],
)
def test_unimplemented_settings_are_refused(tiny_model_dirs, setting):
    from transformers import AutoConfig

    from pagedllm.models.gemma3 import Gemma3ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dirs["gemma3"], **setting)
    with pytest.raises(NotImplementedError, match=next(iter(setting))):
        Gemma3ForCausalLM(cfg, 64)
