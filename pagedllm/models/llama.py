"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face transformers (RMSNorm in fp32, RoPE tables from transformers' own
rope-init functions: models/rope.py) so greedy output matches it token for token in fp32. q/k/v
and gate/up projections are fused into one matmul each: fewer, larger GEMMs are faster on every
device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_attention import paged_attention
from pagedllm.kernels.interface import CpuKernels
from pagedllm.layers import (
    LinearMethods,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    finish_layers,
    load_into,
)
from pagedllm.models.attention_windows import layer_windows
from pagedllm.models.fused_cpu_decoder import enable_fused_decoder, forward_fused
from pagedllm.models.rope import RotaryEmbedding, apply_rope
from pagedllm.parallel.group import TensorParallelGroup

# checkpoint projections that run fused: name -> (our layer, its part)
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # transformers' exact formula, so fp32 output matches it bit for bit where it can
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x
        # low precision: one fused kernel (fp32 accumulation inside) instead of five ops
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """``qk_norm``: RMSNorm over each head of q and k after the projection, before RoPE (Qwen3).
    Under tensor parallelism (``tp``) the heads this rank holds (QKVParallelLinear)."""

    def __init__(
        self,
        cfg,
        qkv_bias: bool,
        qk_norm: bool = False,
        window: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.window = window  # sliding attention window of this layer (None: the whole context)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        total_q = cfg.num_attention_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_q, cfg.hidden_size, bool(getattr(cfg, "attention_bias", False)), tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, *rope)
        o = paged_attention(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.inter = self.gate_up_proj.out_features // 2  # this rank's columns
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp, fine_input_scales=True)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, qk_norm: bool, window: int | None, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qkv_bias, qk_norm, window, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The decoder over a flat batch: ``forward(input_ids[T], positions[T], kv_caches, meta)``.
    ``tp``: this rank's tensor-parallel group (None: the whole model); every layer holds its shard."""

    qkv_bias_default = False
    qk_norm = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # fused [gate; up] projections whose packed bf16 GEMM may apply silu(gate) * up in its epilogue
    silu_mul_projections: tuple[str, ...] = ("gate_up_proj",)
    rope_class: type[RotaryEmbedding] = RotaryEmbedding

    def __init__(self, hf_config, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.tensor_parallel_size = 1 if tp is None else tp.world_size
        qkv_bias = getattr(cfg, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qkv_bias, self.qk_norm, window, tp) for window in layer_windows(cfg)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp, self.embed_tokens if self.tie_word_embeddings else None
        )
        self.rope = self.rope_class(cfg, max(max_model_len, getattr(cfg, "max_position_embeddings", 0)))
        self.kernels: CpuKernels | None = None  # compiled CPU kernels of the fused path (enable_cpu_kernels)
        self._decoder_plan = None  # float32 decode-only steps in one kernel call (enable_cpu_kernels)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def activation_dtype(self) -> torch.dtype:
        """dtype of the hidden states (the norms' and the float weights')."""
        return self.norm.weight.dtype

    def enable_cpu_kernels(self, kernels: CpuKernels | None) -> bool:
        """Runs bf16 and float32 CPU forwards through the fused kernels (pagedllm.kernels); False
        if not applicable. Any linear layer will do (float, packed, GGUF-quantized): the kernels
        take the activations between them."""
        return enable_fused_decoder(self, kernels)

    def drop_decode_plan(self) -> None:
        """Runs decode-only steps through the fused Python loop too. For benchmarks that time
        attention (attention_timer): the whole-step plan runs it inside one C++ call, out of the
        timer's sight. Production never calls this."""
        self._decoder_plan = None

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(input_ids)
        rope_rows = self.rope.table_rows(positions, meta)
        if self.kernels is not None:
            return forward_fused(self, x, rope_rows, kv_caches, meta)
        rope = self.rope.tables(rope_rows, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, k_cache, v_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only when it has to)."""
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of compute_logits(hidden) per row, without the logits (a greedy-only step's
        [rows, vocab] logits are most of the head's time to write and read back); None when
        only compute_logits serves here."""
        return self.lm_head.argmax(hidden)

    def init_computed_buffers(self, device: torch.device) -> None:
        """RoPE tables are computed, not loaded, and stay fp32 (cast per use, as transformers does)."""
        self.rope = type(self.rope)(self.config, self.rope.max_len).to(device)

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, tensors) -> None:
        """Takes Hugging Face-named checkpoint tensors (an iterable of (name, tensor or GGUF
        block rows)); each layer keeps its shard (pagedllm.layers)."""
        for name, t in tensors:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            module, _, leaf = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj in STACKED_PROJECTIONS:
                target, part = STACKED_PROJECTIONS[proj]
                load_into(self, f"{parent}.{target}.{leaf}", t, part)
            else:
                load_into(self, name, t)

    def finish_weights(self, methods: LinearMethods) -> None:
        """Builds every layer's GEMM in the loader's weight formats (after load_weights)."""
        finish_layers(self, methods, self.silu_mul_projections)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen2's decoder without the q/k/v biases (unless attention_bias), with q_norm / k_norm."""

    qk_norm = True
