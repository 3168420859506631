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


def build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    n = tok.get_vocab_size()
    if n < VOCAB:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - n)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.save_pretrained(out_dir)


def _init(model: torch.nn.Module, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


FAMILIES = ("llama", "llama3_rope", "qwen2", "mistral", "qwen3", "phi3", "phi3_partial")
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


def build_model(family: str, out_dir: str, seed: int = 0, head_dim: int | None = None) -> str:
    """Writes a tiny checkpoint of the family into out_dir (if not already there). ``head_dim``:
    "llama" only, an explicit head size instead of hidden_size / heads (16)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
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
            sliding_window=4096,
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
    torch.manual_seed(seed)
    model = cls(cfg)
    _init(model, std=0.15, seed=seed)
    if family == "qwen2":  # make the biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir
