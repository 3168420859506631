"""OPT (``OPTForCausalLM``) on the shared LayerNorm decoder (layernorm_decoder.py).

OPT's own: position ids offset by 2 in its table (metaseq's padding convention), pre-LN or post-LN
(``do_layer_norm_before``; OPT-350m is post-LN), word embeddings narrower than the hidden size
through ``project_in`` / ``project_out`` (OPT-350m again), the final LayerNorm only where
transformers builds one (pre-LN, unless ``_remove_final_layer_norm``), the query scaled before
attention, and separate q/k/v projections in the checkpoint (parts 0 / 1 / 2 of the fused QKV
layer here).
"""

from __future__ import annotations

import re

from pagedllm.layers import CheckpointTensor
from pagedllm.models.layernorm_decoder import DecoderSpec, LearnedPositionDecoder, check_activation

POSITION_OFFSET = 2

_LAYER_NAMES = {
    "self_attn_layer_norm": "attn_norm",
    "self_attn.out_proj": "self_attn.o_proj",
    "final_layer_norm": "mlp_norm",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
_QKV_PART = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP_NAMES = {"embed_tokens", "embed_positions", "project_in", "project_out", "final_layer_norm"}


def opt_spec(cfg) -> DecoderSpec:
    check_activation(cfg.activation_function, "OPT")
    pre_norm = bool(cfg.do_layer_norm_before)
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_layers=cfg.num_hidden_layers,
        ffn_dim=cfg.ffn_dim,
        max_positions=cfg.max_position_embeddings,
        position_offset=POSITION_OFFSET,
        embed_dim=cfg.word_embed_proj_dim,
        activation=cfg.activation_function,
        norm_eps=1e-5,  # transformers' nn.LayerNorm default: OPTConfig has no epsilon
        norm_affine=bool(getattr(cfg, "layer_norm_elementwise_affine", True)),
        pre_norm=pre_norm,
        # transformers' OPTDecoder: older fine-tuned checkpoints set _remove_final_layer_norm
        final_norm=pre_norm and not getattr(cfg, "_remove_final_layer_norm", False),
        bias=bool(getattr(cfg, "enable_bias", True)),
        prescale_query=True,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
    )


class OPTForCausalLM(LearnedPositionDecoder):
    family = "OPT"
    make_spec = staticmethod(opt_spec)

    def own_name(self, name: str, t: CheckpointTensor) -> tuple[str, CheckpointTensor, int | None]:
        # "model.decoder.*" (transformers' layout) or "decoder.*" (older checkpoints)
        name = name.removeprefix("model.").removeprefix("decoder.")
        top, _, kind = name.partition(".")
        if top in _TOP_NAMES:
            return f"{'final_norm' if top == 'final_layer_norm' else top}.{kind}", t, None
        m = _LAYER.fullmatch(name)
        if m is not None and m[2] in _QKV_PART:
            return f"layers.{m[1]}.self_attn.qkv_proj.{m[3]}", t, _QKV_PART[m[2]]
        if m is not None and m[2] in _LAYER_NAMES:
            return f"layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}", t, None
        return name, t, None  # lm_head.weight (ours too), or one load_into refuses
