"""What each GGUF architecture (``general.architecture``) is in Hugging Face terms.

A GGUF file names its family once and then uses llama.cpp's names for everything: metadata keys
under ``{arch}.`` and tensors ``token_embd``, ``blk.N.attn_q`` ... Both GGUF loaders (dequantized,
loader_gguf; in blocks, gguf_weights) read a file through one ``GGUFArchitecture`` entry of
``GGUF_ARCHITECTURES``: the HF architecture and model_type the config gets, where each config
value is in the metadata, the tensor-name mapping, and whether llama.cpp's converter permuted the
q/k rows. A family whose model class exists (models/registry.py) needs only an entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    # HF names' endings of the row-parallel weights (split by input columns under tensor parallelism)
    row_parallel: tuple[str, ...] = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    # Llama-like: the converted config gets the RoPE / RMSNorm / SiLU keys (else the family's own)
    llama_like: bool = True
    # What llama.cpp's converter added to every norm weight (Gemma's x * (1 + w) is stored as w + 1,
    # since llama.cpp multiplies by the stored weight): both loaders subtract it again
    norm_shift: float = 0.0
    # The family's config values llama.cpp does not store but hard-codes by architecture: filled
    # into the Llama-like config (Gemma 3's layer types, local RoPE base, attention scale)
    derive_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None

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

    def value_shift(self, gguf_name: str) -> float:
        """What to subtract from a tensor's values to get HF's: ``norm_shift`` on a norm weight."""
        base, _, kind = gguf_name.rpartition(".")
        return self.norm_shift if kind == "weight" and base.endswith("norm") else 0.0

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


# llama.cpp's Gemma 3: what it assumes rather than reads (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SWA_PATTERN = 6  # every 6th layer attends globally, the other five through the window
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # the sliding layers' RoPE base, unscaled
GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim)


def gemma3_config(values: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's HF config from a file's Llama-like values, deriving what llama.cpp hard-codes:
    ``layer_types`` (pattern 6; all global without a window), the local RoPE base, and
    ``query_pre_attn_scalar`` from the size as llama.cpp computes the attention scale."""
    n, window = values["num_hidden_layers"], values.get("sliding_window")
    values["layer_types"] = [
        "sliding_attention" if window and (i + 1) % GEMMA3_SWA_PATTERN else "full_attention" for i in range(n)
    ]
    if n == GEMMA3_27B_LAYERS:
        values["query_pre_attn_scalar"] = values["hidden_size"] // values["num_attention_heads"]
    else:
        values["query_pre_attn_scalar"] = values["head_dim"]
    values["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
    del values["hidden_act"]  # Gemma's config names its activation hidden_activation
    values["hidden_activation"] = "gelu_pytorch_tanh"
    return values


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
        # token_embd (tied)
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
            row_parallel=("attn.c_proj.weight", "mlp.c_proj.weight"),
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
        # four norms a layer (stored + 1), q/k norms, GeGLU, sliding and global layers, NEOX RoPE,
        # tied head; llama.cpp writes the linear RoPE scaling of the global layers only
        "gemma3": GGUFArchitecture(
            "Gemma3ForCausalLM",
            "gemma3_text",
            rope_permuted=False,
            block_tensors=MappingProxyType(
                {
                    **LLAMA_BLOCK_TENSORS,
                    "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm",
                    "attn_q_norm": "self_attn.q_norm",
                    "attn_k_norm": "self_attn.k_norm",
                }
            ),
            metadata=MappingProxyType({**LLAMA_METADATA, "final_logit_softcapping": "final_logit_softcapping"}),
            norm_shift=1.0,
            derive_config=gemma3_config,
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
