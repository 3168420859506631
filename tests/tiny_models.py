"""Builds tiny random-weight Hugging Face checkpoints (+ a small byte-level BPE tokenizer) for tests."""

from __future__ import annotations

import os

import torch

VOCAB = 512
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks. "
    "A scheduler batches requests continuously; a block table maps logical blocks to physical ones. "
    "def hello(world):\n    return world * 2\n" * 3
)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma's turn format: the template writes the BOS, the assistant's role is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _train_bpe(special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    n = tok.get_vocab_size()
    if n < VOCAB:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - n)])
    return tok


def build_tokenizer(out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = _train_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(out_dir)


def build_gemma_tokenizer(out_dir: str) -> None:
    """Gemma's special-token ids (pad 0, eos 1, bos 2, turn markers) and its BOS handling:
    encoding a text prepends <bos>, as Gemma's tokenizer does."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train_bpe(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    hf.chat_template = GEMMA_TEMPLATE
    hf.save_pretrained(out_dir)


def _init(model: torch.nn.Module, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and name.endswith(".bias"):  # LayerNorm (GPT-2, OPT)
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


# Gemma 3's sliding window: narrower than most test prompts, so its sliding layers attend to only
# part of the context while its full layers see all of it.
GEMMA3_WINDOW = 24

FAMILIES = (
    "llama",
    "llama3_rope",
    "qwen2",
    "mistral",
    "qwen3",
    "gpt2",
    "opt",
    "opt_postln",
    "gemma3",
    "phi3",
    "phi3_partial",
)
# LongRoPE's original context in the tiny Phi-3 models: small, so that test prompts and
# generations fall on both sides of it and cross it.
PHI3_ORIGINAL_MAX = 64


def _longrope(rot_dim: int, seed: int) -> dict:
    """LongRoPE scaling with distinct short and long factors (one per rotary pair)."""
    g = torch.Generator().manual_seed(seed)
    short = 1.0 + 0.5 * torch.rand(rot_dim // 2, generator=g)
    long = 2.0 + 6.0 * torch.rand(rot_dim // 2, generator=g)
    return {
        "rope_type": "longrope",
        "short_factor": short.tolist(),
        "long_factor": long.tolist(),
        "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
    }


def build_model(
    family: str,
    out_dir: str,
    seed: int = 0,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    config_overrides: dict | None = None,
) -> str:
    """Writes a tiny checkpoint of the family into out_dir (if not already there). ``head_dim``:
    "llama" only, an explicit head size instead of hidden_size / heads (16). ``sliding_window``:
    "mistral" only, its attention window (default 4096: wider than any test's context).
    ``config_overrides``: config attributes set before the model is built (a variant of the family)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "llama":  # GQA (4 query heads, 2 KV heads), untied embeddings
        cfg = LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            **({"head_dim": head_dim} if head_dim is not None else {}),
            **common,
        )
        cls = LlamaForCausalLM
    elif family == "llama3_rope":  # llama3 rope scaling, tied embeddings, MHA
        cfg = LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        cls = LlamaForCausalLM
    elif family == "qwen2":  # q/k/v bias, MQA, tied
        cfg = Qwen2Config(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            **common,
        )
        cls = Qwen2ForCausalLM
    elif family == "mistral":  # explicit head_dim different from hidden/heads, sliding window config
        cfg = MistralConfig(  # head_dim 64: the compiled prefill kernel's size (tests/test_cpu_kernels.py)
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=False,
            sliding_window=sliding_window or 4096,
            rope_theta=10000.0,
            **common,
        )
        cls = MistralForCausalLM
    elif family == "qwen3":  # per-head q/k RMSNorm, GQA, head_dim 32 (not hidden/heads), untied
        cfg = Qwen3Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            **common,
        )
        cls = Qwen3ForCausalLM
    elif family == "gpt2":  # Conv1D weights, fused c_attn, learned positions, tied head
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = GPT2LMHeadModel
    elif family in ("opt", "opt_postln"):
        # "opt": pre-LN as OPT-125m; "opt_postln": post-LN with word embeddings narrower than the
        # hidden size (project_in / project_out), as OPT-350m, and so no final LayerNorm
        post = family == "opt_postln"
        cfg = OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            do_layer_norm_before=not post,
            word_embed_proj_dim=32 if post else 64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = OPTForCausalLM
    elif family == "gemma3":  # both layer types (own RoPE each, linear scaling on the global), GQA, tied
        cfg = Gemma3TextConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,  # not head_dim: the attention scale must come from it
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=GEMMA3_WINDOW,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            tie_word_embeddings=True,
            **{**common, "num_hidden_layers": 4, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
        )
        cls = Gemma3ForCausalLM
    elif family == "phi3":  # Phi-3-mini's shape: fused qkv / gate_up, LongRoPE, MHA, untied
        cfg = Phi3Config(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=_longrope(16, seed),
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
            sliding_window=2047,  # as Phi-3's configs: longer than any test context
            pad_token_id=0,
            **common,
        )
        cls = Phi3ForCausalLM
    elif family == "phi3_partial":  # Phi-4-mini's shape: RoPE on 3/4 of each head, LongRoPE, GQA, tied
        cfg = Phi3Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling={**_longrope(12, seed + 1), "partial_rotary_factor": 0.75},
            partial_rotary_factor=0.75,
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
            pad_token_id=0,
            **common,
        )
        cls = Phi3ForCausalLM
    else:
        raise ValueError(family)
    if head_dim is not None and family != "llama":
        raise ValueError(f"head_dim is a 'llama' option, not {family!r}'s")
    if sliding_window is not None and family != "mistral":
        raise ValueError(f"sliding_window is a 'mistral' option, not {family!r}'s")
    for name, value in (config_overrides or {}).items():
        setattr(cfg, name, value)
    torch.manual_seed(seed)
    model = cls(cfg)
    # post-LN through a 32-wide projection: at 0.15 its greedy output settles on a handful of tokens
    _init(model, std=0.3 if family == "opt_postln" else 0.15, seed=seed)
    if family == "qwen2":  # make the biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    (build_gemma_tokenizer if family == "gemma3" else build_tokenizer)(out_dir)
    return out_dir
