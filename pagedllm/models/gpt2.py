"""GPT-2 (``GPT2LMHeadModel``) on the shared LayerNorm decoder (layernorm_decoder.py).

What is GPT-2's own: its config's names, the options it refuses, and its checkpoint: Conv1D
weights stored [in, out] (transposed against nn.Linear), q/k/v already fused in ``c_attn``
(the QKV layer splits it into its parts), names with or without the ``transformer.`` prefix, and
the causal-mask buffers older checkpoints saved (``attn.bias`` / ``attn.masked_bias``), which
are not weights. A GGUF file's matrices come as block rows already in [out, in] order (llama.cpp's
converter transposed the Conv1D weights), so only float tensors are transposed here.
"""

from __future__ import annotations

import re

from pagedllm.layers import BlockRows, CheckpointTensor
from pagedllm.models.layernorm_decoder import DecoderSpec, LearnedPositionDecoder, check_activation

# GPT-2 checkpoint name (after "transformer.") -> ours, and whether it is a Conv1D weight ([in, out]).
_LAYER_NAMES = {
    "ln_1": ("attn_norm", False),
    "attn.c_attn": ("self_attn.qkv_proj", True),
    "attn.c_proj": ("self_attn.o_proj", True),
    "ln_2": ("mlp_norm", False),
    "mlp.c_fc": ("mlp.fc1", True),
    "mlp.c_proj": ("mlp.fc2", True),
}
_TOP_NAMES = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "final_norm"}
_LAYER = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def gpt2_spec(cfg) -> DecoderSpec:
    """The decoder a GPT2Config describes; refuses the options this implementation does not compute."""
    unsupported = {
        "scale_attn_by_inverse_layer_idx": True,
        "reorder_and_upcast_attn": True,
        "add_cross_attention": True,
        "scale_attn_weights": False,
    }
    for option, value in unsupported.items():
        if getattr(cfg, option, not value) == value:
            raise NotImplementedError(f"GPT-2: {option}={value} is not supported")
    check_activation(cfg.activation_function, "GPT-2")
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_layers=cfg.num_hidden_layers,
        ffn_dim=cfg.n_inner if cfg.n_inner is not None else 4 * cfg.hidden_size,
        max_positions=cfg.max_position_embeddings,
        position_offset=0,
        embed_dim=cfg.hidden_size,
        activation=cfg.activation_function,
        norm_eps=cfg.layer_norm_epsilon,
        norm_affine=True,
        pre_norm=True,
        final_norm=True,
        bias=True,
        prescale_query=False,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
    )


class GPT2LMHeadModel(LearnedPositionDecoder):
    family = "GPT-2"
    make_spec = staticmethod(gpt2_spec)

    def own_name(self, name: str, t: CheckpointTensor) -> tuple[str, CheckpointTensor, int | None] | None:
        name = name.removeprefix("transformer.")
        if _MASK_BUFFER.fullmatch(name):
            return None
        top, _, kind = name.partition(".")
        if top in _TOP_NAMES:
            return f"{_TOP_NAMES[top]}.{kind}", t, None
        m = _LAYER.fullmatch(name)
        if m is None or m[2] not in _LAYER_NAMES:
            return name, t, None  # lm_head.weight (ours too), or one load_into refuses
        ours, conv1d = _LAYER_NAMES[m[2]]
        if conv1d and m[3] == "weight" and not isinstance(t, BlockRows):
            t = t.t()
        return f"layers.{m[1]}.{ours}.{m[3]}", t, None
