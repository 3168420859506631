"""Gemma 3 text decoder (Gemma 3 270M / 1B: ``Gemma3ForCausalLM``, model_type "gemma3_text").

The same paged decoder as llama.py (fused q/k/v and gate/up projections, the same RoPE tables,
weight loading and tied head), with Gemma's differences, numerics as transformers'
modeling_gemma3 computes them:

- embeddings scaled by sqrt(hidden_size), the factor rounded to the embedding dtype first;
- RMSNorm in float32 times (1 + weight), cast back after (GemmaRMSNorm); four per layer:
  around the attention and around the MLP (pre and post);
- per-head q / k norms before RoPE, attention scale ``query_pre_attn_scalar ** -0.5``;
- a GeGLU MLP (tanh-approximated gelu on the gate);
- ``layer_types``: "sliding_attention" layers use their own RoPE table (``rope_local_base_freq``,
  transformers' ``rope_parameters["sliding_attention"]``), "full_attention" layers the global one
  (``rope_theta`` with its scaling); the sliding layers attend to the last ``sliding_window``
  positions (paged_attention's window), the full ones to the whole sequence.

It runs the plain PyTorch layers; attention goes through paged_attention, so the compiled
attention kernels serve it where the runner chose them. The fused CPU layer loop
(fused_cpu_decoder.py) is not used: it assumes Llama's norms and silu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.interface import CpuKernels
from pagedllm.layers import MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from pagedllm.models.attention_windows import layer_windows
from pagedllm.models.llama import Attention, LlamaForCausalLM
from pagedllm.models.rope import RotaryEmbedding
from pagedllm.parallel.group import TensorParallelGroup

LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    """RMSNorm as Gemma computes it: in float32, times (1 + weight), cast back only at the end
    (Llama casts before the weight). Checkpoints store the weight centred on 0."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Attention):
    """Llama's attention (its forward) with Gemma's q / k norms and scale. ``window``: a
    "sliding_attention" layer's sliding window, None on a "full_attention" layer."""

    def __init__(self, cfg, window: int | None, tp: TensorParallelGroup | None) -> None:
        super().__init__(cfg, qkv_bias=bool(getattr(cfg, "attention_bias", False)), window=window, tp=tp)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)


class GeGLUMLP(nn.Module):
    """down(gelu_tanh(gate) * up), gate and up from one fused projection."""

    def __init__(self, cfg, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"Gemma 3 hidden_activation {act!r} is not supported")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp)
        self.inter = self.gate_up_proj.out_features // 2  # this rank's columns
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, fine_input_scales=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Both sublayers normed on the way in and on the way out, before the residual add."""

    def __init__(self, cfg, layer_type: str, window: int | None, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = layer_type  # which RoPE table it takes
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(cfg, window, tp)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GeGLUMLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def unsupported_gemma3_setting(cfg) -> str | None:
    """Why this config asks for what the decoder does not compute, or None."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            return f"{name}={getattr(cfg, name)}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True"
    unknown = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if unknown:
        return f"layer_types {unknown}"
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        return f"{len(cfg.layer_types)} layer_types for {cfg.num_hidden_layers} layers"
    return None


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Gemma 3 text decoder over a flat batch, with LlamaForCausalLM's head, weight loading
    and bf16 packing. Its layers are its own, so it builds them itself (not Llama's __init__)."""

    silu_mul_projections = ()  # its gate is gelu: a packed GEMM must not apply silu

    def __init__(self, hf_config, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        refusal = unsupported_gemma3_setting(cfg)
        if refusal is not None:
            raise NotImplementedError(f"Gemma 3 with {refusal} is not supported")
        self.config = cfg
        self.tensor_parallel_size = 1 if tp is None else tp.world_size
        self.layer_types = list(cfg.layer_types)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, t, w, tp) for t, w in zip(self.layer_types, layer_windows(cfg), strict=True)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp, self.embed_tokens if self.tie_word_embeddings else None
        )
        # positions never reach max_model_len: the engine caps every sequence there
        self._rope_len = max_model_len
        self.ropes = self._rope_tables()
        self.kernels: CpuKernels | None = None  # the fused CPU layer loop is Llama's only
        self._decoder_plan = None
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def _rope_tables(self) -> nn.ModuleDict:
        return nn.ModuleDict(
            {t: RotaryEmbedding(self.config, self._rope_len, t) for t in sorted(set(self.layer_types))}
        )

    def init_computed_buffers(self, device: torch.device) -> None:
        """The RoPE tables again, computed (built on the meta device they hold no values)."""
        self.ropes = self._rope_tables().to(device)

    def enable_cpu_kernels(self, kernels: CpuKernels | None) -> bool:
        """Always False: the fused layer kernels compute Llama's norms and silu, not Gemma's.
        The compiled attention kernels still serve (the runner puts them in AttentionMetadata)."""
        return False

    def embedding_scale(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """sqrt(hidden_size) as transformers applies it: a float32 scalar rounded to ``dtype``
        (bf16 makes sqrt(1152) = 33.94 into 34.0), multiplied in that dtype."""
        return torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(device=device, dtype=dtype)

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(input_ids)
        x = x * self.embedding_scale(x.dtype, x.device)
        ropes = {t: rope.tables(positions, x.dtype) for t, rope in self.ropes.items()}
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, ropes[layer.layer_type], k_cache, v_cache, meta)
        return self.norm(x)
