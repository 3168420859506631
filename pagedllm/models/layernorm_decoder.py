"""The decoder GPT-2 and OPT share: learned absolute positions, LayerNorm, biased projections, a
two-matmul MLP, a tied LM head, over a paged KV cache.

The families differ only in what their configs set (pre- or post-LN, a position offset, a
word-embedding width other than the hidden size, the activation, where the query is scaled) and
in their checkpoints' names and layouts: gpt2.py and opt.py turn both into a ``DecoderSpec`` and
name each checkpoint tensor in this module's terms (``own_name``); the math lives here once.
Numerics follow transformers (nn.LayerNorm, the same order of operations) so fp32 greedy output
matches it token for token.

The projections, the token embedding and the head are pagedllm.layers' parallel layers, so a
``tp`` group splits the model as Megatron-LM does: each rank holds its heads of q/k/v and its
columns of fc1 (column-parallel), the matching input columns of o_proj and fc2 (row-parallel,
one all-reduce each), and its rows of the vocabulary. What is small stays whole on every rank:
the LayerNorms, the learned positions, and OPT-350m's project_in / project_out (replicated: a
split would cost two more collectives a step for a 512 x 1024 matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_attention import paged_attention
from pagedllm.layers import (
    CheckpointTensor,
    ColumnParallelLinear,
    LinearMethods,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    finish_layers,
    load_into,
)
from pagedllm.parallel.group import TensorParallelGroup

# transformers' activation names this decoder implements. "gelu_new" is the tanh approximation
# (GPT-2's), the same function as torch's approximate="tanh".
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class DecoderSpec:
    """One family's decoder, in the terms this module computes it in."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    max_positions: int  # learned position rows: the context the model can take
    position_offset: int  # row of position 0 in the position table (OPT: 2)
    embed_dim: int  # word-embedding width; != hidden_size: project_in / project_out around the layers
    activation: str
    norm_eps: float
    norm_affine: bool  # LayerNorms with weight and bias
    pre_norm: bool  # LayerNorm before attention / MLP (else after the residual add)
    final_norm: bool  # a LayerNorm after the last layer
    bias: bool  # biases on every projection of the layers
    prescale_query: bool  # q * scale before attention, attention at scale 1 (OPT's order)
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of the {self.num_heads} heads")


def check_activation(name: str, family: str) -> None:
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"{family}: activation_function {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        )


class Attention(nn.Module):
    """Multi-head attention over this rank's heads (all of them without ``tp``)."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.head_dim = spec.hidden_size // spec.num_heads
        self.scale = self.head_dim**-0.5
        self.prescale_query = spec.prescale_query
        h = spec.hidden_size
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, spec.num_heads, spec.num_heads, spec.bias, tp)
        self.num_heads = self.num_kv_heads = self.qkv_proj.num_heads  # this rank's
        self.o_proj = RowParallelLinear(h, h, spec.bias, tp)

    def forward(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        # the local output is [q; k; v] of this rank's heads, three equal parts
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        scale = self.scale
        if self.prescale_query:
            q, scale = q * self.scale, 1.0
        o = paged_attention(q, k.contiguous(), v.contiguous(), k_cache, v_cache, meta, scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(spec.hidden_size, spec.ffn_dim, spec.bias, tp)
        self.fc2 = RowParallelLinear(spec.ffn_dim, spec.hidden_size, spec.bias, tp, fine_input_scales=True)
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.pre_norm = spec.pre_norm
        self.attn_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
        self.self_attn = Attention(spec, tp)
        self.mlp_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
        self.mlp = MLP(spec, tp)

    def forward(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.attn_norm(x), k_cache, v_cache, meta)
            return x + self.mlp(self.mlp_norm(x))
        # post-LN (OPT-350m): each sublayer's output added to its input, then normalised
        x = self.attn_norm(x + self.self_attn(x, k_cache, v_cache, meta))
        return self.mlp_norm(x + self.mlp(x))


class LearnedPositionDecoder(nn.Module):
    """``forward(input_ids[T], positions[T], kv_caches, meta)`` -> final hidden states [T, embed_dim].
    ``tp``: this rank's tensor-parallel group (None: the whole model).

    A family subclass sets ``family`` and ``make_spec`` (its config -> DecoderSpec) and implements
    ``own_name``: where a checkpoint tensor goes in this module (see load_weights)."""

    family = "decoder"  # the family's name in messages
    make_spec: Callable[[object], DecoderSpec]

    def __init__(self, hf_config, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.tensor_parallel_size = 1 if tp is None else tp.world_size
        spec = type(self).make_spec(hf_config)
        if max_model_len > spec.max_positions:
            # Positions past the table have no embedding: refuse rather than index out of it.
            raise ValueError(
                f"max_model_len={max_model_len} exceeds {self.family}'s {spec.max_positions} learned positions."
            )
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.embed_dim, tp)
        self.embed_positions = nn.Embedding(spec.max_positions + spec.position_offset, spec.hidden_size)
        projected = spec.embed_dim != spec.hidden_size
        self.project_in = ColumnParallelLinear(spec.embed_dim, spec.hidden_size) if projected else None
        self.layers = nn.ModuleList(DecoderLayer(spec, tp) for _ in range(spec.num_layers))
        self.final_norm = (
            nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
            if spec.final_norm
            else None
        )
        self.project_out = ColumnParallelLinear(spec.hidden_size, spec.embed_dim) if projected else None
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head = ParallelLMHead(
            spec.vocab_size, spec.embed_dim, tp, self.embed_tokens if self.tie_word_embeddings else None
        )
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + self.spec.position_offset)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, k_cache, v_cache, meta)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only when it has to)."""
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of the logits per row without writing them, where the head can; else None."""
        return self.lm_head.argmax(hidden)

    def activation_dtype(self) -> torch.dtype:
        """dtype of the hidden states: the learned positions' (a plain float parameter on every
        path, where the token embedding may hold GGUF blocks)."""
        return self.embed_positions.weight.dtype

    def init_computed_buffers(self, device: torch.device) -> None:
        """Nothing to compute: the positions are learned, every tensor comes from the checkpoint."""

    # ---- weights -------------------------------------------------------------------------
    def own_name(self, name: str, t: CheckpointTensor) -> tuple[str, CheckpointTensor, int | None] | None:
        """Where checkpoint tensor ``name`` goes: (this module's name for it, the tensor in
        nn.Linear's [out, in] layout, its part of a fused layer or None), or None for a tensor
        that is not a weight. A name it does not know it returns as it is, for load_into to
        refuse. The family's part."""
        raise NotImplementedError

    def load_weights(self, tensors: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Takes Hugging Face-named checkpoint tensors (float, or GGUF block rows); each layer
        keeps its shard (pagedllm.layers). A tied head's saved copy of the embedding is skipped:
        the head reads the embedding's rows."""
        for name, t in tensors:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            own = self.own_name(name, t)
            if own is not None:
                load_into(self, *own)

    def finish_weights(self, methods: LinearMethods) -> None:
        """Builds every layer's GEMM in the loader's weight formats (after load_weights)."""
        finish_layers(self, methods)
