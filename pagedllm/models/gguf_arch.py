"""What each GGUF architecture (``general.architecture``) is in Hugging Face terms.

A GGUF file names its family once and then uses llama.cpp's names for everything: metadata keys
under ``{arch}.`` and tensors ``token_embd``, ``blk.N.attn_q`` ... Both GGUF loaders (dequantized,
loader_gguf; in blocks, loader_gguf_native) read a file through one ``GGUFArchitecture`` entry of
``GGUF_ARCHITECTURES``: the HF architecture and model_type the config gets, where each config
value is in the metadata, the tensor-name mapping, and whether llama.cpp's converter permuted the
q/k rows. A family whose model class exists (models/registry.py) needs only an entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

# HF config key -> GGUF metadata key (after "{arch}."), as llama.cpp writes the Llama-like families.
LLAMA_METADATA: Mapping[str, str] = MappingProxyType(
    {
        "max_position_embeddings": "context_length",
        "hidden_size": "embedding_length",
        "num_hidden_layers": "block_count",
        "intermediate_size": "feed_forward_length",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "head_dim": "attention.key_length",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "rope_theta": "rope.freq_base",
        "sliding_window": "attention.sliding_window",
    }
)

# Per-layer tensors: "blk.{N}.{gguf}.{weight|bias}" -> "model.layers.{N}.{hf}.{weight|bias}".
LLAMA_BLOCK_TENSORS: Mapping[str, str] = MappingProxyType(
    {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
)
# Model-level tensors.
LLAMA_GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType(
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
)


@dataclass(frozen=True)
class GGUFArchitecture:
    """One GGUF architecture. ``rope_permuted``: llama.cpp's converter reordered each q/k head's rows
    for its adjacent-pair ("normal") RoPE, so the loaders undo it; families llama.cpp runs with NEOX
    RoPE (rotate_half, as HF does) keep HF's row order. ``config``: fixed config.json values of the
    family (what its HF config would say and the metadata does not)."""

    hf_architecture: str
    model_type: str
    rope_permuted: bool
    block_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_BLOCK_TENSORS)
    global_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_GLOBAL_TENSORS)
    metadata: Mapping[str, str] = field(default_factory=lambda: LLAMA_METADATA)
    config: Mapping[str, Any] = field(default_factory=dict)
    # Tensors that hold config values, not weights (Phi-3's LongRoPE factors): the converter reads
    # them into config.json, and neither loader makes a weight of them.
    config_tensors: frozenset[str] = frozenset()
    # GPT-2's checkpoint layout: layers under "transformer.h.N.", and the block kinds HF stores as
    # Conv1D weights ([in, out]) that llama.cpp's converter transposed to [out, in]
    layer_prefix: str = "model.layers"
    conv1d: frozenset[str] = frozenset()
    # Llama-like: the config gets the RoPE / RMSNorm / SiLU keys and the native loader runs it
    llama_like: bool = True

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a tensor, e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
        base, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in self.block_tensors:
            return f"{self.layer_prefix}.{parts[1]}.{self.block_tensors[parts[2]]}.{kind}"
        if base in self.global_tensors:
            return f"{self.global_tensors[base]}.{kind}"
        raise ValueError(f"Unsupported GGUF tensor {gguf_name!r} for a {self.hf_architecture} model")

    def to_hf_layout(self, gguf_name: str, w: np.ndarray) -> np.ndarray:
        """A dequantized tensor [out, in] in the HF checkpoint's layout (GPT-2's Conv1D: [in, out])."""
        base, _, kind = gguf_name.rpartition(".")
        return w.T if kind == "weight" and w.ndim == 2 and base.rpartition(".")[2] in self.conv1d else w

    def to_hf_rows(self, gguf_name: str, rows: np.ndarray, n_head: int, n_kv_head: int) -> np.ndarray:
        """``rows`` (a tensor's values or its quantized byte rows, [out, ...]) in HF's row order."""
        if not self.rope_permuted:
            return rows
        if ".attn_q." in gguf_name:
            return unpermute_rows(rows, n_head)
        if ".attn_k." in gguf_name:
            return unpermute_rows(rows, n_kv_head)
        return rows


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(weights, n_head, n_head_kv)`` applied to q/k projections.

    HF Llama applies RoPE to the two *halves* of each head (rotate_half); llama.cpp rotates
    *adjacent pairs*. Its converter reorders each head's rows from (2, head_dim/2) to (head_dim/2, 2);
    we reshape with that permuted layout and swap the two axes back. Works for weights [out, in],
    1-D biases [out] and byte rows of quantized blocks [out, row_bytes] (whole rows move, exactly).
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_ARCHITECTURES: Mapping[str, GGUFArchitecture] = MappingProxyType(
    {
        "llama": GGUFArchitecture("LlamaForCausalLM", "llama", rope_permuted=True, config={"mlp_bias": False}),
        # q/k/v biases (the class's own: Qwen2's config has no switch for them), NEOX RoPE
        "qwen2": GGUFArchitecture(
            "Qwen2ForCausalLM", "qwen2", rope_permuted=False, config={"use_sliding_window": False}
        ),
        # per-head RMSNorm of q and k before RoPE, NEOX RoPE
        "qwen3": GGUFArchitecture(
            "Qwen3ForCausalLM",
            "qwen3",
            rope_permuted=False,
            block_tensors=MappingProxyType(
                {**LLAMA_BLOCK_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
            ),
            config={"use_sliding_window": False},
        ),
        # LayerNorm decoder, learned positions, fused q/k/v; llama.cpp writes output as a copy of
        # token_embd (tied); dequantized only (the native loader builds Llama-like layers)
        "gpt2": GGUFArchitecture(
            "GPT2LMHeadModel",
            "gpt2",
            rope_permuted=False,
            block_tensors=MappingProxyType(
                {
                    "attn_norm": "ln_1",
                    "attn_qkv": "attn.c_attn",
                    "attn_output": "attn.c_proj",
                    "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc",
                    "ffn_down": "mlp.c_proj",
                }
            ),
            global_tensors=MappingProxyType(
                {
                    "token_embd": "transformer.wte",
                    "position_embd": "transformer.wpe",
                    "output_norm": "transformer.ln_f",
                    "output": "lm_head",
                }
            ),
            metadata=MappingProxyType(
                {
                    "n_positions": "context_length",
                    "n_embd": "embedding_length",
                    "n_layer": "block_count",
                    "n_inner": "feed_forward_length",
                    "n_head": "attention.head_count",
                    "layer_norm_epsilon": "attention.layer_norm_epsilon",
                }
            ),
            config={"activation_function": "gelu_new"},
            layer_prefix="transformer.h",
            conv1d=frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"}),
            llama_like=False,
        ),
        # q/k/v and [gate; up] fused as in the HF checkpoints, NEOX RoPE; LongRoPE's factors as
        # tensors (read into rope_scaling by loader_gguf)
        "phi3": GGUFArchitecture(
            "Phi3ForCausalLM",
            "phi3",
            rope_permuted=False,
            block_tensors=MappingProxyType(
                {
                    "attn_qkv": "self_attn.qkv_proj",
                    "attn_output": "self_attn.o_proj",
                    "ffn_up": "mlp.gate_up_proj",
                    "ffn_down": "mlp.down_proj",
                    "attn_norm": "input_layernorm",
                    "ffn_norm": "post_attention_layernorm",
                }
            ),
            config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
        ),
    }
)


def gguf_architecture(name: str | None, source: str = "GGUF file") -> GGUFArchitecture:
    """The entry for ``general.architecture`` ``name``; a ValueError naming it and the supported ones."""
    entry = GGUF_ARCHITECTURES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {name!r} (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    return entry
